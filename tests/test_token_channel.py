"""Decode's token channel (issue 14): one stream per router and decode worker carries every
request's events after its handoff. Checked on real processes: outputs equal to the per-request
streams', the channel only for the router (S9), a request naming no open channel refused before
any page, and a channel that closes ending its requests and freeing their pages (S4). The pure
pieces (the envelope, decode's routing, the router's reader) are checked alone at the end."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
import requests
from aiohttp import web
from pd_harness import (
    client,
    deployment,
    internal,
    metric,
    pools_used,
    reference_text,
    second_router,
    served_model,
    ticket_for,
    wait_pools_empty,
)
from waiting import wait_for

from kvguard.workers.async_engine import RequestStream
from kvguard.workers.channel_reader import MAX_LINE_BYTES, ChannelLost, ChannelReader, Inbox, LineTooLong, coalesce, read_lines
from kvguard.workers.keys import RevisionKeys
from kvguard.workers.launcher import LocalDeployment
from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.protocol import (
    CHANNEL_EVENT,
    MAX_EVENT_TOKENS,
    ErrorEvent,
    FinishEvent,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
)
from kvguard.workers.request import RequestAborted, RequestOutput, RequestState
from kvguard.workers.router import Router, RouterConfig, Siblings, _channel_events
from kvguard.workers.stream_events import step_events
from kvguard.workers.token_channel import TokenChannel

PROMPTS = ["the channel carries", "every request's tokens", "x" * 40, "short"]


@pytest.fixture(scope="module")
def trio(tiny_model_dir: Path) -> Iterator[LocalDeployment]:
    with deployment(tiny_model_dir) as d:
        yield d


def _streamed(base_url: str, model: str, prompt: str, max_tokens: int) -> str:
    api = openai.OpenAI(base_url=base_url, api_key="none", timeout=60, max_retries=0)
    stream = api.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(chunk.choices[0].text for chunk in stream)


def test_the_channel_gives_what_a_stream_per_request_gives(trio: LocalDeployment, tiny_model_dir: Path) -> None:
    """The same prompts, concurrently, through the default router (channel) and a second router with
    --token-channel off: streamed and whole texts equal each other and the engine alone."""
    model = served_model(trio)
    with second_router(trio, tiny_model_dir, token_channel="off") as per_request:
        with cf.ThreadPoolExecutor(8) as pool:
            jobs = [(prompt, max_tokens, pool.submit(_streamed, base, model, prompt, max_tokens))
                    for prompt in PROMPTS for max_tokens in (1, 24)
                    for base in (trio.api_base, per_request)]  # fmt: skip
            for prompt, max_tokens, job in jobs:
                assert job.result() == reference_text(tiny_model_dir, prompt, max_tokens), (prompt, max_tokens)
    whole = client(trio).completions.create(model=model, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert whole.choices[0].text == reference_text(tiny_model_dir, PROMPTS[0], 24)
    assert whole.usage is not None and whole.usage.completion_tokens == 24
    wait_pools_empty(trio)


def test_only_the_router_opens_a_channel_s9(trio: LocalDeployment) -> None:
    unsigned = requests.post(f"{trio.internal_urls['decode']}/internal/stream", json={}, timeout=10)
    assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "unauthenticated"
    metrics_base = trio.metrics_urls["decode"].removesuffix("/metrics")
    assert requests.post(f"{metrics_base}/internal/stream", json={}, timeout=10).status_code == 404


def test_a_request_naming_no_open_channel_is_refused_before_any_page(trio: LocalDeployment) -> None:
    leg = {"request_id": "cmpl-nochannel", "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 4},
           "channel": secrets.token_hex(16)}  # fmt: skip
    refused = internal(trio, "decode", "/internal/decode", leg)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "unknown_channel"
    malformed = internal(trio, "decode", "/internal/decode", {**leg, "channel": "../x"})
    assert malformed.status_code == 400
    assert pools_used(trio) == {"prefill": 0, "decode": 0}


def _lines(response: requests.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if line:
            yield json.loads(line)


def test_a_channel_that_closes_ends_its_requests_and_frees_their_pages_s4(tiny_model_dir: Path) -> None:
    """Playing the router: open a channel, send a long request on it, see its first tokens arrive
    on the channel (not on its own stream), then close the channel. Decode aborts the request (its
    own stream ends without a finish) and frees its pages, as for a router that went away. Paced at
    20 ms a step, the request is still generating when the channel closes, however long this
    process waits between reading its first token and closing (a loaded machine)."""
    with deployment(tiny_model_dir, "delay_step_ms=20") as trio:
        before = metric(trio, "decode", "kvguard_aborts_total", cause="client_disconnect")
        rid = f"cmpl-{secrets.token_hex(16)}"
        leg = {"request_id": rid, "prompt_token_ids": [1, *range(40, 60)], "sampling": {"max_tokens": 900, "temperature": 0,
               "ignore_eos": True}}  # fmt: skip
        with internal(trio, "decode", "/internal/stream", {}, stream=True, timeout=60) as channel:
            channel_lines = _lines(channel)
            opened = next(channel_lines)
            assert opened["event"] == "channel"
            with internal(trio, "decode", "/internal/decode", {**leg, "channel": opened["channel"]}, stream=True, timeout=60) as own:
                own_lines = _lines(own)
                bootstrap = next(own_lines)["bootstrap"]
                sent = internal(trio, "prefill", "/internal/prefill", {**leg, "ticket": ticket_for(trio, rid, bootstrap)}, timeout=60)
                assert sent.status_code == 200, sent.text
                assert next(own_lines) == {"event": "handoff"}
                first = next(channel_lines)
                assert first["request_id"] == rid and first["event"]["event"] == "token"
                channel.close()  # the router goes away (its channel with it)
                rest = list(own_lines)  # decode ends the request's own stream too
                assert all(event["event"] != "finish" for event in rest), rest
        wait_pools_empty(trio)
        wait_for(lambda: metric(trio, "decode", "kvguard_aborts_total", cause="client_disconnect") == before + 1,
                 "decode to count the request's abort")  # fmt: skip


def test_an_event_over_aiohttps_line_bound_reaches_the_client_on_both_paths(tiny_model_dir: Path) -> None:
    """Outside probe: `--stream-interval 1024` with 20 logprob alternatives per token makes one
    event over 512 KiB, aiohttp's readline bound. With a stream per request the router's read
    raised past every handler and the client's stream stayed open, with no error and no end, for
    as long as the client waited. Both paths now read lines of up to 8 MiB."""
    with deployment(tiny_model_dir, stream_interval=1024, context_length=4096, kv_pool_tokens=8192) as d:
        model = served_model(d)
        with second_router(d, tiny_model_dir, token_channel="off") as per_request:
            for base in (d.api_base, per_request):
                api = openai.OpenAI(base_url=base, api_key="none", timeout=120, max_retries=0)
                stream = api.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "big events"}], max_tokens=2048, temperature=0,
                    logprobs=True, top_logprobs=20, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
                chunks = [c for c in stream if c.choices]
                tokens = sum(len(c.choices[0].logprobs.content or ()) for c in chunks if c.choices[0].logprobs)
                assert tokens == 2048 and chunks[-1].choices[0].finish_reason == "length", base
        wait_pools_empty(d)


# -- the pieces alone -------------------------------------------------------------------------------


def _output(rid: str, state: RequestState, tokens: list[int], **more: object) -> RequestOutput:
    return RequestOutput(rid, state, token_ids=tokens, text="".join(chr(65 + t % 26) for t in tokens), **more)  # type: ignore[arg-type]


class _Writes:
    """A channel's writer for these tests: keeps every write and says when one came (`came`);
    with `release` given, each write then waits for it (a router that is not reading)."""

    def __init__(self, release: asyncio.Event | None = None) -> None:
        self.data: list[bytes] = []
        self.came = asyncio.Event()
        self.release = release

    async def __call__(self, data: bytes) -> None:
        self.data.append(data)
        self.came.set()
        if self.release is not None:
            await self.release.wait()


def test_the_channel_envelope_is_a_channel_event() -> None:
    batch = [_output('q"1', RequestState.DECODING, [1, 2]), _output('q"1', RequestState.FINISHED, [3], finish_reason="length")]
    data, sent, ended = step_events(batch, prompt_tokens=5, sent=0, channel_request='q"1')
    events = [CHANNEL_EVENT.validate_json(line) for line in data.splitlines()]
    assert [e.request_id for e in events] == ['q"1', 'q"1']
    assert isinstance(events[0].event, TokenEvent) and events[0].event.token_ids == (1, 2, 3)
    assert events[1].event == FinishEvent(finish_reason="length", prompt_tokens=5, completion_tokens=3)
    assert (sent, ended) == (3, True)


def test_decode_routes_a_step_into_one_write_and_ends_its_requests_when_closed() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        channel = TokenChannel("c" * 32)
        write = _Writes()
        writes, written = write.data, write.came
        serving = asyncio.create_task(channel.serve(write))
        a, b, c = (RequestStream(rid, loop) for rid in ("a", "b", "c"))
        ended = {s.request_id: channel.attach(s, prompt_tokens=2) for s in (a, b, c)}
        channel.add(a, _output("a", RequestState.DECODING, [1]))
        channel.add(b, _output("b", RequestState.FINISHED, [2], finish_reason="stop"))
        channel.add(c, _output("c", RequestState.ABORTED, [], error=RequestAborted("x")))
        channel.flush()
        await asyncio.wait_for(written.wait(), 5)  # the writer's turn
        assert len(writes) == 1 and [CHANNEL_EVENT.validate_json(x).request_id for x in writes[0].splitlines()] == ["a", "b", "b", "c"]
        assert (ended["b"].result(), ended["c"].result()) == ("", "")  # the engine ended both
        assert isinstance(CHANNEL_EVENT.validate_json(writes[0].splitlines()[3]).event, ErrorEvent)
        channel.detach("a")
        channel.add(a, _output("a", RequestState.DECODING, [5]))  # after its handler let go: dropped
        d = RequestStream("d", loop)
        ended["d"] = channel.attach(d, prompt_tokens=1)
        channel.close("client_disconnect")
        await asyncio.wait_for(serving, 5)
        assert ended["d"].result() == "client_disconnect" and not ended["a"].done()
        late = channel.attach(RequestStream("e", loop), prompt_tokens=1)  # closed: ends at once
        assert late.result() == "client_disconnect" and len(writes) == 1

    asyncio.run(scenario())


def test_steps_made_while_the_router_reads_slowly_go_out_as_one_event_per_request() -> None:
    """While a write waits on the router, a request's later steps are held, not encoded one by
    one: the next write carries them as one event (tokens and text in order), its finish after."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        channel = TokenChannel("d" * 32)
        release = asyncio.Event()
        write = _Writes(release)  # the router is not reading until `release`
        writes, wrote = write.data, write.came
        serving = asyncio.create_task(channel.serve(write))
        a = RequestStream("a", loop)
        ended = channel.attach(a, prompt_tokens=2)
        channel.add(a, _output("a", RequestState.DECODING, [1]))
        channel.flush()
        await asyncio.wait_for(wrote.wait(), 5)  # the first token's write, now waiting
        wrote.clear()
        for token in (2, 3):
            channel.add(a, _output("a", RequestState.DECODING, [token]))
            channel.flush()
        channel.add(a, _output("a", RequestState.FINISHED, [4], finish_reason="length"))
        channel.flush()
        release.set()
        await asyncio.wait_for(wrote.wait(), 5)
        events = [CHANNEL_EVENT.validate_json(line).event for line in writes[1].splitlines()]
        assert len(writes) == 2 and len(events) == 2
        assert isinstance(events[0], TokenEvent) and events[0].token_ids == (2, 3, 4)
        assert events[1] == FinishEvent(finish_reason="length", prompt_tokens=2, completion_tokens=4)
        assert ended.result() == ""
        # Held past MAX_EVENT_TOKENS (a long stall): split into events of at most that many, so a
        # line stays far below the router's MAX_LINE_BYTES (outside probe: a large-context model
        # with 20 logprob alternatives could pass it).
        b = RequestStream("b", loop)
        channel.attach(b, prompt_tokens=2)
        release.clear()
        wrote.clear()
        channel.add(b, _output("b", RequestState.DECODING, [1]))
        channel.flush()
        await asyncio.wait_for(wrote.wait(), 5)
        wrote.clear()
        for _ in range(MAX_EVENT_TOKENS + 10):
            channel.add(b, _output("b", RequestState.DECODING, [7]))
            channel.flush()
        release.set()
        await asyncio.wait_for(wrote.wait(), 5)
        sizes = [len(CHANNEL_EVENT.validate_json(line).event.token_ids) for line in writes[3].splitlines()]  # type: ignore[union-attr]
        assert sizes == [MAX_EVENT_TOKENS, 10]
        channel.close("done")
        await asyncio.wait_for(serving, 5)

    asyncio.run(scenario())


