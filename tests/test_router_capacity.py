"""The router's own bounds under a burst and against a client that stops reading (S4, S9), on a real
router + prefill + decode trio. From an outside probe: 1,000 concurrent requests failed a third of
themselves (legs queued in the connection pool while decode's pages waited: a transfer stall; calls
signed long before they went out: refused as stale and shown to the tenant as a 401), and a client
that never read its stream kept its connection, and everything generated for it, for ever."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import contextlib
import json
import socket
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
import requests
from pd_harness import client, deployment, metric, pools_used, served_model, wait_pools_empty
from waiting import until, wait_for

from kvguard.workers.backpressure import Slots
from kvguard.workers.launcher import LocalDeployment
from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.protocol import FinishEvent, GenerateRequest, SamplingParams, TokenEvent
from kvguard.workers.router import ChoicePace, Siblings, _paced

WRITE_TIMEOUT_S = 3.0
SLOTS = 4


@pytest.fixture(scope="module")
def narrow(tiny_model_dir: Path) -> Iterator[LocalDeployment]:
    """Four generations at a time, and a short write timeout (the defaults are 512 and 30 s)."""
    with deployment(tiny_model_dir, max_inflight_choices=SLOTS, write_timeout_s=WRITE_TIMEOUT_S) as running:
        yield running


def completion(d: LocalDeployment, prompt: str, **extra: object) -> requests.Response:
    body = {"model": served_model(d), "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    return requests.post(f"{d.api_base}/completions", json=body, timeout=60)


def test_a_burst_beyond_the_slots_waits_in_the_router_and_every_request_is_served(narrow: LocalDeployment) -> None:
    """24 requests of 2 choices against 4 slots: each generation waits its turn holding nothing on
    the workers; all 24 answer 200 with their 2 choices (before, a burst past the connection pool
    ended in 502s and 401s)."""
    with cf.ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(lambda i: completion(narrow, f"burst {i}", n=2), range(24)))
    assert [a.status_code for a in answers] == [200] * 24, [a.text for a in answers if a.status_code != 200][:2]
    assert all(len(a.json()["choices"]) == 2 for a in answers)
    assert metric(narrow, "router", "kvguard_router_waiting_choices") == 0
    wait_pools_empty(narrow)


def stalled_stream(d: LocalDeployment, max_tokens: int = 900, n: int = SLOTS) -> socket.socket:
    """A streaming request from a socket that reads nothing: a tiny receive window, so that the
    router's writes block once the kernel's and aiohttp's buffers are full."""
    url = urlsplit(d.router_url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((url.hostname, url.port))
    # 20 alternatives per token, 4 choices: ~5 MB in all, more than the kernel's send buffer (up to 4 MB
    # by default) and aiohttp's hold
    body = json.dumps({"model": served_model(d), "messages": [{"role": "user", "content": "never read"}], "max_tokens": max_tokens,
                       "temperature": 0, "logprobs": True, "top_logprobs": 20, "n": n, "stream": True}).encode()  # fmt: skip
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    assert sock.recv(1, socket.MSG_PEEK) == b"H"  # the answer has begun: its choices hold the slots
    return sock


def read_all(sock: socket.socket) -> bytes:
    received = b""
    sock.settimeout(30)
    with contextlib.suppress(ConnectionResetError):  # the router resets the connection once the buffered bytes are read
        while chunk := sock.recv(1 << 16):
            received += chunk
    return received


def read_until_the_end(sock: socket.socket) -> bytes:
    """A stream's whole answer: up to its last chunk (the connection stays open for the next request)."""
    received = b""
    sock.settimeout(30)
    while not received.endswith(b"\r\n0\r\n\r\n") and (chunk := sock.recv(1 << 16)):
        received += chunk
    return received


class SlowReader:
    """A streaming client that takes 8 KB of its answer each time it is asked: the caller's poll
    sets its pace. `reset` once the router has reset its connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.received, self.reset = sock, b"", False

    def read_some(self) -> None:
        try:
            self.received += self.sock.recv(8192)
        except ConnectionResetError:
            self.reset = True


def slow_first_tokens(d: LocalDeployment) -> float:
    """How many of the router's TTFT observations took over 2.5 s."""
    ttft = "kvguard_router_time_to_first_token_seconds"
    return metric(d, "router", f"{ttft}_count") - metric(d, "router", f"{ttft}_bucket", le="2.5")


def test_a_client_that_reads_nothing_loses_its_connection(narrow: LocalDeployment) -> None:
    """Once a write to it has waited WRITE_TIMEOUT_S with nothing delivered, the connection is reset:
    before, a client that stopped reading kept it, and the output buffered for it, for ever."""
    stalled = stalled_stream(narrow)
    try:
        answer = completion(narrow, "the next tenant")
        assert answer.status_code == 200, answer.text
        wait_for(lambda: metric(narrow, "router", "kvguard_aborts_total", cause="client_disconnect") >= 1,
                 "the stalled client's connection to be reset")  # fmt: skip
        received = read_all(stalled)
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received  # cut off, not finished
    finally:
        stalled.close()
    wait_pools_empty(narrow)


def test_readers_of_finished_answers_are_as_many_as_the_slots_at_most(tiny_model_dir: Path) -> None:
    """A review: once slots came back at a generation's end, the answers buffered for slow readers
    were bounded by connections only (20,000 x up to ~20 MB). Now the generations whose clients
    still read them are at most as many as the slots: here one slow reader's SLOTS generations fill
    that room, and once it has read for longer than the grace (the write timeout), the generations
    of the next slow reader take the places of the oldest, whose client loses its connection. (A
    client that keeps up never needs a place, nor one whose whole answer is in the kernel's
    buffers: its request ends with its generation, or with its last write.) Answers of ~10 MB, more
    than the kernel and aiohttp hold, so the router still writes them while the clients read."""
    # A pool of 4 contexts: the room that requests of several choices share (`Router._pace`: the
    # pool less one context) holds all SLOTS choices of 2,000 tokens at once, so they end at the
    # workers together. (In a pool of 2 contexts they ran two and two, the second two only once
    # the first had ended, and under load the test did not see the room fill.)
    with deployment(tiny_model_dir, context_length=4096, kv_pool_tokens=16384, max_inflight_choices=SLOTS,
                    write_timeout_s=WRITE_TIMEOUT_S) as roomy:  # fmt: skip
        slow = SlowReader(stalled_stream(roomy, max_tokens=2000))
        ended_at: list[float] = []

        def ended_and_read_past_the_grace() -> bool:
            slow.read_some()
            if not ended_at and metric(roomy, "decode", "kvguard_requests_total", outcome="finished") >= SLOTS:
                ended_at.append(time.monotonic())  # all its generations ended at the workers: they fill the room
            return bool(ended_at) and time.monotonic() - ended_at[0] > WRITE_TIMEOUT_S + 1.0

        try:
            # The poll's interval is the client's pace: 8 KB every 0.2 s, a slow reader, never a stalled one.
            wait_for(ended_and_read_past_the_grace, "the slow reader's generations to end and age past the grace", 120, 0.2)
            # A second slow reader: its generations end while it still reads, and need places.
            newcomer = SlowReader(stalled_stream(roomy, max_tokens=2000))

            def oldest_cut_off() -> bool:
                newcomer.read_some()
                slow.read_some()
                return slow.reset

            try:
                wait_for(oldest_cut_off, "the oldest slow reader to lose its connection", 120, 0.2)
            finally:
                newcomer.sock.close()
        finally:
            slow.sock.close()
        assert slow.reset and slow.received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in slow.received  # cut off
        wait_pools_empty(roomy)


@pytest.fixture(scope="module")
def paced(tiny_model_dir: Path) -> Iterator[LocalDeployment]:
    """Four generations at a time, a write timeout longer than the test, and every engine step 5 ms
    long: the stalled stream's 900 tokens take seconds to generate whatever the machine's speed."""
    with deployment(tiny_model_dir, "delay_step_ms=5", max_inflight_choices=SLOTS, write_timeout_s=120.0) as running:
        yield running


def test_a_slow_readers_slots_go_back_when_its_generations_end_not_when_it_has_read_them(paced: LocalDeployment) -> None:
    """Slots bound what the workers run. An outside probe: two sockets reading 400 B/s held every
    slot for as long as they liked (each read a little every check, so no write ever stalled) while
    decode sat idle, and every other tenant got a 504. Now a generation's slot comes back when decode
    has finished it and prefill has answered; its client keeps its connection and its whole answer."""
    slow_before = slow_first_tokens(paced)
    stalled = stalled_stream(paced)
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(completion, paced, "the next tenant")
            # Every slot is the stalled stream's while decode generates it: the next request waits...
            wait_for(lambda: metric(paced, "router", "kvguard_router_waiting_choices") == 1, "the next request to wait for the slot")
            # ...until decode has finished those generations, long before the client reads them (or
            # the 120 s write timeout would drop it: before, the next tenant waited for that).
            answer = waiting.result(timeout=90)
        assert answer.status_code == 200, answer.text
        # Its TTFT, as its client saw it, counts the wait for the slot (it was measured from the
        # slot, and a queueing candidate looked no slower).
        assert slow_first_tokens(paced) >= slow_before + 1
        received = read_until_the_end(stalled)
    finally:
        stalled.close()
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in received, received[-200:]  # all of it
    assert metric(paced, "router", "kvguard_aborts_total", cause="client_disconnect") == 0
    wait_pools_empty(paced)


@pytest.mark.parametrize("token_channel", [True, False])
def test_a_slow_reader_gives_the_shared_room_back_when_its_generations_end_at_the_workers(
    tiny_model_dir: Path, token_channel: bool,
) -> None:
    """Requests of several choices share one room in decode's pool (`Router._pace`). A review: a
    choice gave its part back only when its client had read its last event, so one client that
    reads nothing kept the room full long after decode had freed the pages, and every other
    tenant's request of several choices waited for it (here: a 504). It comes back when the
    generation has ended at both workers, as its router slot does. With --token-channel off too:
    decode's engine frees the pages whatever its handler has written, and the router read decode's
    own stream only as fast as the client read (a review: the same 504 with decode's pool empty)."""
    with deployment(tiny_model_dir, "delay_step_ms=5", context_length=1024, kv_pool_tokens=4096,
                    write_timeout_s=120.0, request_timeout_s=10.0, token_channel=token_channel) as d:  # fmt: skip
        stalled = stalled_stream(d, n=3)  # 3 x ~920 tokens of a room of 3072, ~5 MB of answer unread
        try:
            wait_pools_empty(d, roles=("decode",))  # decode has finished all three; their client read ~none
            answer = completion(d, "another tenant", n=2, max_tokens=300)  # 2 x 320: more than the 312 left
            assert answer.status_code == 200, answer.text
            received = read_until_the_end(stalled)
        finally:
            stalled.close()
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in received, received[-200:]  # all of it
        wait_pools_empty(d)


def test_a_client_that_reads_slowly_is_not_a_client_that_reads_nothing(narrow: LocalDeployment) -> None:
    """The first write timeout bounded each write, so a steady reader of 1-16 kB/s was cut off after
    30 s (a regression probe): here the client reads 8 kB every 0.2 s for three write timeouts,
    then the rest at once, and gets the whole stream."""
    slow = stalled_stream(narrow)
    received = b""
    try:
        deadline = time.monotonic() + 3 * WRITE_TIMEOUT_S
        while time.monotonic() < deadline:
            received += slow.recv(8192)
            time.sleep(0.2)  # the client's own pace (it is the slow reader), not a wait for the server
        slow.settimeout(30)
        while b"data: [DONE]" not in received and (chunk := slow.recv(1 << 16)):  # the rest at once
            received += chunk
    finally:
        slow.close()
    assert b"data: [DONE]" in received, received[-200:]  # the whole stream, chunked framing and all


def test_more_choices_than_the_router_runs_at_once_is_a_400(narrow: LocalDeployment) -> None:
    """A request takes all its slots together: one with more choices than slots could never start
    (taken one by one, its own running choices held the slots its last one waited for)."""
    answer = completion(narrow, "too many", n=SLOTS + 1)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n", answer.text


def test_a_burst_past_both_workers_running_slots_is_served_s4(tiny_model_dir: Path) -> None:
    """Prefill computes ahead of a request's ticket only in slots it leaves free for requests that
    have one (EarlyBudget). Without the slot bound, a burst on fresh connections (which reach prefill
    and decode in different orders) deadlocked: prefill's slots held requests decode had not admitted,
    decode's held requests prefill could not admit, and most requests waited for their timeout (1,000
    requests at 8 slots: 800 of them, 3 runs in 3, before the fix)."""
    with deployment(tiny_model_dir, max_running_requests=8, request_timeout_s=60.0) as small:
        model = served_model(small)

        async def burst() -> list[int]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                async def one(i: int) -> int:
                    body = {"model": model, "prompt": f"slot {i}", "max_tokens": 1}
                    async with session.post(f"{small.api_base}/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
                        return r.status

                return await asyncio.gather(*(one(i) for i in range(1000)))

        statuses = asyncio.run(burst())
        assert collections.Counter(statuses) == {200: 1000}
        wait_pools_empty(small)


async def test_a_generation_that_times_out_waiting_for_capacity_counts_once_per_choice() -> None:
    """kvguard_requests_total counts generations (a rollout's errorRatio divides its outcomes): an
    outside probe saw a request of n=2 that timed out waiting for the router's slots counted once,
    while every other outcome counts each choice. The router's own slot wait, with the slots held
    by the test rather than by a live stream (whose pace a loaded machine changes)."""
    from kvguard.workers.keys import RevisionKeys
    from kvguard.workers.openai_api import OpenAIError
    from kvguard.workers.router import Router, RouterConfig

    config = RouterConfig(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:1",), model_name="m",
                          max_inflight_choices=2, request_timeout_s=0.2)  # fmt: skip
    router = Router(config, encoder=None, keys=RevisionKeys.derive(b"k" * 32))  # type: ignore[arg-type]
    failed = router.metrics.requests.labels("failed")
    await router._take_slots(2, time.monotonic())  # a request of n=2 holds every slot
    with pytest.raises(OpenAIError) as timed_out:
        await router._take_slots(2, time.monotonic())  # the next one waits its whole request timeout
    assert timed_out.value.status == 504 and failed._value.get() == 2


async def test_generations_whose_client_leaves_while_they_wait_for_capacity_count_as_aborted() -> None:
    """Outside probe: a client that left while its generations waited for the router's slots
    (the handler cancelled) was counted in neither kvguard_requests_total nor kvguard_aborts_total,
    so a saturated router under-reported abandoned requests exactly when it mattered."""
    from kvguard.workers.keys import RevisionKeys
    from kvguard.workers.router import Router, RouterConfig

    config = RouterConfig(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:1",), model_name="m",
                          max_inflight_choices=2, request_timeout_s=30.0)  # fmt: skip
    router = Router(config, encoder=None, keys=RevisionKeys.derive(b"k" * 32))  # type: ignore[arg-type]
    await router._take_slots(2, time.monotonic())  # a request of n=2 holds every slot
    waiting = asyncio.create_task(router._take_slots(2, time.monotonic()))
    await until(lambda: router.metrics.waiting_choices._value.get() == 2, "the second request waiting for the slots")
    waiting.cancel()  # its client disconnects
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert router.metrics.requests.labels("aborted")._value.get() == 2
    assert router.metrics.aborts.labels("client_disconnect")._value.get() == 2
    assert router.metrics.waiting_choices._value.get() == 0


def test_every_outcome_and_cause_is_exported_from_the_start(narrow: LocalDeployment) -> None:
    """A labelled counter whose series appears at its first increment hides that increment from
    rate() and increase() (outside probe: decode's first two disconnects read as 0 in a 10-minute
    increase). Every outcome and every abort cause is a series at 0 on every role from the start."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvguard.workers.metrics import REQUEST_OUTCOMES
    from kvguard.workers.transfer.metrics import AbortCause

    for role, url in narrow.metrics_urls.items():
        samples = [s for f in text_string_to_metric_families(requests.get(url, timeout=30).text) for s in f.samples]
        outcomes = {s.labels["outcome"] for s in samples if s.name == "kvguard_requests_total"}
        causes = {s.labels["cause"] for s in samples if s.name == "kvguard_aborts_total"}
        assert outcomes == set(REQUEST_OUTCOMES) and causes == set(AbortCause), role


def test_one_request_of_many_long_choices_leaves_room_for_another_tenant(tiny_model_dir: Path) -> None:
    """An outside probe: one `n: 16` request of ~1,000 tokens per choice reserved the whole KV pool
    (2x the context) at decode, and every other tenant waited for all of it (4 s on the tiny model,
    minutes on a real one). Its choices now start as its earlier ones leave room for one whole
    request of another tenant: here 2 of the 4 at a time, and the next tenant is served meanwhile.
    Every step is 5 ms long, so the big request takes seconds whatever the machine's speed."""
    with deployment(tiny_model_dir, "delay_step_ms=5", context_length=1024, kv_pool_tokens=2048) as d:
        model = served_model(d)
        big_body = {"model": model, "prompt": "many long choices", "max_tokens": 480, "n": 4, "temperature": 0, "ignore_eos": True}
        with cf.ThreadPoolExecutor(1) as pool:
            big = pool.submit(requests.post, f"{d.api_base}/completions", json=big_body, timeout=120)
            wait_for(lambda: pools_used(d, ("decode",))["decode"] > 0, "the big request's first choices at decode")
            peak = pools_used(d, ("decode",))["decode"]
            small = completion(d, "the next tenant", max_tokens=8)
            served_meanwhile = not big.done()
            while not big.done():
                peak = max(peak, pools_used(d, ("decode",))["decode"])
            answer = big.result()
        assert small.status_code == 200 and served_meanwhile, small.text
        assert answer.status_code == 200, answer.text
        assert [c["index"] for c in answer.json()["choices"]] == [0, 1, 2, 3] and answer.json()["usage"]["completion_tokens"] == 4 * 480
        assert peak <= 2048 - 512, peak  # the big request (2 x ~500 at a time) never held more than leaves a whole request's room
        wait_pools_empty(d)


def paced_room(prefill_pool: int, decode_pool: int, page: int, choices: list[tuple[int, int]], context: int = 1024) -> int | None:
    """`Router._pace` for workers reporting these pools and page size, and choices of (prompt
    tokens, max_tokens): the room the choices share, or None when they are not paced."""
    from kvguard.workers.keys import RevisionKeys
    from kvguard.workers.protocol import GenerateRequest, Role, SamplingParams, WorkerInfo
    from kvguard.workers.router import Choice, Router, RouterConfig, Upstream, Upstreams

    def worker(role: Role, pool: int) -> Upstream:
        info = WorkerInfo(role=role, model="m", context_length=context, kv_pool_tokens=pool, page_size=page)
        return Upstream(f"http://{role.value}", info)

    config = RouterConfig(prefill_urls=("http://prefill",), decode_urls=("http://decode",), model_name="m")
    router = Router(config, encoder=None, keys=RevisionKeys.derive(b"k" * 32))  # type: ignore[arg-type]
    router._upstreams = Upstreams([worker(Role.PREFILL, prefill_pool)], [worker(Role.DECODE, decode_pool)])
    requests_ = [Choice(i, GenerateRequest(request_id=f"r-{i}", prompt_token_ids=(1,) * prompt, sampling=SamplingParams(max_tokens=out)))
                 for i, (prompt, out) in enumerate(choices)]  # fmt: skip
    pace = router._pace(requests_)
    return None if pace is None else pace.room.capacity


def test_requests_of_several_choices_share_a_room_that_leaves_one_whole_request_of_decodes_pool() -> None:
    """The room is decode's smallest pool less one whole request (prefill holds only a prompt,
    briefly, so its pool does not count), or half of it when the pool is under twice the context
    (--allow-small-pool: a review found every `n: 2` request run one choice at a time there)."""
    assert paced_room(2048, 2048, 16, [(10, 16)] * 4) == 1024
    assert paced_room(2048, 2048, 16, [(17, 480)] * 4) == 1024
    assert paced_room(1024, 4096, 16, [(10, 690)] * 4) == 3072
    assert paced_room(512, 512, 16, [(10, 200)] * 2) == 256
    assert paced_room(2048, 2048, 16, [(10, 16)]) is None  # one choice: never paced


async def test_the_shared_room_keeps_what_its_choices_hold_when_decodes_pool_changes() -> None:
    """A worker joining or leaving (or its health flapping) changes the smallest decode pool, and
    with it the room. A new room at each change admitted a whole room more each time, the choices
    already running uncounted (a review: pools 2048 -> 4096 -> 2048 let 2048 tokens into a room of
    1024). The one room is resized instead, and what its choices hold comes back to it."""
    from kvguard.workers.keys import RevisionKeys
    from kvguard.workers.protocol import Role, WorkerInfo
    from kvguard.workers.router import Choice, Router, RouterConfig, Upstream, Upstreams

    def set_pool(router: Router, pool: int) -> None:
        def worker(role: Role) -> Upstream:
            info = WorkerInfo(role=role, model="m", context_length=1024, kv_pool_tokens=pool, page_size=16)
            return Upstream(f"http://{role.value}", info)

        router._upstreams = Upstreams([worker(Role.PREFILL)], [worker(Role.DECODE)])

    config = RouterConfig(prefill_urls=("http://prefill",), decode_urls=("http://decode",), model_name="m")
    router = Router(config, encoder=None, keys=RevisionKeys.derive(b"k" * 32))  # type: ignore[arg-type]
    choices = [Choice(i, _choice(f"r-{i}", 12, 500)) for i in range(2)]  # 512 tokens each
    set_pool(router, 2048)
    first = router._pace(choices)
    assert first is not None and first.room.capacity == 1024
    await first.room.acquire(1024)  # two choices of 512 running
    set_pool(router, 4096)  # a larger decode pool for a while: room 3072
    grown = router._pace(choices)
    assert grown is not None and grown.room.capacity == 3072 and grown.room.free == 2048
    await grown.room.acquire(1024)
    set_pool(router, 2048)  # back: room 1024, and 2048 held in it
    shrunk = router._pace(choices)
    assert shrunk is not None and shrunk.room.capacity == 1024 and shrunk.room.free == -1024
    waiter = asyncio.create_task(shrunk.room.acquire(512))
    await until(lambda: shrunk.room.waiting == 512, "the choice to queue in the shrunk room")
    assert not waiter.done()  # nothing more starts before the held tokens come back
    first.room.release(1024)  # the first choices end: into the one room
    assert shrunk.room.waiting == 512 and shrunk.room.free == 0  # still queued: the room is only back to full
    grown.room.release(1024)
    await waiter
    assert shrunk.room.free == 512
    shrunk.room.release(512)
    # A waiter queued for more than a shrunk room is let in alone, once all of it is free.
    room = Slots(1024)
    await room.acquire(16)
    big = asyncio.create_task(room.acquire(1024))
    await until(lambda: room.waiting == 1024, "the large choice to queue in the room")
    room.resize(512)
    room.release(16)
    await big
    assert room.free == 512 - 1024
    room.release(1024)
    assert room.free == 512


async def test_a_choice_that_ends_waiting_for_the_shared_room_is_counted_once() -> None:
    """The router counts every generation once (kvguard_requests_total, kvguard_aborts_total). A
    review: a paced choice whose client left, or whose sibling failed, while it waited for the room
    was counted nowhere (`Router._generate` never ran for it): a cut `n: 4` request counted 2."""
    from kvguard.workers.keys import RevisionKeys
    from kvguard.workers.protocol import Role, WorkerInfo
    from kvguard.workers.router import Choice, Router, RouterConfig, Upstream, Upstreams

    config = RouterConfig(prefill_urls=("http://prefill",), decode_urls=("http://decode",), model_name="m")
    router = Router(config, encoder=None, keys=RevisionKeys.derive(b"k" * 32))  # type: ignore[arg-type]
    info = {role: WorkerInfo(role=role, model="m", context_length=1024, kv_pool_tokens=2048, page_size=16) for role in Role}
    router._upstreams = Upstreams([Upstream("http://prefill", info[Role.PREFILL])], [Upstream("http://decode", info[Role.DECODE])])
    pace = router._pace([Choice(i, _choice(f"r-{i}", 12, 500)) for i in range(2)])
    assert pace is not None
    await pace.room.acquire(1024)  # another tenant's choices fill the room

    async def generate(request: GenerateRequest) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        yield FinishEvent(finish_reason="length", prompt_tokens=1, completion_tokens=1)

    async def wait_and_cancel(siblings: Siblings) -> None:
        async def run() -> None:
            async with contextlib.aclosing(_paced(pace, siblings, generate, _choice("waiting", 12, 500))) as events:
                async for _ in events:
                    pass

        task = asyncio.create_task(run())
        await until(lambda: pace.room.waiting == 512, "the choice to wait for the room")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    def counted(name: str, **labels: str) -> float:
        return router.metrics.registry.get_sample_value(name, labels) or 0.0

    loop = asyncio.get_running_loop()
    await wait_and_cancel(Siblings(loop.time() + 60, 60.0))  # its client left
    assert counted("kvguard_requests_total", outcome="aborted") == 1
    assert counted("kvguard_aborts_total", cause="client_disconnect") == 1
    failed = Siblings(loop.time() + 60, 60.0)
    failed.failed = True  # a sibling failed: it is cancelled for it
    await wait_and_cancel(failed)
    assert counted("kvguard_requests_total", outcome="failed") == 1
    assert counted("kvguard_aborts_total", cause="sibling_failed") == 1
    assert counted("kvguard_router_request_duration_seconds_count") == 2 and pace.room.waiting == 0


def _choice(rid: str, prompt: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=(1,) * prompt, sampling=SamplingParams(max_tokens=max_tokens))


class PacedChoices:
    """Choices run through `_paced` with a stand-in for the workers: each generation starts (in
    `started`) and ends when the test sets its `finish` event."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finish: collections.defaultdict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        self.started.append(request.request_id)
        await self.finish[request.request_id].wait()
        yield FinishEvent(finish_reason="length", prompt_tokens=1, completion_tokens=1)

    async def run(self, pace: ChoicePace, request: GenerateRequest, siblings: Siblings | None = None) -> None:
        siblings = siblings or Siblings(asyncio.get_running_loop().time() + 60, 60.0)
        async with contextlib.aclosing(_paced(pace, siblings, self.generate, request)) as events:
            async for _ in events:
                pass


async def test_a_choice_sized_for_the_room_before_it_shrank_still_gets_its_turn() -> None:
    """A choice is sized against the room when its turn comes, not before: a choice that waited for
    its sibling's turn while the room shrank (decode's smallest pool changed) asked for more than
    the whole room and failed an assertion (a review)."""
    room, choices = Slots(1024), PacedChoices()
    run, finish = choices.run, choices.finish
    other = asyncio.create_task(run(ChoicePace(room, 16, asyncio.Lock()), _choice("other", 10, 1000)))
    await until(lambda: room.free == 0, "another request's choice to fill the room")
    mine = ChoicePace(room, 16, asyncio.Lock())
    tasks = [asyncio.create_task(run(mine, _choice(f"mine-{i}", 10, 1000))) for i in range(2)]
    await until(lambda: room.waiting == 1024, "one of its choices to wait in the room, the other for its turn")
    room.resize(512)
    for rid in ("other", "mine-0", "mine-1"):
        finish[rid].set()
    await asyncio.wait_for(asyncio.gather(other, *tasks), 5)
    assert room.free == 512




async def test_paced_choices_reserve_whole_pages_and_requests_take_turns_in_the_shared_room() -> None:
    """`_paced` against a shared room of 1,024 tokens on 16-token pages: a choice reserves every
    page it can need (17 + 480 tokens take 512: page rounding was left out once, a review), a
    small request of two choices gets its turn between a large one's choices instead of waiting
    for all of them to start, and one choice larger than the room still runs, alone."""
    room, choices = Slots(1024), PacedChoices()
    big, small = ChoicePace(room, 16, asyncio.Lock()), ChoicePace(room, 16, asyncio.Lock())
    run, started, finish = choices.run, choices.started, choices.finish
    tasks = [asyncio.create_task(run(big, _choice(f"big-{i}", 17, 480))) for i in range(4)]
    await until(lambda: started == ["big-0", "big-1"] and room.waiting == 512, "two of big's choices to fill the room")
    tasks += [asyncio.create_task(run(small, _choice(f"small-{i}", 10, 6))) for i in range(2)]
    await until(lambda: room.waiting == 512 + 16, "small's first choice to queue behind big's third")
    finish["big-0"].set()
    await until(lambda: len(started) == 3, "big's third choice")
    assert started[2] == "big-2"
    finish["big-1"].set()
    await until(lambda: len(started) == 4, "small's first choice")
    assert started[3] == "small-0" and room.free == 512 - 16  # small's turn came before big's last choice
    finish["small-0"].set()
    await until(lambda: len(started) == 5, "big's last choice")
    assert started[4] == "big-3"
    for rid in ("big-2", "big-3", "small-1"):
        finish[rid].set()
    await asyncio.gather(*tasks)
    assert started[5] == "small-1" and room.free == 1024
    alone = ChoicePace(Slots(256), 16, asyncio.Lock())  # a small pool: the choice needs more than the room
    finish["alone"].set()
    await run(alone, _choice("alone", 10, 500))
    assert started[-1] == "alone" and alone.room.free == 256


async def test_a_choice_waits_for_the_shared_room_only_until_its_first_token_deadline() -> None:
    """The room is shared with other tenants' requests, so waiting in it is waiting for a first
    token: bounded by the request's deadline (a 504), not by how long the others generate. A review:
    a request of two 4-token choices waited 13 s behind another tenant's at --request-timeout 2."""
    room, choices = Slots(1024), PacedChoices()
    timed_out: list[tuple[str, str]] = []
    loop = asyncio.get_running_loop()
    other = ChoicePace(room, 16, asyncio.Lock())
    holding = asyncio.create_task(choices.run(other, _choice("other", 24, 1000)))
    await until(lambda: room.free == 0, "another tenant's choice to fill the room")
    waiting: list[int] = []  # kvguard_router_room_waiting_choices, as it moves
    late = ChoicePace(room, 16, asyncio.Lock(), lambda cause, outcome: timed_out.append((cause, outcome)),
                      lambda change: waiting.append(sum(waiting[-1:]) + change))  # fmt: skip
    siblings = Siblings(loop.time() + 0.3, 60.0)
    started = loop.time()
    with pytest.raises(OpenAIError) as refused:
        await asyncio.wait_for(choices.run(late, _choice("late", 10, 6), siblings), 5)
    assert refused.value.status == 504 and loop.time() - started < 2, refused.value
    assert waiting == [1, 0]  # counted while it waited, and not after its 504
    assert siblings.failed and timed_out == [("timeout", "failed")] and room.waiting == 0 and room.free == 0
    choices.finish["other"].set()
    await holding
    assert room.free == 1024


def test_a_request_of_several_choices_behind_another_tenants_gets_its_504_at_its_deadline(tiny_model_dir: Path) -> None:
    """End to end: another tenant's two long choices fill the shared room for ~10 s; a request of
    two short choices answers at its --request-timeout (2 s), not when the others end."""
    with deployment(tiny_model_dir, "delay_step_ms=20", context_length=1024, kv_pool_tokens=2048, request_timeout_s=2.0) as d:
        model = served_model(d)
        usage = requests.post(f"{d.api_base}/completions", json={"model": model, "max_tokens": 1, "prompt": "long"}, timeout=60)
        prompt_tokens = usage.json()["usage"]["prompt_tokens"]
        big = {"model": model, "prompt": "long", "max_tokens": 512 - prompt_tokens, "n": 2, "temperature": 0, "ignore_eos": True}
        with cf.ThreadPoolExecutor(1) as pool:
            other = pool.submit(requests.post, f"{d.api_base}/completions", json=big, timeout=120)
            wait_for(lambda: pools_used(d, ("decode",))["decode"] >= 1024, "the other tenant's choices filling the room")
            started = time.monotonic()
            late = requests.post(f"{d.api_base}/completions", json={"model": model, "prompt": "short", "max_tokens": 4, "n": 2},
                                 timeout=120)  # fmt: skip
            took = time.monotonic() - started
            still_running = not other.done()
            assert other.result().status_code == 200
        assert late.status_code == 504 and late.json()["error"]["code"] == "timeout", late.text
        assert took < 5 and still_running, took
        wait_pools_empty(d)


def test_requests_of_many_long_choices_together_leave_room_for_another_tenant(tiny_model_dir: Path) -> None:
    """An outside probe: two `n: 4` requests of ~500 tokens per choice, each paced alone to half
    the pool, together reserved all of it at decode, and a one-choice tenant waited 2-4 s for a
    choice to end. The room is now the router's, shared: the two requests hold at most half the
    pool between them, and the other tenant is served while both still run."""
    with deployment(tiny_model_dir, "delay_step_ms=5", context_length=1024, kv_pool_tokens=2048) as d:
        model = served_model(d)
        body = {"model": model, "max_tokens": 480, "n": 4, "temperature": 0, "ignore_eos": True}
        with cf.ThreadPoolExecutor(2) as pool:
            bigs = [pool.submit(requests.post, f"{d.api_base}/completions", json={**body, "prompt": f"many long choices {i}"},
                                timeout=120) for i in range(2)]  # fmt: skip
            wait_for(lambda: pools_used(d, ("decode",))["decode"] >= 1024, "two long choices running at decode")
            peak = pools_used(d, ("decode",))["decode"]
            small = completion(d, "the next tenant", max_tokens=8)
            served_meanwhile = not any(big.done() for big in bigs)
            while not all(big.done() for big in bigs):
                peak = max(peak, pools_used(d, ("decode",))["decode"])
            answers = [big.result() for big in bigs]
        assert small.status_code == 200 and served_meanwhile, small.text
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 4 * 480
        assert peak < 1024 + 512, peak  # never a third choice of 512 at once (the small request's few pages may overlap)
        wait_pools_empty(d)


def test_paced_requests_cut_mid_stream_give_every_slot_back(tiny_model_dir: Path) -> None:
    """A paced request's choices hold router slots while they wait for room (`Router._pace`), and
    its finished ones give theirs back early (`SlotLease`): after clients leave such requests mid
    stream, a request of as many choices as the router has slots is still served."""
    with deployment(tiny_model_dir, "delay_step_ms=2", context_length=1024, kv_pool_tokens=2048,
                    max_inflight_choices=SLOTS, request_timeout_s=20.0) as d:  # fmt: skip
        api = client(d, timeout=60)
        model = served_model(d)
        for cut in range(3):
            stream = api.completions.create(model=model, prompt=f"cut {cut}", n=SLOTS, max_tokens=480, stream=True,
                                            extra_body={"ignore_eos": True})  # fmt: skip
            next(iter(stream))  # the first choices run, the others wait for room
            wait_for(lambda: metric(d, "router", "kvguard_router_room_waiting_choices") > 0, "choices waiting for room")
            stream.close()
            wait_pools_empty(d)
        whole = api.completions.create(model=model, prompt="whole", n=SLOTS, max_tokens=480, extra_body={"ignore_eos": True})
        after = api.completions.create(model=model, prompt="after", n=SLOTS, max_tokens=8)
        assert [c.finish_reason for c in whole.choices] == ["length"] * SLOTS and len(after.choices) == SLOTS
        assert metric(d, "router", "kvguard_router_waiting_choices") == 0
        assert metric(d, "router", "kvguard_router_room_waiting_choices") == 0
        # Every generation of the cut requests counted once, those still waiting for room too (they
        # were not counted at all: 6 of 12, a review).
        assert metric(d, "router", "kvguard_requests_total", outcome="aborted") == 3 * SLOTS
        assert metric(d, "router", "kvguard_aborts_total", cause="client_disconnect") == 3 * SLOTS
