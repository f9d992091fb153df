"""Start a router, a prefill and a decode worker as local processes on loopback, and stop them.

Used by `kvguard serve`, by tests and benchmarks. Each worker is a real `python -m kvguard worker`
process. This process binds every listening socket itself, before any child starts, and hands
each child its sockets as inherited file descriptors (`--port fd:N`): a busy port is reported at
once, naming its flag, and no other program can take a port between choosing and binding it. A
worker that dies is restarted on the same sockets (the way a Deployment replaces a pod; clients
queue in the socket's backlog meanwhile), so the deployment heals while the requests it held get
clean errors (S4). Every worker also holds the read end of a pipe only this process writes to
(`LIFELINE_FD_ENV`): if this process dies without stopping them (SIGKILL, the OOM killer), they
read EOF and stop, instead of serving on with every port held.

Listeners per process (workers/args.py): router API + router metrics; prefill internal + metrics;
decode internal + metrics + KV transfer.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import requests

from kvguard.workers.args import (
    DEFAULT_ABORT_TIMEOUT_S,
    DEFAULT_BOOTSTRAP_TIMEOUT_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    LIFELINE_FD_ENV,
    Listen,
    TransferEncryption,
    WorkerArgs,
    bind_listener,
    worker_default,
)
from kvguard.workers.control_auth import auth_headers
from kvguard.workers.keys import TRANSFER_KEY_ENV, RevisionKeys, load_revision_key
from kvguard.workers.pool_ratio import DEFAULT_MIN_KV_RATIO, ratio_number, ratio_text, required_pool_tokens

log = logging.getLogger("kvguard.launcher")

HOST = "127.0.0.1"
ROLES = ("prefill", "decode", "router")


def popen_holding_sigint(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """A `kvguard` child that starts with SIGINT blocked (a signal mask survives exec), for
    `kvguard.cli.main` to unblock once it can end on it with one line. `stop` during start-up hit a
    worker still initialising Python, which died with "Fatal Python error: init_sys_streams" and a
    traceback on serve's stderr (CI under load)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return subprocess.Popen(argv, **kwargs)  # noqa: S603 - our own argv
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class SmallPoolError(ValueError):
    """The KV pool is below the ratio to the context (the incident's configuration)."""


class StartStopped(Exception):
    """`start` was told to stop (its `stop` event) before every worker was ready: nothing runs."""


