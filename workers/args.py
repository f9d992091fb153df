"""`WorkerArgs`: the one description of a worker process's command line.

The renderer (a pod's `command`), the local backend and the launcher build a worker's argv from
this type, and `kvguard worker` parses its flags into it, so the three can never disagree on a
flag's name or meaning. Pure: pydantic only (the operator imports it; it must not pull in torch or
aiohttp).

Every worker listens on ports with one audience each (docs/threat-model.md, S9):

| listener         | router                      | prefill / decode                            |
| ---------------- | --------------------------- | ------------------------------------------- |
| `--port`         | public OpenAI API (`/v1/*`) | internal control API (`/internal/*`), only  |
|                  |                             | for this revision's router                  |
| `--metrics-port` | `/metrics`, `/health`       | `/metrics`, `/health` (read-only: scrapers, |
|                  |                             | probes)                                     |
| `--transfer-port`| --                          | decode only: KV chunks from this revision's |
|                  |                             | prefill                                     |

A listener is a TCP port (`8000`; `0` picks a free one) or `fd:N`, a socket the parent already
bound and passed down. The local launcher binds every socket itself before starting a child, so a
busy port is found at once and no other process can take a port between the check and the bind.
The local backend keeps a worker's recorded port numbers on its command line (they name the
process) and hands the sockets down by port in `KVGUARD_LISTEN_FDS` (`open_listener`).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticUndefined

from kvguard.workers.field_messages import field_message
from kvguard.workers.protocol import MAX_EVENT_TOKENS

WorkerRoleName = Literal["prefill", "decode", "router"]
TransferEncryption = Literal["none", "aes-gcm"]  # kvguard.workers.transfer.Encryption
DEFAULT_BOOTSTRAP_TIMEOUT_S = 300.0  # as SGLang's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT
DEFAULT_DRAIN_TIMEOUT_S = 15.0  # with the preStop sleep before it and the shutdown after it, inside the rendered pods' 35 s grace (servers.Drain, render.TERMINATION_GRACE_SECONDS)
DEFAULT_MAX_CONNECTIONS = 4096  # per listener: a slow-header flood is bounded in number, not only in time
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # router and splitter: a larger API request body is 413
DEFAULT_MAX_BODY_MEMORY = 256 * 1024 * 1024  # router and splitter: request bodies held at once (backpressure.BodyMemory)
DEFAULT_ABORT_TIMEOUT_S = 2.0  # router: a worker that takes longer to acknowledge an abort frees the pages by its own timers
# A local launcher (workers/launcher.py) hands each worker the read end of a pipe whose write end
# only the launcher holds, and names its descriptor here: EOF on it means the launcher is gone.
LIFELINE_FD_ENV = "KVGUARD_LIFELINE_FD"
# `PORT:FD,...`: sockets a parent bound to these ports and passed down (the local backend, which
# holds every port it chose until the process it chose it for listens on it).
INHERITED_LISTENERS_ENV = "KVGUARD_LISTEN_FDS"
LISTEN_BACKLOG = 512


@dataclass(frozen=True)
class Listen:
    """Where a listener binds: a TCP port, or a socket inherited as file descriptor `fd`."""

    port: int = 0
    fd: int | None = None

    @classmethod
    def parse(cls, value: Any) -> Listen:
        if isinstance(value, Listen):
            return value
        text = str(value).strip()
        try:
            if text.startswith("fd:"):
                fd = int(text[3:])
                if fd < 0:
                    raise ValueError
                return cls(fd=fd)
            port = int(text)
        except ValueError:
            raise ValueError(f"expected a port number or fd:N, got {text!r}") from None
        if not 0 <= port < 65536:
            raise ValueError(f"port {port} is out of range 0..65535")
        return cls(port=port)

    def __str__(self) -> str:
        return f"fd:{self.fd}" if self.fd is not None else str(self.port)

    def open(self, host: str) -> socket.socket:
        """The listening socket: adopted from the parent, or bound here."""
        if self.fd is not None:
            return adopt_listener(self.fd)
        return open_listener(host, self.port)


def reserve_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not listening yet: the port is ours (no port-0 choice
    and no outgoing connection's ephemeral port can take it) until a listener adopts it.
    SO_REUSEADDR: a restart takes its port back past the old process's TIME_WAIT connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); OSError (e.g. EADDRINUSE) if the port is taken."""
    sock = reserve_port(host, port)
    try:
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def adopt_listener(fd: int, port: int | None = None) -> socket.socket:
    """The inherited socket `fd`, listening; OSError if it is not a TCP socket (bound to `port`)."""
    sock = socket.socket(fileno=fd)
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"descriptor {fd} is not a TCP socket")
        if port is not None and sock.getsockname()[1] != port:
            raise OSError(f"descriptor {fd} is bound to port {sock.getsockname()[1]}, not {port}")
        sock.listen(LISTEN_BACKLOG)  # a no-op but for the backlog if the parent already listens
    except OSError:
        sock.detach()  # not ours to close: the descriptor stays as it came
        raise
    sock.setblocking(False)
    return sock