def test_a_request_whose_outputs_cannot_be_encoded_ends_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug on one request's outputs (the encoding raises) ends that request with an error event
    and its abort (decode_error); the others on the channel go on."""
    import kvguard.workers.token_channel as token_channel

    real = token_channel.step_events

    def step_events(batch: list[RequestOutput], *args: object, **kwargs: object) -> tuple[bytes, int, bool]:
        if batch[0].request_id == "bad":
            raise ValueError("injected")
        return real(batch, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(token_channel, "step_events", step_events)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        channel = TokenChannel("e" * 32)
        write = _Writes()
        writes, wrote = write.data, write.came
        serving = asyncio.create_task(channel.serve(write))
        good, bad = RequestStream("good", loop), RequestStream("bad", loop)
        ended = {s.request_id: channel.attach(s, prompt_tokens=1) for s in (good, bad)}
        channel.add(good, _output("good", RequestState.DECODING, [1]))
        channel.add(bad, _output("bad", RequestState.DECODING, [2]))
        channel.flush()
        await asyncio.wait_for(wrote.wait(), 5)
        events = [CHANNEL_EVENT.validate_json(line) for line in writes[0].splitlines()]
        assert [e.request_id for e in events] == ["good", "bad"] and isinstance(events[0].event, TokenEvent)
        assert isinstance(events[1].event, ErrorEvent) and events[1].event.code == "internal_error"
        assert ended["bad"].result() == "decode_error" and not ended["good"].done()
        channel.close("done")
        await asyncio.wait_for(serving, 5)

    asyncio.run(scenario())


def test_the_router_hands_events_to_their_requests_and_fails_them_all_when_the_channel_breaks() -> None:
    """A real HTTP channel on loopback: two requests' events reach their own inboxes, one nobody
    waits for is dropped, and an unreadable line ends the channel for every request on it (in
    words, no parser's) -- the next request opens a new one."""

    async def scenario() -> None:
        opened, subscribed = 0, asyncio.Event()

        async def stream(request: web.Request) -> web.StreamResponse:
            nonlocal opened
            opened += 1
            response = await _opened_channel(request, opened)
            await subscribed.wait()  # as decode: no request's event before the router sent it
            token = {"event": "token", "token_ids": [7], "text": "h"}
            for rid in ("r1", "nobody", "r2"):
                await response.write(json.dumps({"request_id": rid, "event": token}).encode() + b"\n")
            await response.write(b'{"request_id": "r1", "event": {"event": "bogus"}}\n')
            return response

        async with _serving({"/internal/stream": stream}) as base, aiohttp.ClientSession() as session:
            reader = ChannelReader(lambda: session.post(f"{base}/internal/stream", json={}))
            channel = await reader.channel()
            assert channel.id == f"{1:032x}"
            inboxes = {rid: channel.subscribe(rid) for rid in ("r1", "r2")}
            subscribed.set()
            for inbox in inboxes.values():
                got = [await asyncio.wait_for(inbox.get(), 5) for _ in range(2)]
                assert got[0] == TokenEvent(token_ids=(7,), text="h")
                assert isinstance(got[1], ChannelLost) and "unreadable" in str(got[1]) and "Error" not in str(got[1])
            late = channel.subscribe("r3")  # on a channel already lost: told at once
            assert isinstance(late.get_nowait(), ChannelLost)
            assert (await reader.channel()).id == f"{2:032x}"  # opened again
            await reader.close()

    asyncio.run(scenario())


def test_a_channel_whose_connection_closes_before_decode_answers_is_opened_once_more() -> None:
    """An outside probe: after a decode worker was killed and restarted, the router's channel call
    went out on a pooled connection to the dead process, was reset, and every request waiting for
    the channel failed with a 502 for about a second. Nothing was opened: it is opened once more.
    Twice in a row is the worker's failure, told as before."""

    async def scenario() -> None:
        calls = 0

        async def stream(request: web.Request) -> web.StreamResponse:
            nonlocal calls
            calls += 1
            if calls in (1, 3, 4):  # gone before answering, as a killed process's connection
                assert request.transport is not None
                request.transport.abort()
                await asyncio.Event().wait()
            return await _opened_channel(request, calls)

        async with _serving({"/internal/stream": stream}) as base, aiohttp.ClientSession() as session:
            reader = ChannelReader(lambda: session.post(f"{base}/internal/stream", json={}))
            assert (await reader.channel()).id == f"{2:032x}" and calls == 2  # the second call opened it
            await reader.close()
            again = ChannelReader(lambda: session.post(f"{base}/internal/stream", json={}))
            with pytest.raises(ChannelLost, match="no token channel to the decode worker"):
                await again.channel()
            assert calls == 4
            await again.close()

    asyncio.run(scenario())


def _token(token_id: int, text: str, logprob: float | None = None) -> TokenEvent:
    record = None if logprob is None else (TokenLogprob(token_id=token_id, logprob=logprob, top=((token_id, logprob),)),)
    return TokenEvent(token_ids=(token_id,), text=text, logprobs=record)


def test_token_events_waiting_in_an_inbox_go_out_as_one() -> None:
    """A relay that fell behind takes every token event waiting for its request as one (tokens,
    text and logprobs in order) and keeps the first other item for its next turn; one that keeps
    up takes each event as it came."""

    async def scenario() -> None:
        inbox: Inbox = asyncio.Queue()
        for event in (_token(1, "a", -0.5), _token(2, "b\u00e9", -1.0), _token(3, "", -2.0)):
            inbox.put_nowait(event)
        finish = FinishEvent(finish_reason="length", prompt_tokens=4, completion_tokens=4)
        inbox.put_nowait(finish)
        inbox.put_nowait(_token(9, "after"))  # never taken by this call: the finish comes first
        merged, held = coalesce(_token(0, "x", -0.1), inbox)
        assert merged == TokenEvent(token_ids=(0, 1, 2, 3), text="xab\u00e9", logprobs=tuple(
            TokenLogprob(token_id=t, logprob=lp, top=((t, lp),)) for t, lp in ((0, -0.1), (1, -0.5), (2, -1.0), (3, -2.0))))
        assert held is finish and inbox.qsize() == 1
        alone = _token(5, "y")
        assert coalesce(alone, asyncio.Queue()) == (alone, None)  # nothing waiting: the same event
        lost = ChannelLost("gone")
        inbox = asyncio.Queue()
        inbox.put_nowait(lost)
        assert coalesce(alone, inbox) == (alone, lost)

    asyncio.run(scenario())


def test_a_request_whose_events_queued_at_the_router_streams_them_in_fewer_chunks() -> None:
    """The router's side of a request on a channel, over a real loopback stream that hands it over:
    with ten token events queued before the relay takes any (the router fell behind), the request
    yields one token event carrying all ten, then its finish -- the same tokens and text."""

    async def handoff(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b'{"event":"handoff"}\n')
        return response

    async def scenario() -> None:
        async with _serving({"/decode": handoff}) as base, aiohttp.ClientSession() as session:
            inbox: Inbox = asyncio.Queue()
            for i in range(10):
                inbox.put_nowait(_token(i, f"<{i}>"))
            inbox.put_nowait(FinishEvent(finish_reason="length", prompt_tokens=3, completion_tokens=10))
            async with session.post(f"{base}/decode", json={}) as resp:
                got = [event async for event in _channel_events(resp, inbox, idle_s=5)]
        assert len(got) == 2 and isinstance(got[0], TokenEvent) and isinstance(got[1], FinishEvent)
        assert got[0].token_ids == tuple(range(10)) and got[0].text == "".join(f"<{i}>" for i in range(10))
        # However many wait, one chunk carries at most MAX_EVENT_TOKENS (a client's line bound).
        inbox = asyncio.Queue()
        for i in range(MAX_EVENT_TOKENS + 476):
            inbox.put_nowait(_token(i, "t"))
        inbox.put_nowait(FinishEvent(finish_reason="length", prompt_tokens=3, completion_tokens=MAX_EVENT_TOKENS + 476))
        async with aiohttp.ClientSession() as session, _serving({"/decode": handoff}) as base:
            async with session.post(f"{base}/decode", json={}) as resp:
                sizes = [len(e.token_ids) if isinstance(e, TokenEvent) else e.event async for e in _channel_events(resp, inbox, 5)]
        assert sizes == [MAX_EVENT_TOKENS, 476, "finish"]

    asyncio.run(scenario())


def test_a_call_naming_a_channel_decode_no_longer_knows_is_made_again_on_a_new_one() -> None:
    """Outside probe: decode SIGKILLed and restarted while requests were queued for it -- their
    calls named the old process's channel and reached the new one, which refused them (409
    `unknown_channel`, before any page), and clients got that 409. The router now drops the stale
    channel, opens a new one and calls once more; a second refusal is a 502 in words."""

    async def scenario(known_from: int) -> tuple[list[str | None], str | None]:
        opened, calls = 0, []

        async def stream(request: web.Request) -> web.StreamResponse:
            nonlocal opened
            opened += 1
            response = await _opened_channel(request, opened)
            await asyncio.Event().wait()  # open until the router closes it
            return response

        async def decode(request: web.Request) -> web.StreamResponse:
            channel = (await request.json())["channel"]
            calls.append(channel)
            if int(channel, 16) < known_from:
                return web.json_response({"error": {"message": "no token channel of that id is open on this decode "
                                                     "worker", "type": "conflict_error", "code": "unknown_channel"}}, status=409)  # fmt: skip
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b'{"event": "handoff"}\n')
            return response

        config = RouterConfig(prefill_urls=("http://unused",), decode_urls=("http://unused",), model_name="m")
        router = Router(config, encoder=None, keys=RevisionKeys.derive(b"k" * 32))  # type: ignore[arg-type]
        async with _serving({"/internal/stream": stream, "/internal/decode": decode}) as base:
            router.session = aiohttp.ClientSession()
            request = GenerateRequest(request_id="cmpl-x", prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=2))
            failure = None
            try:
                async with contextlib.AsyncExitStack() as stack:
                    _, channel = await router._call_decode(request, base, Siblings(asyncio.get_running_loop().time() + 10, 10.0), stack,
                                                              asyncio.Event(), lambda: None)
                    assert channel is not None and channel.id == calls[-1]
            except OpenAIError as err:
                failure = f"{err.status} {err.code}: {err.message}"
            for reader in router._channels.values():
                await reader.close()
            await router.session.close()
        return calls, failure

    calls, failure = asyncio.run(scenario(known_from=2))
    assert calls == [f"{1:032x}", f"{2:032x}"] and failure is None
    calls, failure = asyncio.run(scenario(known_from=99))
    assert len(calls) == 2 and failure == "502 worker_failed: the decode worker restarted while the request was sent; try again"