@dataclass(frozen=True)
class LocalServeConfig:
    model_dir: Path
    model_name: str | None = None  # the name served in the API; None: the model folder's name
    port: int = 0  # router API port; 0 picks a free one (as do the ports below)
    metrics_port: int = 0  # the router's /metrics
    prefill_port: int = 0  # prefill's internal control API
    prefill_metrics_port: int = 0
    decode_port: int = 0  # decode's internal control API
    decode_metrics_port: int = 0
    transfer_port: int = 0  # decode's KV transfer listener
    kv_pool_tokens: int | None = None
    context_length: int | None = None
    page_size: int = worker_default("page_size")
    device: str = worker_default("device")  # CUDA when present (kvguard.workers.device decides)
    max_transfer_batch: int = worker_default("max_transfer_batch")
    transfer_timeout_s: float = worker_default("transfer_timeout")
    transfer_encryption: TransferEncryption = worker_default("transfer_encryption")
    stream_interval: int = worker_default("stream_interval")  # decode: tokens per streamed event after the first
    token_channel: bool = True  # router: decode's tokens on one channel for all requests (False: a stream each)
    max_running_requests: int = worker_default("max_running_requests")  # prefill and decode: requests holding pages at once
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S  # prefill: wait for a ticket; decode: for prefill's OPEN
    request_timeout_s: float = worker_default("request_timeout")  # router: how long a request may wait for its next token (504)
    max_inflight_choices: int = worker_default("max_inflight_choices")  # router: generations with worker calls open at once (more wait in the router)
    abort_timeout_s: float = DEFAULT_ABORT_TIMEOUT_S  # router: how long a worker may take to acknowledge an abort
    write_timeout_s: float = worker_default("write_timeout")  # router: a client that reads none of its answer this long loses the connection
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # every role: on SIGTERM, how long it finishes what it holds
    min_kv_ratio: float = DEFAULT_MIN_KV_RATIO
    allow_small_pool: bool = False  # serve a pool below min_kv_ratio x context anyway (logged loudly)
    extra_env: tuple[tuple[str, str], ...] = ()  # e.g. (("KVGUARD_FAULTS", "no_tags"),)
    log_dir: Path | None = None  # worker logs go here; None: inherit stderr

    def listener_ports(self) -> dict[str, tuple[int, str]]:
        """listener name -> (wanted port, the flag that sets it), in bind order."""
        return {
            "router": (self.port, "--port"),
            "router-metrics": (self.metrics_port, "--metrics-port"),
            "prefill": (self.prefill_port, "--prefill-port"),
            "prefill-metrics": (self.prefill_metrics_port, "--prefill-metrics-port"),
            "decode": (self.decode_port, "--decode-port"),
            "decode-metrics": (self.decode_metrics_port, "--decode-metrics-port"),
            "decode-transfer": (self.transfer_port, "--transfer-port"),
        }

    def small_pool_problem(self, pool_tokens: int, context_length: int) -> str | None:
        at_least = required_pool_tokens(self.min_kv_ratio, context_length, self.page_size)  # whole pages
        if pool_tokens >= at_least:
            return None
        return (
            f"the KV pool ({pool_tokens} tokens) is {ratio_text(pool_tokens, context_length)} the context length ({context_length} tokens), "
            f"below the safe ratio {ratio_number(self.min_kv_ratio)}x: raise --kv-pool-tokens to at least {at_least} "
            f"(whole pages of {self.page_size}) or lower --context-length (--allow-small-pool serves it anyway)"
        )

    def port_clash(self) -> str | None:
        """Two flags asking for the same fixed port: one line naming both, before anything binds
        (else the second bind reads as if another program held the port)."""
        taken: dict[int, str] = {}
        for port, flag in self.listener_ports().values():
            if port and port in taken:
                return f"{taken[port]} and {flag} both ask for port {port}; give each listener its own"
            taken.setdefault(port, flag)
        return None

    def context_problem(self) -> str | None:
        """A --context-length above the model's own maximum, found before any process starts
        (the engine checks it too, but only once the other workers are up)."""
        if self.context_length is None:
            return None
        try:
            limit = json.loads((self.model_dir / "config.json").read_text()).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            return None  # the engine reports an unreadable config itself
        if isinstance(limit, int) and self.context_length > limit:
            return f"--context-length {self.context_length} exceeds the model's maximum {limit} (max_position_embeddings)"
        return None


def open_listeners(config: LocalServeConfig) -> dict[str, socket.socket]:
    """Bind every listener now; OSError naming the flag of a port that is taken."""
    sockets: dict[str, socket.socket] = {}
    try:
        for name, (port, flag) in config.listener_ports().items():
            try:
                sockets[name] = bind_listener(HOST, port)
            except OSError as exc:
                raise OSError(f"cannot listen on {HOST}:{port} ({flag}): {exc.strerror or exc}") from None
    except OSError:
        for sock in sockets.values():
            sock.close()
        raise
    return sockets


@dataclass
class _Process:
    name: str
    argv: list[str]
    fds: tuple[int, ...]
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0


