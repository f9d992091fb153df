"""The local backend: each revision's router, prefill and decode workers as processes on loopback.

What a Deployment is on Kubernetes, a `LocalRevision` is here: its workers' command lines, ports
and PIDs, recorded in a state folder so that a restarted `kvguard apply` adopts the processes that
still run and resumes the rollout from the recorded status (S8), exactly as the operator resumes
from `status`. The folder::

    STATE_DIR/state.json                       revisions, ports, PIDs, stable, serving, rollout status
    STATE_DIR/lock                             flock held by the one `kvguard apply` driving it
    STATE_DIR/revisions/<rev>/transfer.key     the revision's KV-transfer HMAC key (0600, never logged; S3)
    STATE_DIR/revisions/<rev>/<worker>.log     each worker's output
    STATE_DIR/split.json                       the splitter's table: which revision's router gets what share
    STATE_DIR/splitter.log                     the splitter's output

Traffic: one splitter process (`kvguard splitter`, workers/splitter.py) listens on a port chosen
once per state folder and forwards every OpenAI API request to a revision's router by the weights
in split.json. It stands where the Gateway and its HTTPRoute stand on a cluster: promotion
(`route`) and the traffic steps (`split_traffic`) rewrite the table, never the URL
`kvguard apply` prints (`LocalBackend.serving_url()`), so a client keeps one URL through every
rollout. The old revision is stopped only after the table no longer sends it anything (S8).

Workers are `python -m kvguard worker ...` processes in their own session, so a Ctrl-C aimed at
`kvguard apply` does not kill a serving revision; a worker found dead is restarted on its ports
(a Deployment replacing its pod), at once the first time and then with the kubelet's
CrashLoopBackOff (`restart_backoff.py`) while it keeps dying. This module starts processes; it
never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import fcntl
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import requests
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvguard.operator.api import EngineKind, InferenceModelSpec, KVPlan
from kvguard.operator.backends.base import (
    ForeignObjectError,
    ModelRef,
    Observation,
    RevisionEndpoints,
    RevisionRequest,
    WorkerEndpoint,
)
from kvguard.operator.backends.restart_backoff import KUBELET, RestartBackoff
from kvguard.operator.engine_support import engine_problems, kvguard_dtype_flag, kvguard_role_options
from kvguard.operator.pool_gate import PoolRequirement
from kvguard.operator.rollout import Scale
from kvguard.operator.spec_checks import canary_problems
from kvguard.operator.traffic import Share
from kvguard.workers.args import DEFAULT_DRAIN_TIMEOUT_S, INHERITED_LISTENERS_ENV, WorkerArgs, reserve_port
from kvguard.workers.servers import SHUTDOWN_GRACE_S
from kvguard.workers.splitter import SPLIT_FILE, SplitBackend, SplitTable, write_table

log = logging.getLogger("kvguard.local")

STATE_FILE = "state.json"
_STARTED_HERE = (b"\0-m\0kvguard\0worker\0", b"\0-m\0kvguard\0splitter\0")
"""What the command line of every process a state folder starts holds (`python -P -m kvguard ...`)."""


def _started_here(cmdline: bytes) -> bool:
    return any(marker in cmdline for marker in _STARTED_HERE)

SPLITTER_LOG = "splitter.log"
AFRESH = ("start afresh with `kvguard apply --local --delete` on this --state-dir: it stops the processes that log "
          "into the folder and removes it")
LOCK_FILE = "lock"
FAULTS_ENV = "KVGUARD_FAULTS"
TRANSFER_KEY_ENV = "KVGUARD_TRANSFER_KEY"
HEALTH_TIMEOUT_S = 2.0
SPLITTER_START_S = 120.0  # a python start on a loaded 2-core machine: seconds, rarely more
STOP_TIMEOUT_S = 10.0
# The kvguard engine loads unquantized checkpoints; these formats are a dtype it can load into.


class LocalBackendError(Exception):
    """A spec the local backend cannot run, or a state folder it cannot use; names the field."""


class FrontDoorDown(LocalBackendError):
    """The model's URL cannot be served now (its splitter's port taken, or the splitter not
    starting): not the spec's fault, so not bad input (`kvguard apply` exits 1, `not serving:`)."""


