"""Helpers for tests that drive a real router + prefill + decode trio on loopback."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import openai
import requests
from engine_device import TEST_DEVICE
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for

from kvguard.workers.args import WorkerArgs, bind_listener
from kvguard.workers.control_auth import ANY_WORKER, auth_headers
from kvguard.workers.launcher import LocalDeployment, LocalServeConfig
from kvguard.workers.transfer import TicketAuthority

MODEL = "tiny"  # the served name is the model folder's name; the fixtures' folders differ, so use .model
# Generous on purpose: a transfer that makes no progress for this long fails its request, and on a
# loaded machine a healthy prefill can take seconds to start sending. The tests of that timeout
# pass their own short one.
TRANSFER_TIMEOUT_S = 60.0
POOLS_EMPTY_S = 30.0
"""S4's bound in these tests: well inside TRANSFER_TIMEOUT_S, so pools that empty in time were
freed by the abort, not by a transfer timing out."""


@contextlib.contextmanager
def deployment(model_dir: Path, faults: str = "", **overrides: object) -> Iterator[LocalDeployment]:
    settings: dict[str, object] = {
        "model_dir": model_dir,
        "device": "cpu",  # the same device as the reference engine below
        "kv_pool_tokens": 4096,
        "context_length": 1024,
        "transfer_timeout_s": TRANSFER_TIMEOUT_S,
        "extra_env": (("KVGUARD_FAULTS", faults),) if faults else (),
    }
    settings.update(overrides)
    with LocalDeployment(LocalServeConfig(**settings)) as running:  # type: ignore[arg-type]
        yield running


def client(d: LocalDeployment, timeout: float = 30.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.api_base, api_key="unused", timeout=timeout, max_retries=0)


def served_model(d: LocalDeployment) -> str:
    return str(requests.get(f"{d.api_base}/models", timeout=30).json()["data"][0]["id"])


def complete(d: LocalDeployment, prompt: str, max_tokens: int = 16, **kwargs: object) -> str:
    response = client(d).completions.create(
        model=served_model(d), prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs  # type: ignore[arg-type]
    )
    return response.choices[0].text


def metric(d: LocalDeployment, role: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (with these labels) on one process's /metrics."""
    return metric_at(d.metrics_urls[role], name, **labels)


