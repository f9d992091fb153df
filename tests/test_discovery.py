"""The router finds its workers by name (`--discovery dns`, workers/discovery.py).

On Kubernetes a request's calls must all reach the one pod that holds its KV: prefill's computing
call and its ticket, decode's call and the token channel it names. A Service's virtual IP sends
each connection to any pod, so the router resolves the workers' headless Services itself and
addresses every ready pod by IP. Here two real prefill workers share a port on two loopback
addresses behind one name; the name's answers come from a table (tests/dns_table.py), the rest is
the real router and workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from pd_harness import deployment, metric, served_model, worker_process
from prometheus_client.parser import text_string_to_metric_families
from waiting import until, wait_for

from kvguard.workers.args import WorkerArgs, bind_listener
from kvguard.workers.discovery import NoAnswer, address_url, membership_change, resolve
from kvguard.workers.launcher import LocalDeployment

PREFILL_NAME = "prefill.kvguard.test"
DECODE_NAME = "decode.kvguard.test"
SECOND_HOST = "127.0.0.2"  # the whole of 127/8 is loopback on Linux


def test_address_urls_keep_port_and_path_and_bracket_ipv6() -> None:
    assert address_url("http://svc.ns.svc:8000", "10.0.0.7") == "http://10.0.0.7:8000"
    assert address_url("http://svc:8000/base", "fd00::7") == "http://[fd00::7]:8000/base"
    assert address_url("http://svc", "10.0.0.7") == "http://10.0.0.7"


def test_membership_change_adds_and_removes_but_never_empties() -> None:
    change = membership_change(["http://a:1", "http://b:1"], ["http://b:1", "http://c:1"])
    assert (change.added, change.removed) == (("http://c:1",), ("http://a:1",))
    none_named = membership_change(["http://a:1"], [])
    assert (none_named.added, none_named.removed) == ((), ())  # the last known stay, judged by their reads


async def test_resolve_asks_the_system_resolver() -> None:
    assert await resolve("http://localhost:8000") == ["http://127.0.0.1:8000"]
    assert await resolve("http://127.0.0.1:9/x") == ["http://127.0.0.1:9/x"]


STUCK_RESOLVER = """
import asyncio, socket, threading
from kvguard.workers import discovery
socket.getaddrinfo = lambda *args, **kwargs: threading.Event().wait()  # the cluster's DNS down: never answers
discovery.RESOLVE_TIMEOUT_S = 0.2