class UnreadableState(LocalBackendError):
    """state.json is not a state kvguard wrote, or no longer parses (truncated, edited)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}; {AFRESH}")
        self.reason = reason  # without the advice


# --- the state folder -----------------------------------------------------------------------------


class _StateModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LocalWorker(_StateModel):
    """One process of a revision."""

    name: str
    """prefill-0, decode-1, router."""
    role: str
    port: int
    """The router's public API, or a prefill/decode worker's internal control API."""
    metrics_port: int
    """Read-only /metrics and /health."""
    argv: list[str]
    transfer_port: int | None = None
    """Decode's KV-transfer port (kept when the revision is resized)."""
    pid: int | None = None
    restarts: int = 0
    started_at: float | None = None
    """Wall-clock time of its last start (None: adopted, or recorded by an older version)."""
    started_argv: list[str] | None = None
    """The command line of its last start: another one is another pod, with no back-off to inherit."""
    deaths_in_a_row: int = 0
    """Deaths within `RestartBackoff.reset_after_s` of starting, in a row (CrashLoopBackOff)."""
    restart_at: float | None = None
    """Set while it is dead and waiting out its back-off: when it starts again."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


class LocalRevision(_StateModel):
    """A revision's workloads: what `kubectl get deploy -l revision=...` shows on a cluster."""

    revision: str
    model_dir: str
    faults: str = ""
    """KVGUARD_FAULTS of this revision's processes (test/demo only; empty = none)."""
    scale: Scale = "full"
    """canary (replicas capped while verified) or full."""
    scaled_to_zero: bool = False
    created_at: str
    workers: list[LocalWorker] = Field(default_factory=list)
    context_length: int | None = None
    min_kv_ratio: float | None = None
    page_size: int = 1
    """The revision's own pool requirement (spec.contextLength, spec.minKVRatio, spec.pageSize when
    it was created): its workers are judged by it, as a pod by its annotations (local_gate.py). None
    (page size 1) in folders written before it was recorded."""
    retiring: list[LocalWorker] = Field(default_factory=list)
    """After a resize: the router the split still names and the workers only it relays to. They
    serve until the new router is ready, then drain and stop (`LocalBackend._hand_over`), as a
    rolling update's old pods do after the new ones are ready."""
    handed_over: bool = False
    """The split names the new router; what `retiring` holds is being stopped."""

    def requirement(self) -> PoolRequirement | None:
        if self.context_length is None or self.min_kv_ratio is None:
            return None
        return PoolRequirement(self.min_kv_ratio, self.context_length, self.page_size)

    def worker(self, name: str) -> LocalWorker:
        return next(w for w in self.workers if w.name == name)

    @property
    def router(self) -> LocalWorker:
        return self.worker("router")

    @property
    def front(self) -> LocalWorker:
        """The router that takes this revision's traffic: the retiring one until the hand-over."""
        retiring = next((w for w in self.retiring if w.role == "router"), None)
        return retiring if retiring is not None and not self.handed_over else self.router

    @property
    def api_base(self) -> str:
        return f"{self.front.url}/v1"

    def processes(self) -> list[LocalWorker]:
        return [*self.workers, *self.retiring]

    def engine_workers(self) -> list[LocalWorker]:
        return [w for w in self.workers if w.role in ("prefill", "decode")]


class LocalState(_StateModel):
    """Everything the local backend and its driver remember between runs."""

    version: int = 2  # 2: every worker records its metrics port
    model: str | None = None
    """metadata.name of the InferenceModel this folder holds (one model per folder)."""
    namespace: str | None = None
    """Its metadata.namespace (None in folders written before it was recorded: `default`)."""

    @property
    def held(self) -> str | None:
        """`namespace/name` of the model this folder holds; None while it holds none."""
        return None if self.model is None else f"{self.namespace or 'default'}/{self.model}"
    revisions: dict[str, LocalRevision] = Field(default_factory=dict)
    serving: str | None = None
    """The revision user traffic goes to (the model Service's selector on Kubernetes)."""
    status: dict = Field(default_factory=dict)
    """The InferenceModel's status as the driver (`driver.run_pass`) wrote it, as the operator
    writes it on a cluster: stable revision, rollout status, conditions, history."""
    status_version: int = 0
    """Bumped on every status write: the state folder's resourceVersion."""
    uid: str = Field(default_factory=lambda: f"local-{secrets.token_hex(8)}")
    """The model's uid here (on a cluster the API server assigns one)."""
    generation: int = 0
    """metadata.generation: bumped when the applied spec differs from the last one, as the API
    server bumps it when a spec changes."""
    spec: dict = Field(default_factory=dict)
    """The spec last applied (what `generation` counts changes of)."""
    splitter: LocalWorker | None = None
    """The weighted splitter in front of every revision's router: its port is the model's one URL,
    chosen when the folder first serves and kept for its life (a restart takes the same port)."""
    weights: dict[str, int] = Field(default_factory=dict)
    """revision -> percent of user traffic: what split.json says (the HTTPRoute's backendRefs)."""


class StateStore:
    """state.json read and written atomically (write, fsync, rename) under an exclusive lock."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock_fd: int | None = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[StateStore]:
        """Hold the folder's lock: two drivers must never act on the same revisions at once."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o600)
        except OSError as exc:  # a file in the way, a read-only or missing parent: bad input, one line
            raise LocalBackendError(f"{self.root}: cannot use it as a state folder ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LocalBackendError(f"{self.root}: another kvguard apply is driving this state folder") from None
        self._lock_fd = fd
        try:
            yield self
        finally:
            self._lock_fd = None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def load(self) -> LocalState:
        path = self.root / STATE_FILE
        if not path.exists():
            if running := ProcessTable.logging_into(self.root):
                # Read as empty, the next apply started a second deployment beside these, and
                # --delete then stopped only the new one (outside probe).
                raise UnreadableState(f"{path}: missing, though {len(running)} kvguard process(es) log into the folder")
            return LocalState()
        try:
            state = LocalState.model_validate_json(path.read_text())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "the file"
            more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
            raise UnreadableState(f"{path}: unreadable state ({where}: {first['msg']}{more})") from None
        except (ValueError, OSError) as exc:
            raise UnreadableState(f"{path}: unreadable state ({exc})") from None
        # Every state kvguard writes names all its fields; read as empty, `{}` or `{"version": 2}`
        # leaked a deployment (the next apply started a second one beside its processes).
        if missing := [name for name in ("version", "uid") if name not in state.model_fields_set]:
            raise UnreadableState(f"{path}: unreadable state (no {missing[0]}: not written by kvguard)")
        return state

    def save(self, state: LocalState) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{STATE_FILE}.tmp"
        with open(tmp, "w") as fh:
            fh.write(state.model_dump_json(indent=2))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.root / STATE_FILE)

    def revision_dir(self, revision: str) -> Path:
        path = self.root / "revisions" / revision
        path.mkdir(parents=True, exist_ok=True)
        return path

    def transfer_key(self, revision: str) -> str:
        """The revision's HMAC key: generated once, kept 0600, reused when a worker restarts (S3)."""
        path = self.revision_dir(revision) / "transfer.key"
        if not path.exists():
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32))
        return path.read_text().strip()