def metric_at(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (with these labels) on the /metrics at `url`."""
    text = requests.get(url, timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_metric(d: LocalDeployment, role: str, name: str, expected: float, timeout_s: float = POOLS_EMPTY_S,
                **labels: str) -> None:
    """Wait until `name` (with these labels) on one process reads `expected`. A worker counts an
    abort after its engine freed the pages, so a read right after the pools empty can come first."""
    wait_for(lambda: metric(d, role, name, **labels) == expected, f"{role}'s {name}{labels or ''} to be {expected:g}",
             timeout_s, detail=lambda: metric(d, role, name, **labels))  # fmt: skip


def pools_used(d: LocalDeployment, roles: tuple[str, ...] = ("prefill", "decode")) -> dict[str, float]:
    return {role: metric(d, role, "kvguard_kv_pool_used_tokens") for role in roles}


def wait_pools_empty(d: LocalDeployment, timeout_s: float = POOLS_EMPTY_S, roles: tuple[str, ...] = ("prefill", "decode")) -> None:
    """S4: the pools back to zero within the bound."""
    wait_for(lambda: not any(pools_used(d, roles).values()), f"the {'/'.join(roles)} KV pools to be empty", timeout_s,
             detail=lambda: pools_used(d, roles))  # fmt: skip


def wait_healthy(d: LocalDeployment, timeout_s: float = 120.0) -> None:
    """The router and both workers answer /health again (a restarted worker loads its model first).
    Each worker is asked itself: the router's answer about them may be a second old (it shares one
    check among its callers), and a test went on before a crashed prefill was restarted."""
    for role in ("prefill", "decode"):
        health = d.metrics_urls[role].removesuffix("/metrics") + "/health"
        wait_for(lambda health=health: requests.get(health, timeout=30).status_code == 200, f"{role} to be healthy again",
                 timeout_s, 0.2, ignoring=(requests.RequestException,))  # fmt: skip
    wait_for(lambda: requests.get(f"{d.router_url}/health", timeout=30).status_code == 200, "the deployment to be healthy again",
             timeout_s, 0.2, ignoring=(requests.RequestException,))  # fmt: skip


def first_chunk_then_leave(d: LocalDeployment, prompt: str, max_tokens: int) -> str:
    """A streaming client that reads one chunk and closes the connection: it leaves once its first
    token has come, whatever the machine's speed (mid-decode, unless the rest was out already).
    Returns the chunk's text."""
    stream = client(d).completions.create(model=served_model(d), prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    try:
        return next(iter(stream)).choices[0].text
    finally:
        stream.close()


@contextlib.contextmanager
def hang_up_after(d: LocalDeployment, body: dict[str, object]) -> Iterator[None]:
    """POST `body` to /v1/completions and close the connection when the block ends, without
    reading an answer: a client that leaves exactly when the test says (e.g. once its KV is
    allocated). The router sends no headers before the first token, so a client library would
    still be waiting inside its call; a plain HTTP connection is the client here."""
    host, port = d.router_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        body = {"model": served_model(d), **body}
        connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        yield
    finally:
        connection.close()


@cache
def _engine(model_dir: Path, kv_pool_tokens: int, context_length: int):  # type: ignore[no-untyped-def]
    from kvguard.workers.config import EngineConfig
    from kvguard.workers.engine import Engine

    return Engine(EngineConfig(model_dir=model_dir, device=TEST_DEVICE, kv_pool_tokens=kv_pool_tokens, context_length=context_length))


def reference_text(model_dir: Path, prompt: str, max_tokens: int = 16, kv_pool_tokens: int = 4096, context_length: int = 1024) -> str:
    """The single-process (colocated) engine's greedy output for the same prompt."""
    from kvguard.workers.request import SamplingParams

    engine = _engine(model_dir, kv_pool_tokens, context_length)
    ids = engine.tokenizer.encode(prompt)
    [request] = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return request.output_text


# -- the router's side of the internal API, for tests that play the router --------------------------


def internal(d: LocalDeployment, role: str, path: str, body: Any = None, *, signed: bool = True,
             stream: bool = False, timeout: float = 10.0) -> requests.Response:  # fmt: skip
    """A call to a worker's internal control API, signed with the deployment's key as the router
    signs it (``signed=False``: as any other pod on the network would call it)."""
    url = f"{d.internal_urls[role]}{path}"
    data = json.dumps(body).encode() if body is not None else b""
    method = "POST" if body is not None else "GET"
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if signed:
        headers.update(auth_headers(d.keys.control, method, url, data, worker_instance(d, role) if body is not None else ANY_WORKER))
    return requests.request(method, url, data=data or None, headers=headers, stream=stream, timeout=timeout)


def worker_instance(d: LocalDeployment, role: str) -> str:
    """The worker's instance id, which a call that acts is signed for (as the router learns it)."""
    url = f"{d.internal_urls[role]}/internal/info"
    return str(requests.get(url, headers=auth_headers(d.keys.control, "GET", url), timeout=10).json()["instance"])


def ticket_for(d: LocalDeployment, request_id: str, bootstrap: dict[str, Any], ttl_s: float = 30.0, **changes: Any) -> str:
    """The ticket the router would issue for decode's bootstrap (fields replaced by ``changes``)."""
    b = {**bootstrap, **changes}
    ticket = TicketAuthority(d.keys.ticket).issue(
        request_id, (b["transfer_host"], b["transfer_port"]), b["epoch"], bytes.fromhex(b["nonce"]), b["num_tokens"],
        b["page_ids"], b["generations"], ttl_s,
    )  # fmt: skip
    return ticket.text


@contextlib.contextmanager
def second_router(d: LocalDeployment, model_dir: Path, **flags: object) -> Iterator[str]:
    """Another router process in front of the same prefill and decode (as a second replica of the
    router Deployment would be), with any other WorkerArgs `flags`; yields its API base URL."""
    with second_router_urls(d, model_dir, **flags) as (api_base, _):
        yield api_base


@contextlib.contextmanager
def second_router_urls(d: LocalDeployment, model_dir: Path, **flags: object) -> Iterator[tuple[str, str]]:
    """`second_router`, yielding its API base URL and its /metrics URL."""
    api, metrics = bind_listener("127.0.0.1", 0), bind_listener("127.0.0.1", 0)
    port, metrics_port = api.getsockname()[1], metrics.getsockname()[1]
    args = WorkerArgs(role="router", model=model_dir, port=f"fd:{api.fileno()}", metrics_port=f"fd:{metrics.fileno()}",  # type: ignore[arg-type]
                      prefill=(d.internal_urls["prefill"],), decode=(d.internal_urls["decode"],), **flags)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with worker_process([sys.executable, "-P", "-m", "kvguard", "worker", *args.to_argv()], d.env, [api, metrics], base):
        yield f"{base}/v1", f"http://127.0.0.1:{metrics_port}/metrics"


@contextlib.contextmanager
def worker_process(argv: list[str], env: dict[str, str], sockets: list[socket.socket], health: str) -> Iterator[None]:
    """A worker process given `sockets` (closed here once it holds them), ready once `health`/health
    answers 200; terminated when the block ends."""
    process = subprocess.Popen(argv, env=env, pass_fds=tuple(s.fileno() for s in sockets), stdout=subprocess.DEVNULL)
    for s in sockets:
        s.close()
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{health}/health", timeout=2).status_code == 200:
                    break
            assert process.poll() is None and time.monotonic() < deadline, f"{argv[3:6]} never became ready"
            time.sleep(0.1)
        yield
    finally:
        process.terminate()
        # A worker drains for up to --drain-timeout (15 s), then SHUTDOWN_GRACE_S (5 s): 20 s would
        # leave no room for a loaded machine's slower exit.
        process.wait(60)