def inherited_listeners(environ: Mapping[str, str]) -> dict[int, int]:
    """`INHERITED_LISTENERS_ENV` as {port: fd}; OSError naming the variable if it is malformed."""
    text = environ.get(INHERITED_LISTENERS_ENV, "").strip()
    found: dict[int, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        port_text, _, fd_text = item.partition(":")
        if not (port_text.isascii() and port_text.isdigit() and fd_text.isascii() and fd_text.isdigit()):
            raise OSError(f"{INHERITED_LISTENERS_ENV}: expected PORT:FD,..., got {item[:40]!r}")
        found[int(port_text)] = int(fd_text)
    return found


def open_listener(host: str, port: int, environ: Mapping[str, str] = os.environ) -> socket.socket:
    """A listening socket on `port`: the one the parent handed down for it, if any, else bound here."""
    fd = inherited_listeners(environ).get(port) if port else None
    return bind_listener(host, port) if fd is None else adopt_listener(fd, port)


ListenSpec = Annotated[Listen, BeforeValidator(Listen.parse), PlainSerializer(str, return_type=str)]


def _flag(group: str, help_: str, **extra: Any) -> Any:
    return {"group": group, "help": help_, **extra}


_ALLOWED: dict[str, tuple[re.Pattern[str], str]] = {
    "device": (re.compile(r"auto|cpu|cuda(:[0-9]+)?"), "auto, cpu, cuda or cuda:N"),
    "dtype": (re.compile(r"auto|float32|bfloat16|float16"), "auto, float32, bfloat16 or float16"),
}
"""What --device and --dtype take, and how a refusal says it."""


class WorkerArgs(BaseModel):
    """Flags of `kvguard worker`. Field `foo_bar` is flag `--foo-bar`; lists repeat the flag."""

    # nan passed `gt=0` as "Input should be greater than 0" and inf was no limit at all: a number
    # flag is a finite number (outside probe: `kvguard serve --transfer-timeout nan`).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    role: WorkerRoleName = Field(json_schema_extra=_flag("common", "which process to run"))
    model: Path = Field(json_schema_extra=_flag("common", "Hugging Face model folder"))
    model_name: str | None = Field(None, min_length=1, max_length=256,
                                   json_schema_extra=_flag("common", "name served in the API (default: the folder name)"))  # fmt: skip
    host: str = Field("127.0.0.1", json_schema_extra=_flag("common", "address to bind (0.0.0.0 in a pod)"))
    port: ListenSpec = Field(
        Listen(), json_schema_extra=_flag("common", "router: the public OpenAI API; prefill/decode: the internal control API "
                                          "(/internal/*, router only). A port, or fd:N for an inherited socket")
    )
    metrics_port: ListenSpec = Field(
        Listen(), json_schema_extra=_flag("common", "read-only /metrics and /health (scrapers, probes). A port, or fd:N")
    )
    header_timeout: float = Field(
        30.0, gt=0, json_schema_extra=_flag("common", "seconds a connection may take to send a request's headers, and "
                                            "may sit idle between requests (slow-header clients are cut off)")
    )
    max_connections: int = Field(
        DEFAULT_MAX_CONNECTIONS, ge=1, le=1_000_000, json_schema_extra=_flag(
            "common", "open connections per listener; one more is answered 503 too_many_connections and closed. "
            "Fewer if the open-file limit less 256 (the process's own calls) cannot hold them on every listener")
    )  # fmt: skip

    drain_timeout: float = Field(
        DEFAULT_DRAIN_TIMEOUT_S, gt=0, le=3600, json_schema_extra=_flag(
            "common", "on SIGTERM, seconds to go on finishing the requests held (the router takes no new one), then "
            "stop; SIGINT stops at once. Keep it below the pod's terminationGracePeriodSeconds less its preStop sleep and ~6 s (rendered pods: 35 s, 5 s)")
    )  # fmt: skip

    # Checked here as well as where torch resolves them (workers/device.py), so a typo fails at once,
    # not after the other processes have started.
    # Its allowed values in its refusal (_known_values), not pydantic's "should match pattern '^(...)$'".
    device: str = Field("auto", json_schema_extra=_flag("prefill and decode", "auto, cpu, cuda or cuda:N"))
    dtype: str = Field("auto", json_schema_extra=_flag("prefill and decode", "auto, float32, bfloat16 or float16"))
    kv_pool_tokens: int | None = Field(None, ge=1, json_schema_extra=_flag("prefill and decode", "KV pool size; default: from memory"))
    kv_memory_fraction: float = Field(0.85, gt=0, le=1, json_schema_extra=_flag("prefill and decode", "share of device memory for weights + KV"))
    device_share: float = Field(
        1.0, gt=0, le=1, json_schema_extra=_flag("prefill and decode", "the part of the CUDA device this worker's weights + KV may "
                                                 "take when workers share one GPU (`kvguard serve`: 0.5 each); ignored on CPU")
    )
    context_length: int | None = Field(None, ge=1, json_schema_extra=_flag("prefill and decode", "served context (default: the model's maximum)"))
    page_size: int = Field(16, ge=1, json_schema_extra=_flag("prefill and decode", "tokens per KV page"))
    max_running_requests: int = Field(64, ge=1, json_schema_extra=_flag("prefill and decode", "requests holding pages at once"))
    stream_interval: int = Field(
        1, ge=1, le=MAX_EVENT_TOKENS,
        json_schema_extra=_flag("decode", "tokens per streamed event: the first token always goes at once, then one event per "
                                "N tokens, or sooner once one has waited 1 s (and the rest at the end). 1 (default): every step's token as soon as it is made; "
                                "larger trades smoothness for less per-event work in decode, router and client"),
    )  # fmt: skip

    transfer_port: ListenSpec | None = Field(None, json_schema_extra=_flag("KV transfer", "decode: the port receiving KV chunks (default: a free one)"))
    advertise_host: str | None = Field(None, json_schema_extra=_flag("KV transfer", "decode: the address prefill connects to (the pod IP)"))
    max_transfer_batch: int = Field(4 * 1024 * 1024, ge=1, json_schema_extra=_flag("KV transfer", "bytes in flight per prefill->decode pair (S6)"))
    transfer_timeout: float = Field(5.0, gt=0, json_schema_extra=_flag("KV transfer", "seconds a stalled transfer may wait (S4)"))
    bootstrap_timeout: float = Field(
        DEFAULT_BOOTSTRAP_TIMEOUT_S, gt=0, json_schema_extra=_flag(
            "KV transfer", "prefill: seconds a request may wait for its transfer ticket (decode's destination pages); "
            "decode: seconds a request's pages may wait for prefill to open its transfer (prefill queues and computes "
            "meanwhile; --transfer-timeout governs from then on). Then it is aborted and its pages freed (S4)")
    )  # fmt: skip
    transfer_encryption: TransferEncryption = Field(
        "none", json_schema_extra=_flag("KV transfer", "prefill and decode: none (HMAC + checksum) or aes-gcm (KV payloads "
                                        "encrypted per request); both roles of a revision must agree")
    )  # fmt: skip

    prefill: tuple[str, ...] = Field((), json_schema_extra=_flag("router", "a prefill worker's internal base URL (repeatable)"))
    decode: tuple[str, ...] = Field((), json_schema_extra=_flag("router", "a decode worker's internal base URL (repeatable)"))
    request_timeout: float = Field(120.0, gt=0, le=86_400, json_schema_extra=_flag(
        "router", "seconds a request may wait for its next token (its first: queueing, prefill and transfer "
        "included) before it ends with 504; a generation that keeps producing tokens runs to its end"))
    abort_timeout: float = Field(DEFAULT_ABORT_TIMEOUT_S, gt=0, le=600, json_schema_extra=_flag(
        "router", "seconds a worker may take to acknowledge an abort; the request's slots are held meanwhile "
        "(its client already has its answer)"))
    body_timeout: float = Field(30.0, gt=0, json_schema_extra=_flag("router", "seconds a request body may take to arrive (408)"))
    write_timeout: float = Field(30.0, gt=0, le=86400, json_schema_extra=_flag(
        "router", "seconds a client may read none of its answer before its connection is closed (its generation aborted)"))
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024, json_schema_extra=_flag("router", "largest request body (413)"))
    max_body_memory: int = Field(DEFAULT_MAX_BODY_MEMORY, ge=1024, json_schema_extra=_flag(
        "router", "bytes of request bodies held at once, past each body's first 64 KiB; a body that would need more is "
                  "refused with 503 and Retry-After (at least --max-body-bytes)"))  # fmt: skip
    max_inflight_choices: int = Field(512, ge=1, le=100_000, json_schema_extra=_flag(
        "router", "generations with calls open to workers at once; more wait in the router, holding no KV, "
                  "within --request-timeout (504)"))  # fmt: skip
    min_kv_ratio: float | None = Field(
        None, ge=1.0, allow_inf_nan=False,
        json_schema_extra=_flag("router", "S7 per worker: keep a worker whose reported KV pool is below this x its context out "
                                "of rotation, re-read every second (the local backend's readiness gate; default: off)"),
    )  # fmt: skip

    token_channel: Literal["on", "off"] = Field(
        "on", json_schema_extra=_flag("router", "on (default): each decode worker's tokens reach this router on one stream "
                                      "for all its requests, a write per engine step; off: a stream per request")
    )
    discovery: Literal["static", "dns"] = Field(
        "static", json_schema_extra=_flag("router", "static (default): each --prefill/--decode URL is one worker; dns: each URL's "
                                      "host is a headless Service, every address it resolves to one worker pod, read again every "
                                      "second (so a request's calls all reach the pod that holds its KV)")
    )  # fmt: skip
    revision_id: str | None = Field(
        None, min_length=1, max_length=63, pattern=r"^[a-z0-9][a-z0-9-]*$",
        json_schema_extra=_flag("router", "the revision this router serves, named in every API response's x-kvguard-revision "
                                "header (so a client behind a Gateway or splitter can tell which revision answered)"),
    )  # fmt: skip

    @field_validator("device", "dtype")
    @classmethod
    def _known_values(cls, value: str, info: ValidationInfo) -> str:
        allowed, words = _ALLOWED[str(info.field_name)]
        if not allowed.fullmatch(value):
            raise ValueError(f"must be {words}, got {value[:40]!r}")
        return value

    @model_validator(mode="after")
    def _fits_the_role(self) -> WorkerArgs:
        if self.role == "router" and (not self.prefill or not self.decode):
            raise ValueError("the router needs at least one --prefill and one --decode URL")
        if self.role != "router" and (self.prefill or self.decode):
            raise ValueError("--prefill/--decode are router flags")
        if self.role != "decode" and self.transfer_port is not None:
            raise ValueError("--transfer-port is a decode flag")
        if self.role == "router" and self.max_body_memory < self.max_body_bytes:
            raise ValueError(f"--max-body-memory ({self.max_body_memory}) must be at least --max-body-bytes ({self.max_body_bytes})")
        if self.role != "router" and self.min_kv_ratio is not None:
            raise ValueError("--min-kv-ratio is a router flag")
        if self.role == "router" and self.bootstrap_timeout != DEFAULT_BOOTSTRAP_TIMEOUT_S:
            raise ValueError("--bootstrap-timeout is a prefill and decode flag")
        if self.role != "decode" and self.stream_interval != 1:
            raise ValueError("--stream-interval is a decode flag")
        if self.role != "router" and self.abort_timeout != DEFAULT_ABORT_TIMEOUT_S:
            raise ValueError("--abort-timeout is a router flag")
        if self.role != "router" and self.token_channel != "on":
            raise ValueError("--token-channel is a router flag")
        if self.role != "router" and self.discovery != "static":
            raise ValueError("--discovery is a router flag")
        if self.role != "router" and self.revision_id is not None:
            raise ValueError("--revision-id is a router flag")
        if self.role == "router" and self.transfer_encryption != "none":
            raise ValueError("--transfer-encryption is a prefill and decode flag")
        return self

    def served_model_name(self) -> str:
        """The name the API serves: --model-name, else the model folder's own name (resolved, so
        `--model .` serves the folder's name, not an empty one)."""
        return self.model_name or self.model.resolve().name

    def to_argv(self) -> list[str]:
        """The flags that reproduce this value, for `kvguard worker`. Defaults are left out, except
        for an engine worker the numbers the KV plan rests on (page size, device, dtype): those are
        always stated, so a command line says what it runs even if a default changes."""
        argv: list[str] = []
        explicit = _PLANNED_FIELDS if self.role != "router" else set()
        stated = self.model_dump(exclude_defaults=True, exclude_none=True)
        values = {name: value for name, value in self.model_dump(exclude_none=True).items() if name in stated or name in explicit}
        for name, value in values.items():
            flag = "--" + name.replace("_", "-")
            for item in value if isinstance(value, tuple | list) else (value,):
                argv += [flag, str(item)]
        return argv