# --- what runs: pure ------------------------------------------------------------------------------


def model_dir_for(spec: InferenceModelSpec, models_root: Path) -> Path:
    """The local folder standing in for the model's volume: `models_root / spec.model.source.pvc.path`.

    An absolute `pvc.path` is used as is (pathlib joins that way); `claimName` names nothing locally.
    """
    source = spec.model.source
    if source is None or source.pvc is None:
        raise LocalBackendError(
            "spec.model.source.pvc: the local backend loads weights from a folder; pass it with --model-dir DIR, "
            "or set pvc.path to it (relative to --models-root, or absolute)"
        )
    return models_root / source.pvc.path


MAX_LOCAL_WORKERS = 64
"""The most prefill and decode worker processes one revision may have here (replicas x dataParallel
of both roles, at full scale; the router is one more). Each is a Python process of its own with
torch, the model's weights and its KV pool (hundreds of MB even for the tiny model) and binds up to
three loopback ports, all on one machine: 64 is far above what the local backend is for (the demo
runs two) and keeps the ports to a few hundred. A cluster takes the spec as it is (replicas x
dataParallel within int32): an outside probe's dataParallel 65536, fine there, made the local backend
try to bind ~196k ports, then fail with exit 1 naming no field."""


def runnable_problems(spec: InferenceModelSpec) -> list[str]:
    """Field-level reasons this spec cannot run as local processes (empty: it can)."""
    if spec.engine.kind != EngineKind.KVGUARD:
        return [f"spec.engine.kind: the local backend runs the kvguard engine only, not {spec.engine.kind.value}"]
    # what the kvguard engine runs, on a cluster or here, and the canary numbers admission refuses
    # (an outside review: a canary that fails every revision reached Stable locally)
    return engine_problems(spec) + canary_problems(spec) + _size_problems(spec)


def _size_problems(spec: InferenceModelSpec) -> list[str]:
    """More worker processes than MAX_LOCAL_WORKERS, named by the largest role's field."""
    counts = {role: instances(spec, role) for role in ("prefill", "decode")}
    total = sum(counts.values())
    if total <= MAX_LOCAL_WORKERS:
        return []
    role = max(counts, key=lambda name: counts[name])
    shape = spec.roles.worker_roles()[role]
    field = "dataParallel" if shape.data_parallel > 1 else "replicas"
    other = "decode" if role == "prefill" else "prefill"
    return [f"spec.roles.{role}.{field}: {shape.replicas:,} replicas x dataParallel {shape.data_parallel:,} = "
            f"{counts[role]:,} {role} worker processes ({total:,} with {other}'s); the local backend starts at most "
            f"{MAX_LOCAL_WORKERS} in all (each loads the model and binds its own loopback ports on this machine): "
            "lower it, or deploy the spec to a cluster"]


def instances(spec: InferenceModelSpec, role: str, scale: Scale = "full") -> int:
    """Engine instances of a worker role: replicas x dataParallel (each its own process and pool)."""
    return spec.replicas_at(role, scale) * spec.roles.worker_roles()[role].data_parallel


def worker_argvs(
    spec: InferenceModelSpec,
    kv_plan: KVPlan,
    model_dir: Path,
    ports: Mapping[str, WorkerPorts],
    scale: Scale = "full",
    revision: str | None = None,
) -> list[LocalWorker]:
    """The command line of every process of a revision (mirrors the Kubernetes kvguard adapter)."""
    base = [sys.executable, "-P", "-m", "kvguard", "worker"]
    common: dict[str, Any] = {"model": model_dir, "model_name": spec.model.name, "context_length": spec.context_length}
    dtype = kvguard_dtype_flag(spec)
    workers: list[LocalWorker] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role in ("prefill", "decode"):
        for i in range(instances(spec, role, scale)):
            name = f"{role}-{i}"
            port, metrics_port, transfer_port = ports[name]
            args = WorkerArgs(
                **common, role=role, port=port, metrics_port=metrics_port,
                kv_pool_tokens=kv_plan.roles[role].pool_tokens, page_size=spec.page_size,
                device=spec.hardware.device.value, dtype=dtype,
                max_transfer_batch=spec.kv_transfer.max_batch, transfer_timeout=spec.kv_transfer.timeout_seconds,
                transfer_encryption=spec.kv_transfer.encryption,
                transfer_port=transfer_port if role == "decode" else None,
                **kvguard_role_options(spec, role),
            )  # fmt: skip
            argv = base + args.to_argv() + list(spec.engine.extra_args)
            workers.append(LocalWorker(name=name, role=role, port=port, metrics_port=metrics_port, argv=argv,
                                       transfer_port=transfer_port if role == "decode" else None))  # fmt: skip
            urls[role].append(f"http://127.0.0.1:{port}")
    port, metrics_port, _ = ports["router"]
    # The router keeps a worker whose reported pool is below the ratio out of rotation (S7 while it
    # serves): here, where no Service and no readiness gate stand between it and its workers.
    router = WorkerArgs(model=model_dir, model_name=spec.model.name, role="router", port=port, metrics_port=metrics_port,
                        prefill=tuple(urls["prefill"]), decode=tuple(urls["decode"]), min_kv_ratio=spec.min_kv_ratio,
                        revision_id=revision)  # fmt: skip
    workers.append(LocalWorker(name="router", role="router", port=port, metrics_port=metrics_port, argv=base + router.to_argv()))
    return workers