@dataclass
class LocalDeployment:
    """A running router + prefill + decode trio. Use as a context manager or call start/stop.

    Raises OSError at construction if a wanted port is taken, and SmallPoolError if the requested
    pool is below the ratio (unless `allow_small_pool`)."""

    config: LocalServeConfig
    processes: dict[str, _Process] = field(default_factory=dict)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None

    def __post_init__(self) -> None:
        c = self.config
        if (problem := c.port_clash() or c.context_problem()) is not None:
            raise ValueError(problem)
        if c.kv_pool_tokens is not None and c.context_length is not None and not c.allow_small_pool:
            whole_pages = c.kv_pool_tokens // c.page_size * c.page_size  # what the engine allocates (plan_pool_pages)
            if (problem := c.small_pool_problem(whole_pages, c.context_length)) is not None:
                raise SmallPoolError(problem)
        self.sockets = open_listeners(c)
        self.ports = {name: int(sock.getsockname()[1]) for name, sock in self.sockets.items()}
        self.processes = {role: self._process(role) for role in ROLES}
        # One fresh revision key per deployment, for every process (the router included).
        self._env = {**os.environ, TRANSFER_KEY_ENV: secrets.token_hex(32), **dict(c.extra_env)}
        self.keys = RevisionKeys.derive(load_revision_key(self._env))
        # Only this process holds the write end: when it dies, however it dies, every worker
        # reads EOF and stops (workers/servers.py watch_lifeline) instead of keeping the ports.
        self._lifeline = os.pipe()

    @property
    def env(self) -> dict[str, str]:
        """The environment the processes run with (tests start a second router with it)."""
        return dict(self._env)

    def _fd(self, name: str) -> Listen:
        return Listen(fd=self.sockets[name].fileno())

    def _process(self, role: str) -> _Process:
        c = self.config
        engine: dict[str, object] = {
            "device": c.device, "page_size": c.page_size, "kv_pool_tokens": c.kv_pool_tokens,
            "context_length": c.context_length, "max_transfer_batch": c.max_transfer_batch,
            "transfer_timeout": c.transfer_timeout_s, "transfer_encryption": c.transfer_encryption,
            "max_running_requests": c.max_running_requests, "bootstrap_timeout": c.bootstrap_timeout_s,
            # Prefill and decode share the one device: on a GPU each sizes its pool from half of it.
            "device_share": 1.0 if c.device == "cpu" else 0.5,
        }  # fmt: skip
        common: dict[str, object] = {"role": role, "model": c.model_dir, "model_name": c.model_name, "host": HOST,
                                     "drain_timeout": c.drain_timeout_s}  # fmt: skip
        if role == "router":
            args = WorkerArgs(**common, port=self._fd("router"), metrics_port=self._fd("router-metrics"),
                              prefill=(self.internal_urls["prefill"],), decode=(self.internal_urls["decode"],),
                              request_timeout=c.request_timeout_s, max_inflight_choices=c.max_inflight_choices,
                              write_timeout=c.write_timeout_s, abort_timeout=c.abort_timeout_s,
                              token_channel="on" if c.token_channel else "off")  # fmt: skip
        elif role == "prefill":
            args = WorkerArgs(**common, **engine, port=self._fd("prefill"), metrics_port=self._fd("prefill-metrics"))
        else:
            args = WorkerArgs(**common, **engine, port=self._fd("decode"), metrics_port=self._fd("decode-metrics"),
                              transfer_port=self._fd("decode-transfer"), stream_interval=c.stream_interval)  # fmt: skip
        fds = tuple(self.sockets[n].fileno() for n in self.sockets if n == role or n.startswith(f"{role}-"))
        # -P: the working directory may hold this repo, whose operator/ folder would shadow the
        # standard library's `operator` module.
        return _Process(role, [sys.executable, "-P", "-m", "kvguard", "worker", *args.to_argv()], fds)

    @staticmethod
    def url(port: int) -> str:
        return f"http://{HOST}:{port}"

    @property
    def router_url(self) -> str:
        return self.url(self.ports["router"])

    @property
    def api_base(self) -> str:
        return f"{self.router_url}/v1"

    @property
    def metrics_urls(self) -> dict[str, str]:
        """role -> its read-only /metrics URL."""
        return {role: f"{self.url(self.ports[f'{role}-metrics'])}/metrics" for role in ROLES}

    @property
    def internal_urls(self) -> dict[str, str]:
        """role -> base URL of its internal control API (prefill and decode; the router's audience)."""
        return {role: self.url(self.ports[role]) for role in ("prefill", "decode")}

    @property
    def transfer_address(self) -> tuple[str, int]:
        return HOST, self.ports["decode-transfer"]

    def start(self, ready_timeout_s: float = 120.0, stop: threading.Event | None = None) -> LocalDeployment:
        """Every worker started and healthy, their pools checked (S7). A `stop` set meanwhile ends
        the start: the workers are stopped and StartStopped raised."""
        for name in ROLES:
            self._spawn(self.processes[name])
        try:
            self.wait_ready(ready_timeout_s, stop)
            self._check_pools()
            if stop is not None and stop.is_set():  # it came after wait_ready's last look
                raise StartStopped("stopped as every worker became ready")
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="kvguard-launcher-watch", daemon=True)
        self._watcher.start()
        return self

    def _spawn(self, process: _Process) -> None:
        stdout: BinaryIO | None = None  # None: the child writes to our own stdout and stderr
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            stdout = open(self.config.log_dir / f"{process.name}.log", "ab")  # noqa: SIM115 - owned by the child
        lifeline = self._lifeline[0]
        process.popen = popen_holding_sigint(
            process.argv,
            env={**self._env, LIFELINE_FD_ENV: str(lifeline)},
            pass_fds=(*process.fds, lifeline),
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            start_new_session=True,  # a Ctrl-C in the terminal reaches serve, which stops us in order
        )

    def wait_ready(self, timeout_s: float, stop: threading.Event | None = None) -> None:
        """Every process healthy on its metrics listener (they load in parallel)."""
        deadline = time.monotonic() + timeout_s
        pending = list(ROLES)
        while pending:
            if stop is not None and stop.is_set():
                raise StartStopped(f"stopped while {', '.join(pending)} started")
            for name in list(pending):
                popen = self.processes[name].popen
                assert popen is not None
                if popen.poll() is not None:
                    raise RuntimeError(f"{name} worker exited with status {popen.returncode} during start-up")
                try:
                    if requests.get(self.metrics_urls[name].removesuffix("/metrics") + "/health", timeout=2).status_code == 200:
                        pending.remove(name)
                except requests.RequestException:
                    pass
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(pending)} not healthy after {timeout_s:.0f} s")
            if pending:
                (stop.wait if stop is not None else time.sleep)(0.05)

    def _check_pools(self) -> None:
        """S7 on this machine: every worker's *reported* pool against the ratio (the pool may come
        from memory, so it is only known once the worker runs)."""
        for role in ("prefill", "decode"):
            url = f"{self.internal_urls[role]}/internal/info"
            info = requests.get(url, headers=auth_headers(self.keys.control, "GET", url), timeout=5).json()
            problem = self.config.small_pool_problem(info["kv_pool_tokens"], info["context_length"])
            if problem is None:
                continue
            if not self.config.allow_small_pool:
                raise SmallPoolError(f"{role}: {problem}")
            log.warning("UNSAFE (--allow-small-pool): %s: %s", role, problem)

    def _watch(self) -> None:
        """Restart a worker that died, on the same sockets, like a Deployment replacing its pod."""
        while not self._stopping.wait(0.2):
            for process in self.processes.values():
                if process.popen is not None and process.popen.poll() is not None and not self._stopping.is_set():
                    log.warning("%s worker exited with status %s; restarting it", process.name, process.popen.returncode)
                    process.restarts += 1
                    self._spawn(process)

    def kill(self, name: str) -> None:
        """Test hook: kill one worker abruptly (SIGKILL), as a node failure would."""
        popen = self.processes[name].popen
        assert popen is not None
        popen.kill()
        popen.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every worker now: SIGINT, not SIGTERM (which finishes the requests in flight first,
        servers.Drain): whoever stops `kvguard serve` wants it gone, streams or not."""
        self._stopping.set()
        for name in ("router", "prefill", "decode"):
            popen = self.processes[name].popen
            if popen is not None and popen.poll() is None:
                popen.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            if process.popen is None:
                continue
            try:
                process.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
        for sock in self.sockets.values():
            sock.close()
        for fd in self._lifeline:
            if fd >= 0:
                os.close(fd)
        self._lifeline = (-1, -1)  # stop() may run twice (a failed start, then __exit__)

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