_PLANNED_FIELDS = {"page_size", "device", "dtype"}


def worker_default(name: str) -> Any:
    """WorkerArgs' default for field `name`: the one the router's config, the local launcher and
    `kvguard serve`'s flags take too (review: they repeated the values, free to drift)."""
    default = WorkerArgs.model_fields[name].default
    assert default is not PydanticUndefined, f"{name} has no default"
    return default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every WorkerArgs field as a flag, grouped as the fields say."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, info in WorkerArgs.model_fields.items():
        extra = info.json_schema_extra
        assert isinstance(extra, dict)
        group_name = str(extra["group"])
        group = groups.get(group_name) or groups.setdefault(
            group_name, parser if group_name == "common" else parser.add_argument_group(group_name)  # type: ignore[arg-type]
        )
        flag = "--" + name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": name, "help": _with_default(str(extra["help"]), info.default), "default": None}
        if name == "role":
            kwargs["choices"] = ("prefill", "decode", "router")
        if info.is_required():
            kwargs["required"] = True
        if name in ("prefill", "decode"):
            kwargs["action"] = "append"
        group.add_argument(flag, **kwargs)


def _with_default(help_: str, default: Any) -> str:
    """The help with the field's default, unless it says it or there is none to say (the real
    defaults live on WorkerArgs: the parser's are None, so a flag not given is not set)."""
    if "default" in help_ or default in (None, ()) or isinstance(default, Listen) or default is PydanticUndefined:
        return help_
    if isinstance(default, float) and default.is_integer():
        default = int(default)
    return f"{help_} (default: {default})"