WorkerPorts = tuple[int, int, int | None]
"""A process's (main, metrics, transfer) ports; transfer only for decode."""


class HeldPorts:
    """Ports this driver chose for processes it has not started yet, each held by a bound socket
    until the process it is for starts with that socket as an inherited descriptor
    (`INHERITED_LISTENERS_ENV`). A port let go of between the choice and the worker's own bind can
    be taken in that gap: by another choice of port 0 (the splitter's, made while the workers
    start) or as an outgoing connection's ephemeral port, which keeps a listener off it even with
    SO_REUSEADDR for as long as the connection or its TIME_WAIT lasts (a router restarted in
    CrashLoopBackOff on "Address already in use" for a whole rollout)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._held: dict[int, socket.socket] = {}

    def new(self) -> int:
        """A free port, held until `take` hands it to a process."""
        sock = reserve_port(self.host, 0)
        port = int(sock.getsockname()[1])
        self._held[port] = sock
        return port

    def take(self, ports: Sequence[int]) -> dict[int, socket.socket]:
        """A bound socket for each port, which the caller closes once the process has it: the one
        held since the port was chosen, else bound now (a restart on the recorded port). A port
        that cannot be bound now is left out: the process fails to listen and says so in its log."""
        sockets: dict[int, socket.socket] = {}
        for port in ports:
            held = self._held.pop(port, None)
            if held is None:
                try:
                    held = reserve_port(self.host, port)
                except OSError as exc:
                    log.warning("port %d is taken (%s); the process will fail to listen on it", port, exc.strerror or exc)
                    continue
            sockets[port] = held
        return sockets

    def close(self) -> None:
        for sock in self._held.values():
            sock.close()
        self._held.clear()


def allocate_ports(names: list[str], held: HeldPorts, old: Mapping[str, LocalWorker] | None = None) -> dict[str, WorkerPorts]:
    """Ports for every process: a worker that keeps running keeps its own (a resize, like a
    Deployment's scale, leaves running pods alone); every new one is chosen by `held` and stays
    bound until its process starts, so no two processes (of this revision or another, or the
    splitter) are ever given one port."""
    ports: dict[str, WorkerPorts] = {}
    for name in names:
        kept = (old or {}).get(name)
        if kept is not None:
            ports[name] = (kept.port, kept.metrics_port, kept.transfer_port or (held.new() if name.startswith("decode") else None))
        else:
            ports[name] = (held.new(), held.new(), held.new() if name.startswith("decode") else None)
    return ports


def worker_names(spec: InferenceModelSpec, scale: Scale = "full") -> list[str]:
    return [f"{role}-{i}" for role in ("prefill", "decode") for i in range(instances(spec, role, scale))] + ["router"]


# --- processes ------------------------------------------------------------------------------------


class ProcessTable:
    """Starts, finds and stops worker processes by recorded PID (never by name).

    A PID counts as our worker only while /proc/<pid>/cmdline is the recorded argv, so a PID that
    the OS reused for something else is never signalled. Children this process started are reaped
    through their Popen, so a dead one is not mistaken for a live zombie.
    """

    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, worker: LocalWorker, env: Mapping[str, str], log_path: Path,
              listeners: Mapping[int, socket.socket] | None = None) -> int:
        """Start the worker; `listeners` ({port: bound socket}) are handed down for it to listen on."""
        env = {k: v for k, v in env.items() if k != INHERITED_LISTENERS_ENV}
        if listeners:
            env[INHERITED_LISTENERS_ENV] = ",".join(f"{port}:{sock.fileno()}" for port, sock in listeners.items())
        with open(log_path, "ab") as out:
            popen = subprocess.Popen(  # noqa: S603 - our own argv
                worker.argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                pass_fds=tuple(sock.fileno() for sock in (listeners or {}).values()),
                cwd=log_path.parent,  # with -P: the repo's operator/ folder never shadows the stdlib
                start_new_session=True,  # Ctrl-C on the driver must not take a serving revision down
            )  # fmt: skip
        self._children[popen.pid] = popen
        return popen.pid

    def alive(self, worker: LocalWorker) -> bool:
        pid = worker.pid
        if pid is None:
            return False
        child = self._children.get(pid)
        if child is not None:
            return child.poll() is None
        cmdline = Path(f"/proc/{pid}/cmdline")
        if cmdline.parent.parent.exists():  # Linux: compare the command line, not just the PID
            try:
                return cmdline.read_bytes().split(b"\0")[:-1] == [a.encode() for a in worker.argv]
            except OSError:
                return False
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True

    @staticmethod
    def logging_into(folder: Path) -> list[int]:
        """PIDs of the live kvguard workers and splitters whose stdout is a file in `folder`: every
        one a state folder started logs there, so they are found even when state.json is
        unreadable (`kvguard apply --delete`). Nothing else, whatever logs there (a mistyped
        --state-dir is someone's folder: outside probe). Empty off Linux."""
        root, found = folder.resolve(), []
        for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if Path(os.readlink(entry / "fd" / "1")).is_relative_to(root) and _started_here((entry / "cmdline").read_bytes()):
                        found.append(int(entry.name))
        return found

    def find(self, worker: LocalWorker) -> int | None:
        """A live process running exactly the worker's recorded command line (its ports make it
        unique), whatever PID was recorded: a driver killed between starting a worker and saving
        its PID leaves one behind, holding the worker's ports. None off Linux or when none runs."""
        wanted = b"\0".join(a.encode() for a in worker.argv) + b"\0"
        proc = Path("/proc")
        if not proc.is_dir():
            return None
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if (entry / "cmdline").read_bytes() == wanted:
                    return int(entry.name)
            except OSError:
                continue
        return None

    def stop(self, workers: list[LocalWorker], timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop a revision's processes as a retiring pod is stopped, router first: SIGTERM, which
        lets each finish the requests it holds (servers.Drain), then SIGKILL for stragglers. The
        router goes first and alone, so the requests it finishes still have their prefill and
        decode; those then hold nothing and stop at once."""
        routers = [w for w in workers if w.role == "router"]
        router_wait = DEFAULT_DRAIN_TIMEOUT_S + SHUTDOWN_GRACE_S + timeout_s  # the router's drain, then its shutdown
        for group, wait_s in ((routers, router_wait), ([w for w in workers if w not in routers], timeout_s)):
            live = [w for w in group if self.alive(w)]
            for worker in live:
                self._signal(worker, signal.SIGTERM)
            deadline = time.monotonic() + wait_s
            for worker in live:
                while self.alive(worker) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.alive(worker):
                    self._signal(worker, signal.SIGKILL)
                    self._wait(worker, 5.0)
        for worker in workers:
            self._reap(worker)
            worker.pid = None

    def _signal(self, worker: LocalWorker, signum: int) -> None:
        assert worker.pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signum)

    def _wait(self, worker: LocalWorker, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _reap(self, worker: LocalWorker) -> None:
        child = self._children.pop(worker.pid, None) if worker.pid is not None else None
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=1.0)


def _accepts(port: int, timeout_s: float, alive: Callable[[], bool]) -> bool:
    """Whether 127.0.0.1:port accepts a connection within timeout_s (False at once if the process died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
        time.sleep(0.05)
    return False


def _answers_as_splitter(port: int) -> bool:
    """Whether 127.0.0.1:port answers /health as `kvguard splitter` does (200 or 503, with its weights)."""
    try:
        answer = requests.get(f"http://127.0.0.1:{port}/health", timeout=HEALTH_TIMEOUT_S, allow_redirects=False)
        return answer.status_code in (200, 503) and "weights" in answer.json()
    except (requests.RequestException, ValueError, TypeError):
        return False


def _port_taken(port: int) -> str | None:
    """Why this driver cannot bind 127.0.0.1:port (another process holds it), or None."""
    try:
        reserve_port("127.0.0.1", port).close()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def healthy(worker: LocalWorker) -> bool:
    try:
        return requests.get(worker.metrics_url.removesuffix("/metrics") + "/health", timeout=HEALTH_TIMEOUT_S, allow_redirects=False).status_code == 200
    except requests.RequestException:
        return False


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def worker_env(base: Mapping[str, str], transfer_key: str, faults: str) -> dict[str, str]:
    """The environment of a revision's processes: the revision's key, and ITS faults only."""
    env = {k: v for k, v in base.items() if k not in (FAULTS_ENV, TRANSFER_KEY_ENV)}
    env[TRANSFER_KEY_ENV] = transfer_key
    if faults:
        env[FAULTS_ENV] = faults
    return env


# --- the backend ----------------------------------------------------------------------------------


class LocalBackend:
    """Runs revisions as local processes and reports what is ready and where (state in a folder).

    Call `open()` (or use it as a context manager) to take the folder's lock and load the state;
    every change is written back at once, so a driver killed at any point leaves a folder the
    next one can resume from.
    """

    def __init__(self, state_dir: Path, models_root: Path = Path("."), environ: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.time, backoff: RestartBackoff = KUBELET) -> None:  # fmt: skip
        """`clock`: wall time (the state folder outlives drivers); `backoff`: when a dead worker restarts."""
        self.store = StateStore(state_dir)
        self.models_root = models_root
        self.environ = dict(os.environ if environ is None else environ)
        self.clock = clock
        self.backoff = backoff
        self.processes = ProcessTable()
        self.ports = HeldPorts()  # chosen and not yet handed to a process
        self.state = LocalState()
        self._lock: contextlib.ExitStack | None = None

    # --- lifecycle ---------------------------------------------------------------------------------
    def open(self) -> LocalBackend:
        stack = contextlib.ExitStack()
        stack.enter_context(self.store.locked())
        try:
            self.state = self.store.load()
        except BaseException:
            stack.close()  # the lock too: an unreadable folder is not left locked by this process
            raise
        self._lock = stack
        return self

    def close(self) -> None:
        self.ports.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> LocalBackend:
        return self.open()

    def __exit__(self, *_: object) -> None:
        self.close()

    def save(self) -> None:
        self.store.save(self.state)

    def claim(self, model: str, namespace: str = "default") -> None:
        """One model per folder: refuse to drive another model's revisions, a model of the same
        name in another namespace included (on a cluster they are two InferenceModels)."""
        if self.state.held not in (None, f"{namespace}/{model}"):
            raise LocalBackendError(f"{self.store.root} holds InferenceModel {self.state.held!r}, not "
                                    f"{namespace + '/' + model!r}; use another --state-dir")  # fmt: skip
        self.state.model, self.state.namespace = model, namespace
        self.save()

    # --- workloads ---------------------------------------------------------------------------------
    def deploy(self, revision: str, spec: InferenceModelSpec, kv_plan: KVPlan, faults: str = "", scale: Scale = "full") -> None:
        """Create the revision's processes at `scale` if it has none, resize it to `scale` or to
        the spec's replicas at that scale (not part of the revision: changed in place), and
        (re)start any process that is not running."""
        record = self.state.revisions.get(revision)
        if record is None:
            record = self._create(revision, spec, kv_plan, faults, scale)
        elif record.scale != scale or [w.name for w in record.workers] != worker_names(spec, scale):
            self._resize(record, spec, kv_plan, scale)
        record.scaled_to_zero = False
        self._ensure_running(record)
        self._ensure_splitter()  # starts beside the workers: listening long before traffic is routed
        self.save()

    def _create(self, revision: str, spec: InferenceModelSpec, kv_plan: KVPlan, faults: str, scale: Scale) -> LocalRevision:
        problems = runnable_problems(spec)
        if problems:
            raise LocalBackendError("; ".join(problems))
        model_dir = model_dir_for(spec, self.models_root).resolve()
        if not (model_dir / "config.json").is_file():
            raise LocalBackendError(f"spec.model.source.pvc.path: {model_dir} has no config.json")
        ports = allocate_ports(worker_names(spec, scale), self.ports)
        record = LocalRevision(
            revision=revision, model_dir=str(model_dir), faults=faults, scale=scale, created_at=now_rfc3339(),
            workers=worker_argvs(spec, kv_plan, model_dir, ports, scale, revision),
            context_length=spec.context_length, min_kv_ratio=spec.min_kv_ratio, page_size=spec.page_size,
        )  # fmt: skip
        if faults:
            log.warning("FAULT INJECTION: revision %s runs with %s=%s (test/demo use only)", revision, FAULTS_ENV, faults)
        self.state.revisions[revision] = record
        self.save()
        return record

    def _resize(self, record: LocalRevision, spec: InferenceModelSpec, kv_plan: KVPlan, scale: Scale) -> None:
        """Grow or shrink a revision to `scale` (canary or full replicas, as the spec sets them now).
        Like a Deployment's scale, running workers keep their processes and ports. The router's
        worker list changes, so a new router starts on new ports beside the old one, which keeps
        the traffic (and the workers a shrink removes) until the new one is ready (`_hand_over`):
        restarted in place, it refused and 503'd requests for seconds."""
        self._finish_hand_over(record)
        old = {w.name: w for w in record.workers}
        router = old.pop("router")
        ports = allocate_ports(worker_names(spec, scale), self.ports, old)
        new = worker_argvs(spec, kv_plan, Path(record.model_dir), ports, scale, record.revision)
        for worker in new:
            previous = old.get(worker.name)
            if previous is not None and previous.argv == worker.argv:
                worker.pid, worker.restarts = previous.pid, previous.restarts
                worker.started_at, worker.deaths_in_a_row = previous.started_at, previous.deaths_in_a_row
                worker.started_argv = previous.started_argv
                worker.restart_at = previous.restart_at
                del old[worker.name]
        names = {w.name for w in new}
        restarted = [w for w in old.values() if w.name in names]  # a new command on its own ports
        removed = [w for w in old.values() if w.name not in names]
        if record.retiring:  # resized again before the hand-over: the router in between never served
            self.processes.stop([router, *restarted])
            record.retiring += removed
        else:
            self.processes.stop(restarted)
            record.retiring = [router, *removed]
        log.info("revision %s: %s scale, %d processes", record.revision, scale, len(new))
        record.workers, record.scale = new, scale
        self.save()

    def _hand_over(self, record: LocalRevision) -> None:
        """Once a resized revision's new router is ready, the split names it and the retiring
        router drains (it finishes what it holds), then the workers only it relayed to stop."""
        if not record.retiring or record.handed_over:
            self._finish_hand_over(record)
            return
        if not (self.processes.alive(record.router) and healthy(record.router)):
            return  # not ready after all: the next pass tries again
        record.handed_over = True
        self.save()
        self._finish_hand_over(record)

    def _finish_hand_over(self, record: LocalRevision) -> None:
        """Name the new router in the split, then stop what the hand-over retired: both again if a
        driver was stopped half-way through it (killed between the two, the split named a stopped
        router for good: an outside probe)."""
        if record.handed_over:
            if record.revision in self.state.weights:
                self._write_split(self.state.weights)  # `front` is the new router now
            self.processes.stop(record.retiring)
            record.retiring, record.handed_over = [], False
            self.save()

    def _ensure_running(self, record: LocalRevision) -> None:
        env = worker_env(self.environ, self.store.transfer_key(record.revision), record.faults)
        folder = self.store.revision_dir(record.revision)
        for worker in record.workers:
            self._keep_running(worker, env, folder / f"{worker.name}.log", f"revision {record.revision}")

    def _keep_running(self, worker: LocalWorker, env: Mapping[str, str], log_path: Path, owner: str) -> None:
        """Start the worker if it does not run (adopting an unrecorded one that does)."""
        if self.processes.alive(worker):
            return
        orphan = self.processes.find(worker)
        if orphan is not None:  # started by a driver killed before it could record the PID
            log.warning("%s: adopting %s (pid %s), which runs unrecorded", owner, worker.name, orphan)
            worker.pid = orphan
            self.save()
            return
        now = self.clock()
        if worker.pid is not None:  # it ran, and died
            if self._backing_off(worker, now, owner, log_path):
                return
            worker.restarts += 1
            log.warning("%s: %s (pid %s) is not running; restarting it", owner, worker.name, worker.pid)
        listeners = self.ports.take([p for p in (worker.port, worker.metrics_port, worker.transfer_port) if p is not None])
        try:
            worker.pid = self.processes.spawn(worker, env, log_path, listeners)
        finally:
            for sock in listeners.values():  # the child has its own copies
                sock.close()
        worker.started_at, worker.started_argv, worker.restart_at = now, list(worker.argv), None
        self.save()  # the PID is on disk before anything else can go wrong

    def _backing_off(self, worker: LocalWorker, now: float, owner: str, log_path: Path) -> bool:
        """True while a dead worker waits out its CrashLoopBackOff (`restart_backoff.py`). The
        death is counted once, when it is first seen; the wait is on disk, so a new driver keeps it."""
        if worker.restart_at is None:
            same_pod = worker.started_argv == worker.argv  # else: a new pod, with no back-off to inherit
            ran_for = now - worker.started_at if same_pod and worker.started_at is not None else None
            worker.deaths_in_a_row = self.backoff.streak(worker.deaths_in_a_row, ran_for)
            worker.restart_at = now + self.backoff.delay_s(worker.deaths_in_a_row)
            self.save()
            if worker.restart_at > now:
                log.warning("%s: %s died %d times in a row within %.0f s of starting; CrashLoopBackOff: "
                            "restarting it in %.0f s (log: %s)", owner, worker.name, worker.deaths_in_a_row,
                            self.backoff.reset_after_s, worker.restart_at - now, log_path)  # fmt: skip
        return now < worker.restart_at

    # --- traffic -----------------------------------------------------------------------------------
    def _ensure_splitter(self, wait: bool = False) -> LocalWorker:
        """The splitter process, created once per folder (its port is the model's URL) and
        restarted on the same ports if it died. It holds no key and runs no faults. With `wait`,
        returns once it accepts connections: a URL is printed only when it answers."""
        if self.state.splitter is None:
            (port, metrics_port, _), = allocate_ports(["splitter"], self.ports).values()
            argv = [sys.executable, "-P", "-m", "kvguard", "splitter", "--table", str((self.store.root / SPLIT_FILE).resolve()),
                    "--port", str(port), "--metrics-port", str(metrics_port)]  # fmt: skip
            self.state.splitter = LocalWorker(name="splitter", role="splitter", port=port, metrics_port=metrics_port, argv=argv)
            self.save()
        env = {k: v for k, v in self.environ.items() if k not in (FAULTS_ENV, TRANSFER_KEY_ENV)}
        splitter = self.state.splitter
        deadline = time.monotonic() + SPLITTER_START_S
        while True:
            if wait and not self.processes.alive(splitter) and (holder := _port_taken(splitter.port)):
                raise FrontDoorDown(f"port {splitter.port}, the model's URL, is taken by another process ({holder}); "
                                        "free it, then run `kvguard apply` again")  # fmt: skip
            self._keep_running(splitter, env, self.store.root / SPLITTER_LOG, "splitter")
            alive = self.processes.alive(splitter)
            if not wait:
                return splitter
            # Ours answering, not merely something accepting: a process that took the port
            # accepts too, while the splitter started into it is still dying.
            if alive and _accepts(splitter.port, max(0.0, deadline - time.monotonic()), lambda: self.processes.alive(splitter)) \
                    and _answers_as_splitter(splitter.port):
                return splitter
            if time.monotonic() >= deadline:
                break
            if not alive:  # waiting out its CrashLoopBackOff (a splitter killed twice in a row), then started again
                time.sleep(min(1.0, max(0.05, (splitter.restart_at or 0.0) - self.clock())))
        backing_off = f" (CrashLoopBackOff: died {splitter.deaths_in_a_row} times in a row)" if splitter.restart_at else ""
        raise FrontDoorDown(f"the splitter did not start listening on port {splitter.port} within "
                                f"{SPLITTER_START_S:g} s{backing_off}; see {self.store.root / SPLITTER_LOG}")  # fmt: skip

    def front_door_problem(self) -> str | None:
        """Why the model's one URL does not answer now, None when the splitter serves it. Waits
        while it starts or waits out a CrashLoopBackOff (up to SPLITTER_START_S): a URL is printed
        as serving only when something of ours listens there."""
        if self.state.serving is None:
            return None
        try:
            self._ensure_splitter(wait=True)
        except LocalBackendError as exc:
            return str(exc)
        return None

    def _write_split(self, weights: Mapping[str, int]) -> None:
        """split.json (what the splitter follows from its next request on), then state.json."""
        backends = tuple(SplitBackend(revision=r, url=self.state.revisions[r].front.url, weight=w)
                         for r, w in weights.items() if r in self.state.revisions)  # fmt: skip
        self.store.root.mkdir(parents=True, exist_ok=True)
        write_table(self.store.root / SPLIT_FILE, SplitTable(backends=backends))
        self.state.weights = {b.revision: b.weight for b in backends}
        self.save()
        self._ensure_splitter(wait=True)

    def split(self, shares: Sequence[Share]) -> None:
        """Send each revision its share of the traffic (the HTTPRoute's weights on a cluster)."""
        self._write_split({share.revision: share.weight for share in shares})

    def scale(self, revision: str, replicas: int | None) -> None:
        """0 stops every process of the revision (its record, ports and key stay for a rollback);
        None starts them again."""
        record = self.state.revisions.get(revision)
        if record is None:
            return
        if replicas == 0:
            record.scaled_to_zero = True
            self.save()
            self.processes.stop(record.processes())
            record.retiring, record.handed_over = [], False
        else:
            record.scaled_to_zero = False
            self._ensure_running(record)
        self.save()

    def delete(self, revision: str) -> None:
        record = self.state.revisions.get(revision)
        if record is None:
            return
        rest = {r: w for r, w in self.state.weights.items() if r != revision}
        if revision in self.state.weights and any(rest.values()):
            self._write_split(rest)  # the splitter stops naming it before it goes
        self.processes.stop(record.processes())
        del self.state.revisions[revision]
        if self.state.serving == revision:
            self.state.serving = None
        self.save()

    def stop_all(self) -> None:
        """Stop every process this folder records (the demo's and the tests' cleanup)."""
        if self.state.splitter is not None:
            self.processes.stop([self.state.splitter])
        for record in self.state.revisions.values():
            self.processes.stop(record.processes())
            record.retiring, record.handed_over = [], False
            record.scaled_to_zero = True
        self.save()

    def route(self, revision: str) -> None:
        """All user traffic to the revision (the model Service's selector on a cluster)."""
        if self.state.serving != revision:
            self.state.serving = revision
            self.save()
        if self.state.weights != {revision: 100} or self.state.splitter is None:
            self._write_split({revision: 100})

    def serving_url(self) -> str | None:
        """The model's one API base (…/v1): the splitter's, the same through every promotion."""
        if self.state.serving is None or self.state.splitter is None:
            return None
        return f"{self.state.splitter.url}/v1"

    # --- observation -------------------------------------------------------------------------------
    def views(self, heal: bool = True) -> dict[str, object]:
        """A `RevisionView` per recorded revision. With `heal`, a dead worker of a revision that
        should run is restarted first, as a Deployment would replace its pod."""
        from kvguard.operator.rollout import RevisionView

        views: dict[str, object] = {}
        if heal and self.state.weights:
            self._ensure_splitter()
        for revision, record in self.state.revisions.items():
            if record.scaled_to_zero:
                running = [w.name for w in record.workers if self.processes.alive(w)]
                views[revision] = RevisionView(ready=False, scaled_to_zero=not running, worker_replicas=0,
                                               waiting=tuple(f"{n} still stopping" for n in running))  # fmt: skip
                continue
            if heal:
                self._ensure_running(record)
            waiting = tuple(self._not_ready(w) for w in record.workers if not (self.processes.alive(w) and healthy(w)))
            if heal and not waiting:  # every process ready: a resized revision's new router takes over
                self._hand_over(record)
            if record.retiring:  # not settled while the old router still takes the traffic
                waiting += ("the router with the new worker list to take over",)
            views[revision] = RevisionView(
                ready=not waiting, scaled_to_zero=False, worker_replicas=len(record.engine_workers()), waiting=waiting,
                scale=record.scale,
            )  # fmt: skip
        return views

    def _not_ready(self, worker: LocalWorker) -> str:
        wait_s = worker.restart_at - self.clock() if worker.restart_at is not None else 0.0
        if wait_s > 0:
            return f"{worker.name} in CrashLoopBackOff: died {worker.deaths_in_a_row} times in a row, restarting in {wait_s:.0f} s"
        return f"{worker.name} not ready"

    def metrics_urls(self, revision: str) -> dict[str, str]:
        """worker name -> /metrics URL of every prefill and decode process of the revision."""
        record = self.state.revisions[revision]
        return {w.name: w.metrics_url for w in record.engine_workers()}

    def api_base(self, revision: str) -> str:
        return self.state.revisions[revision].api_base

    # --- the Backend interface (kvguard.operator.backends.base) -------------------------------------
    # Process starts, health checks and stops block, so they run in a worker thread; the driver
    # awaits each call before the next, so the state is never touched by two threads at once.
    async def ensure_revision(self, request: RevisionRequest, scale: Scale = "full") -> None:
        self._check_model(request.model)
        await asyncio.to_thread(self.deploy, request.revision, request.spec, request.plan, request.faults, scale)

    async def scale_revision(self, model: ModelRef, revision: str, replicas: int | None) -> None:
        self._check_model(model)
        await asyncio.to_thread(self.scale, revision, replicas)

    async def delete_revision(self, model: ModelRef, revision: str) -> None:
        self._check_model(model)
        await asyncio.to_thread(self.delete, revision)

    async def observe(self, model: ModelRef) -> Observation:
        self._check_model(model)
        views = await asyncio.to_thread(self.views)
        return Observation(revisions=views, serving=self.state.serving)  # type: ignore[arg-type]

    async def endpoints(self, model: ModelRef, revision: str) -> RevisionEndpoints:
        self._check_model(model)
        record = self.state.revisions.get(revision)
        if record is None:
            return RevisionEndpoints(router_url=None)
        # Named as their pods are on a cluster (<model>-<revision>-<worker>): same status either way.
        workers = tuple(WorkerEndpoint(f"{model.name}-{revision}-{w.name}", w.role, w.metrics_url) for w in record.engine_workers())
        front = record.front  # the router that takes its traffic (the retiring one, until a resize's hand-over)
        router = WorkerEndpoint(f"{model.name}-{revision}-{record.router.name}", "router", front.metrics_url)
        return RevisionEndpoints(router_url=front.url, workers=workers, routers=(router,))

    async def route_traffic(self, model: ModelRef, revision: str) -> None:
        self._check_model(model)
        await asyncio.to_thread(self.route, revision)

    async def split_traffic(self, request: RevisionRequest, shares: tuple[Share, ...]) -> None:
        self._check_model(request.model)
        if shares:  # none: trafficRouter service, where `route_traffic` sent it all
            await asyncio.to_thread(self.split, shares)

    async def still_foreign(self, model: ModelRef, found: Sequence[ForeignObjectError]) -> list[ForeignObjectError]:
        return []  # nothing here is created by anyone else

    def model_uid(self) -> str:
        return self.state.uid

    def _check_model(self, model: ModelRef) -> None:
        if self.state.held != f"{model.namespace}/{model.name}":
            self.claim(model.name, model.namespace)