async def main() -> None:
    outcomes = await asyncio.gather(*(discovery.resolve("http://stuck.test:8000") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(o, discovery.NoAnswer) for o in outcomes), outcomes
    lookups = [t for t in threading.enumerate() if t.name.startswith("kvguard-resolve")]
    assert len(lookups) == 1 and lookups[0].daemon, lookups  # one lookup per name, however many ask

asyncio.run(main())
print("ended")
"""


def test_a_lookup_stuck_in_the_resolver_holds_neither_other_lookups_nor_the_process_exit() -> None:
    """Found by the hanging-resolver test below failing under load: with the cluster's DNS down, a
    router told to stop did not exit (the loop's default executor, joined at exit, held a
    getaddrinfo the resolver kept retrying), and every lookup of a name took a thread of its own."""
    ended = subprocess.run([sys.executable, "-c", STUCK_RESOLVER], capture_output=True, text=True, timeout=60)
    assert ended.returncode == 0 and ended.stdout.strip() == "ended", ended.stderr


async def test_a_lookup_whose_thread_cannot_start_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread to be had (a pod at its pids limit) fails that lookup as NoAnswer, which the
    router's name-following handles, and leaves nothing behind: the next lookup of the name runs
    (audit: the name's pending entry stayed, so every later lookup waited on it and timed out)."""
    from types import SimpleNamespace

    from kvguard.workers import discovery

    class NoThread:
        def __init__(self, **_: object) -> None:
            pass

        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(discovery, "threading", SimpleNamespace(Thread=NoThread))
        with pytest.raises(NoAnswer, match="can't start new thread"):
            await resolve("http://localhost:8000")
    assert await resolve("http://localhost:8000") == ["http://127.0.0.1:8000"]


@pytest.fixture(scope="module")
def trio(tiny_model_dir: Path) -> Iterator[LocalDeployment]:
    with deployment(tiny_model_dir) as running:
        yield running


def _argv_with(argv: list[str], **flags: str) -> list[str]:
    """A worker's command line with some flags' values replaced."""
    out = list(argv)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:  # at its default: left out of the command line
            out += [flag, value]
    return out


@contextlib.contextmanager
def second_prefill(d: LocalDeployment) -> Iterator[str]:
    """Another prefill worker of the revision (its key), on SECOND_HOST at the first one's port, as
    a second pod behind the same Service port; yields its /metrics URL."""
    api, metrics = bind_listener(SECOND_HOST, d.ports["prefill"]), bind_listener("127.0.0.1", 0)
    port = metrics.getsockname()[1]
    argv = _argv_with(d.processes["prefill"].argv, host=SECOND_HOST, port=f"fd:{api.fileno()}", metrics_port=f"fd:{metrics.fileno()}")
    with worker_process(argv, d.env, [api, metrics], f"http://127.0.0.1:{port}"):
        yield f"http://127.0.0.1:{port}/metrics"


@contextlib.contextmanager
def named_router(d: LocalDeployment, model_dir: Path, table: Path) -> Iterator[str]:
    """A router with `--discovery dns` whose workers' names resolve through `table`; yields its API base."""
    api, metrics = bind_listener("127.0.0.1", 0), bind_listener("127.0.0.1", 0)
    port = api.getsockname()[1]
    args = WorkerArgs(role="router", model=model_dir, port=f"fd:{api.fileno()}", metrics_port=f"fd:{metrics.fileno()}",  # type: ignore[arg-type]
                      prefill=(f"http://{PREFILL_NAME}:{d.ports['prefill']}",), decode=(f"http://{DECODE_NAME}:{d.ports['decode']}",),
                      discovery="dns")  # fmt: skip
    argv = [sys.executable, "-P", str(Path(__file__).with_name("dns_table.py")), str(table), "worker", *args.to_argv()]
    with worker_process(argv, d.env, [api, metrics], f"http://127.0.0.1:{port}"):
        yield f"http://127.0.0.1:{port}/v1"


def _prefills_done(metrics_url: str) -> float:
    text = requests.get(metrics_url, timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "kvguard_requests_total")


def _name(table: Path, prefill: list[str], delay_s: float = 0.0) -> None:
    table.write_text(json.dumps({PREFILL_NAME: prefill, DECODE_NAME: ["127.0.0.1"], "__delay__": delay_s}))


def test_a_router_that_resolves_its_workers_uses_every_named_pod_and_follows_the_names(
    trio: LocalDeployment, tiny_model_dir: Path, tmp_path: Path
) -> None:
    table = tmp_path / "dns.json"
    _name(table, ["127.0.0.1", SECOND_HOST])
    model = served_model(trio)
    body = {"model": model, "prompt": "the same prompt to every pod", "max_tokens": 8, "temperature": 0}
    expected = requests.post(f"{trio.api_base}/completions", json=body, timeout=60).json()["choices"][0]["text"]
    first = trio.metrics_urls["prefill"]
    with second_prefill(trio) as second, named_router(trio, tiny_model_dir, table) as api:

        def answers(n: int) -> list[str]:
            replies = [requests.post(f"{api}/completions", json=body, timeout=60) for _ in range(n)]
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            return [r.json()["choices"][0]["text"] for r in replies]

        before = (_prefills_done(first), _prefills_done(second))

        def both_served() -> bool:  # a pod whose first read failed (a loaded machine) joins a second later
            assert answers(2) == [expected] * 2  # each request's calls reached the one pod computing it
            return _prefills_done(first) > before[0] and _prefills_done(second) > before[1]

        assert wait_for(both_served, "both pods to serve", timeout=60)

        _name(table, [SECOND_HOST])  # the first pod is no longer ready: its name goes

        def first_left() -> bool:
            done = _prefills_done(first)
            return answers(4) == [expected] * 4 and _prefills_done(first) == done

        assert wait_for(first_left, "the router to stop sending requests to the pod no longer named", timeout=60)
        _name(table, ["127.0.0.1", SECOND_HOST])  # it is ready again

        def first_back() -> bool:
            done = _prefills_done(first)
            return answers(4) == [expected] * 4 and _prefills_done(first) > done

        assert wait_for(first_back, "the router to send requests to the pod named again", timeout=60)


def test_a_resolver_that_hangs_does_not_keep_a_dead_pod_in_rotation(trio: LocalDeployment, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The names are read beside the workers' health reads, never before them: with the cluster's
    DNS down every lookup hangs (here 600 s), and a pod that dies meanwhile must still leave the
    rotation within the health reads' second (outside audit: its requests failed for as long as
    the lookup hung)."""
    table = tmp_path / "dns.json"
    _name(table, ["127.0.0.1", SECOND_HOST])
    body = {"model": served_model(trio), "prompt": "a prompt while the resolver hangs", "max_tokens": 4, "temperature": 0}
    with named_router(trio, tiny_model_dir, table) as api:
        with second_prefill(trio) as second:

            def second_served() -> bool:
                assert requests.post(f"{api}/completions", json=body, timeout=60).status_code == 200
                return _prefills_done(second) > 0

            wait_for(second_served, "the router to send a request to the second pod")
            _name(table, ["127.0.0.1", SECOND_HOST], delay_s=600)
        # The second pod is gone; its name still stands (the resolver answers nothing at all).

        def all_answered() -> bool:
            return all(requests.post(f"{api}/completions", json=body, timeout=60).status_code == 200 for _ in range(4))

        assert wait_for(all_answered, "every request to be answered with the dead pod out of rotation", timeout=30)


def wait_workers_healthy(d: LocalDeployment) -> None:
    """Both workers answer /health on their metrics ports (after a restart: once loaded)."""
    for role in ("prefill", "decode"):
        health = d.metrics_urls[role].removesuffix("/metrics") + "/health"
        wait_for(lambda health=health: requests.get(health, timeout=30).status_code == 200, f"{health} to answer",
                 120, 0.05, ignoring=(requests.RequestException,))  # fmt: skip


async def test_a_worker_that_refuses_the_instance_it_was_signed_for_is_read_again_at_once(
    trio: LocalDeployment, tiny_model_dir: Path
) -> None:
    """A worker restarted at its address between two reads of its limits is a new instance: calls
    signed for the old one are refused (401). The refusal makes the router read the worker again
    at once, not only at the next periodic read (here an hour away), and send the refused call
    once more, signed for the new instance: the request that met the restart is answered (outside
    probe: every request queued through a worker's restart got a 502). Run in-process so the
    router's last read can be set back."""
    import aiohttp
    from aiohttp import web

    from kvguard.workers.keys import RevisionKeys
    from kvguard.workers.router import Router, RouterConfig
    from kvguard.workers.tokenizer import Tokenizer

    config = RouterConfig(prefill_urls=(trio.internal_urls["prefill"],), decode_urls=(trio.internal_urls["decode"],),
                          model_name=served_model(trio), refresh_interval_s=3600.0)  # fmt: skip
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    assert tokenizer is not None
    router = Router(config, tokenizer, RevisionKeys.from_env(trio.env))
    runner = web.AppRunner(router.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"  # type: ignore[union-attr]
    body = {"model": config.model_name, "prompt": "restarted between two reads", "max_tokens": 4, "temperature": 0}
    try:
        async with aiohttp.ClientSession() as client:

            async def status() -> int:
                async with client.post(f"{base}/completions", json=body) as resp:
                    return resp.status

            await until(lambda: router._upstreams is not None, "the router to read its workers")
            assert await status() == 200
            upstreams = router.upstreams
            # Both restart at their addresses (the launcher's watch, as a kubelet restarts a container),
            # between two of the router's reads: it still holds the old instances, read before.
            old = {u.url: u.info.instance for u in upstreams.prefill + upstreams.decode}
            for role in ("prefill", "decode"):
                await asyncio.to_thread(trio.kill, role)
            await asyncio.to_thread(wait_workers_healthy, trio)
            assert await status() == 200  # refused first (signed for an instance that is gone), then sent again
            assert all(u.info.instance != old[u.url] for u in upstreams.prefill + upstreams.decode)
            for role in ("prefill", "decode"):  # refused, not let through, and counted outside the S9 alert
                assert metric(trio, role, "kvguard_control_auth_failures_total", reason="previous_instance") >= 1, role
                assert metric(trio, role, "kvguard_control_auth_failures_total", reason="wrong_target") == 0, role
            assert await status() == 200
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _stand_in_prefill(worker: dict[str, Any], acted: list[str], refused: list[str]) -> AsyncIterator[tuple[str, Any]]:
    """A prefill worker that refuses, as the real middleware does, any call not signed for its
    current instance (`worker["instance"]`, which a test changes to restart it), and a router that
    last read it as that instance; yields (its URL, the router)."""
    import re
    import secrets

    import aiohttp
    from aiohttp import web

    from kvguard.workers.keys import RevisionKeys
    from kvguard.workers.protocol import Role, WorkerInfo
    from kvguard.workers.router import Router, RouterConfig, Upstream, Upstreams

    def info(role: Role, pool: int, instance: str) -> WorkerInfo:
        return WorkerInfo(role=role, model="m", context_length=1024, kv_pool_tokens=pool, page_size=16, instance=instance)

    async def read_info(_request: web.Request) -> web.Response:
        return web.json_response(info(Role.PREFILL, worker["pool"], worker["instance"]).model_dump(mode="json"))

    async def act(request: web.Request) -> web.Response:
        match = re.search(r"target=(\w+)", request.headers.get("X-Kvguard-Auth", ""))
        if match is None or match.group(1) != worker["instance"]:
            refused.append(match.group(1) if match else "")
            return web.json_response({"error": {"message": "signed for another instance", "code": "unauthenticated"}}, status=401)
        acted.append(match.group(1))
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/internal/info", read_info)
    app.router.add_post("/internal/{call}", act)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    decode = "http://127.0.0.1:9"  # never called
    router = Router(RouterConfig(prefill_urls=(url,), decode_urls=(decode,), model_name="m", refresh_interval_s=3600.0),
                    None, RevisionKeys.derive(b"k" * 32))  # type: ignore[arg-type]  # fmt: skip
    router.session = aiohttp.ClientSession()
    router._upstreams = Upstreams([Upstream(url, info(Role.PREFILL, 4096, worker["instance"]))],
                                  [Upstream(decode, info(Role.DECODE, 4096, secrets.token_hex(16)))], min_kv_ratio=2.0)  # fmt: skip
    try:
        yield url, router
    finally:
        await router.session.close()
        await runner.cleanup()


@pytest.mark.parametrize("restarted_pool, resent", [(4096, True), (512, False)])
async def test_a_refused_call_goes_again_only_to_a_restarted_worker_the_rotation_admits(restarted_pool: int, resent: bool) -> None:
    """A call refused as signed for a previous instance is sent again to the new one only if that
    new instance may serve: restarted with a pool below 2x context it is kept out of rotation (S7),
    and nothing is sent to it (audit: the resend went to it all the same). The worker is a stand-in
    that refuses, as the real middleware does, any call not signed for its current instance."""
    import secrets

    import aiohttp

    from kvguard.workers.protocol import AbortRequest

    worker: dict[str, Any] = {"instance": secrets.token_hex(16), "pool": 4096}
    acted: list[str] = []
    async with _stand_in_prefill(worker, acted, []) as (url, router):
        worker.update(instance=secrets.token_hex(16), pool=restarted_pool)  # restarted since the last read
        async with router._control_call(url, "/internal/prefill", AbortRequest(request_id="x"), aiohttp.ClientTimeout(total=30)) as resp:
            status = resp.status
        assert router.upstreams.admits(router.upstreams.prefill[0]) is resent  # the refusal made it read again
        assert (status, acted) == ((200, [worker["instance"]]) if resent else (401, []))


async def test_after_a_connection_to_a_worker_failed_its_next_call_is_signed_for_the_instance_now_there() -> None:
    """A launcher or a pod restart keeps the address: the first calls after a crash (the aborts of
    requests that ended meanwhile) were signed for the old instance, refused, and counted by the
    new worker as S9 refusals with no attacker (an outside probe: the trust-boundary alert fired on
    every crash). A worker whose connection failed mid-request is read again before the next call."""
    import secrets

    worker: dict[str, Any] = {"instance": secrets.token_hex(16), "pool": 4096}
    acted: list[str] = []
    refused: list[str] = []
    async with _stand_in_prefill(worker, acted, refused) as (url, router):
        worker.update(instance=secrets.token_hex(16))  # it crashed and came back on its port
        router._suspect.add(url)  # as `_generate` marks the worker whose connection failed
        await router._send_aborts("cmpl-x", [url], "worker_died")
        assert (acted, refused) == ([worker["instance"]], [])
        worker.update(instance=secrets.token_hex(16))  # once read again, calls are signed as last read
        await router._send_aborts("cmpl-y", [url], "worker_died")
        assert len(refused) == 1


@contextlib.asynccontextmanager
async def _info_servers(roles: list[Any]) -> AsyncIterator[list[str]]:
    """One stand-in worker per role, on loopback, answering `/internal/info` as that role; yields their URLs."""
    import secrets

    from aiohttp import web

    from kvguard.workers.protocol import WorkerInfo

    runners: list[web.AppRunner] = []
    urls: list[str] = []
    try:
        for role in roles:
            info = WorkerInfo(role=role, model="m", context_length=1024, kv_pool_tokens=4096, page_size=16, instance=secrets.token_hex(16))

            async def read_info(_request: web.Request, info: WorkerInfo = info) -> web.Response:
                return web.json_response(info.model_dump(mode="json"))

            app = web.Application()
            app.router.add_get("/internal/info", read_info)
            runner = web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_pod_of_another_role_behind_the_name_keeps_only_itself_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode pod behind prefill's name is left out alone: the prefill pods named with it join
    (review: its ValueError failed the whole pass, at every pass, so no new prefill pod joined for
    as long as it was named). A pod whose name went is no longer marked for a read before its next
    call (the marks only grew)."""
    import aiohttp

    from kvguard.workers import router as router_module
    from kvguard.workers.keys import RevisionKeys
    from kvguard.workers.protocol import Role
    from kvguard.workers.router import Router, RouterConfig, read_workers

    keys = RevisionKeys.derive(b"k" * 32)
    async with _info_servers([Role.PREFILL, Role.PREFILL, Role.DECODE, Role.PREFILL]) as (first, second, wrong, third):
        router = Router(RouterConfig(prefill_urls=(first,), decode_urls=(wrong,), model_name="m", discovery="dns"),
                        None, keys)  # type: ignore[arg-type]  # fmt: skip
        async with aiohttp.ClientSession() as session:
            router.session = session
            assert {u.url for u in await read_workers(session, router.control, [second, wrong, third], Role.PREFILL)} == {second, third}
            upstreams = router_module.Upstreams(
                await read_workers(session, router.control, [first], Role.PREFILL),
                await read_workers(session, router.control, [wrong], Role.DECODE), min_kv_ratio=2.0,
            )  # fmt: skip
            router._upstreams = upstreams
            named = {Role.PREFILL: [first, second, wrong, third], Role.DECODE: [wrong]}

            async def resolve_table(urls: Any) -> list[str]:
                return named[Role.PREFILL] if urls == (first,) else named[Role.DECODE]

            monkeypatch.setattr(router_module, "resolve_workers", resolve_table)
            await router._follow_names(upstreams)
            assert {u.url for u in upstreams.prefill} == {first, second, third}  # the decode pod alone is out

            router._suspect.add(second)  # as a failed connection to it marks it
            named[Role.PREFILL] = [first, third]  # its pod went
            await router._follow_names(upstreams)
            assert {u.url for u in upstreams.prefill} == {first, third} and second not in router._suspect