def flag_errors(exc: ValidationError) -> list[str]:
    """`--flag: why` for each error of a WorkerArgs validation (field `foo_bar` is `--foo-bar`)."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        field = WorkerArgs.model_fields.get(where)
        if error["type"] == "finite_number" and field is not None and (bounds := _bounds(field.metadata)):
            message = f"must be a finite number {bounds}, got {error['input']}"  # `nan`: as the range says, not just "finite"
        else:
            message = field_message(error)
        lines.append(f"{'--' + where.replace('_', '-') + ': ' if where else ''}{message}")
    return lines


def _bounds(metadata: Sequence[Any]) -> str:
    """A field's range as `> 0 and <= 3600` (its annotated_types constraints), or ""."""
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    return " and ".join(f"{sign} {getattr(m, name):g}" for m in metadata for name, sign in signs.items()
                        if getattr(m, name, None) is not None)  # fmt: skip


def from_namespace(namespace: argparse.Namespace) -> WorkerArgs:
    """Validate parsed flags (ValueError with the field's message on a bad one)."""
    values = {name: getattr(namespace, name) for name in WorkerArgs.model_fields if getattr(namespace, name, None) is not None}
    return WorkerArgs.model_validate(values)


def parse_argv(argv: Sequence[str]) -> WorkerArgs:
    """`kvguard worker` flags -> WorkerArgs (tests; the inverse of `WorkerArgs.to_argv`)."""
    parser = argparse.ArgumentParser(prog="kvguard worker")
    add_arguments(parser)
    return from_namespace(parser.parse_args(list(argv)))