async def _opened_channel(request: web.Request, number: int) -> web.StreamResponse:
    """A fake decode's channel answer: open, its first line naming channel `number` (in hex)."""
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(json.dumps({"event": "channel", "channel": f"{number:032x}"}).encode() + b"\n")
    return response


@contextlib.asynccontextmanager
async def _serving(routes: dict) -> AsyncIterator[str]:
    """A plain aiohttp server on loopback with these POST routes; yields its base URL."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)  # handlers that wait forever end
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def test_decode_stream_lines_are_bounded_but_not_by_aiohttps_readline() -> None:
    async def lines_of(chunks: list[bytes]) -> list[bytes]:
        content = aiohttp.StreamReader(_Protocol(), limit=2**16, loop=asyncio.get_running_loop())
        for chunk in chunks:
            content.feed_data(chunk)
        content.feed_eof()
        return [line async for line in read_lines(content)]

    big = b"x" * (600 << 10)  # over aiohttp's 512 KiB readline bound
    assert asyncio.run(lines_of([b'{"a"', b': 1}\n\n', big[:1000], big[1000:] + b"\n"])) == [b'{"a": 1}', big]
    with pytest.raises(LineTooLong):
        asyncio.run(lines_of([b"y" * (MAX_LINE_BYTES + 1)]))
    with pytest.raises(LineTooLong):
        asyncio.run(lines_of([b'{"cut": "off']))


class _Protocol:
    """What aiohttp's StreamReader asks of its protocol, for feeding it by hand."""

    _reading_paused = False

    def pause_reading(self, **_: object) -> None: ...

    def resume_reading(self, **_: object) -> None: ...


def test_a_worker_killed_mid_call_is_named_as_such_not_as_a_failure() -> None:
    """Outside probe (decode churn): a reset while a call was in flight read "a worker failed";
    the client should hear the worker's connection broke (it failed or restarted)."""
    from kvguard.workers.router import _worker_failure

    reset = aiohttp.ClientOSError(104, "Connection reset by peer")
    assert _worker_failure(reset) == "a worker's connection broke off mid-request (it failed or restarted); try again"
    unreachable = aiohttp.ClientConnectorError(None, OSError(111, "refused"))  # type: ignore[arg-type]
    assert _worker_failure(unreachable) == "a worker could not be reached; try again"
