"""Start a router, a prefill and a decode worker as local processes on loopback, and stop them.

Used by `kvguard serve`, by tests, and by the operator's local backend. Each worker is a real
`python -m kvguard worker ...` process; a worker that dies is restarted on the same ports (the way
a Deployment would replace a pod), so the deployment heals while the requests it held get clean
errors (S4).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

log = logging.getLogger("kvguard.launcher")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class LocalServeConfig:
    model_dir: Path
    port: int = 0  # router port; 0 picks a free one
    kv_pool_tokens: int | None = None
    context_length: int | None = None
    page_size: int = 16
    device: str = "auto"  # CUDA when present (kvguard.workers.device decides)
    max_transfer_batch: int = 4 * 1024 * 1024
    transfer_timeout_s: float = 5.0
    extra_env: tuple[tuple[str, str], ...] = ()  # e.g. (("KVGUARD_FAULTS", "no_tags"),)
    log_dir: Path | None = None  # worker logs go here; None: inherit stderr


@dataclass
class _Process:
    name: str
    argv: list[str]
    port: int
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0


@dataclass
class LocalDeployment:
    """A running router + prefill + decode trio. Use as a context manager or call start/stop."""

    config: LocalServeConfig
    processes: dict[str, _Process] = field(default_factory=dict)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None

    def __post_init__(self) -> None:
        c = self.config
        ports = {"prefill": free_port(), "decode": free_port(), "router": c.port or free_port()}
        transfer_port = free_port()
        common = ["--model", str(c.model_dir), "--device", c.device, "--page-size", str(c.page_size)]
        if c.kv_pool_tokens is not None:
            common += ["--kv-pool-tokens", str(c.kv_pool_tokens)]
        if c.context_length is not None:
            common += ["--context-length", str(c.context_length)]
        transfer = ["--max-transfer-batch", str(c.max_transfer_batch), "--transfer-timeout", str(c.transfer_timeout_s)]
        # -P: the working directory may hold this repo, whose operator/ folder would shadow the
        # standard library's `operator` module.
        worker = [sys.executable, "-P", "-m", "kvguard", "worker"]
        self.processes = {
            "prefill": _Process("prefill", worker + ["--role", "prefill", "--port", str(ports["prefill"])] + common + transfer, ports["prefill"]),
            "decode": _Process(
                "decode",
                worker + ["--role", "decode", "--port", str(ports["decode"]), "--transfer-port", str(transfer_port)] + common + transfer,
                ports["decode"],
            ),
            "router": _Process(
                "router",
                worker
                + ["--role", "router", "--port", str(ports["router"]), "--model", str(c.model_dir)]
                + ["--prefill", self.url(ports["prefill"]), "--decode", self.url(ports["decode"])],
                ports["router"],
            ),
        }
        self._env = {**os.environ, "KVGUARD_TRANSFER_KEY": secrets.token_hex(32), **dict(c.extra_env)}

    @staticmethod
    def url(port: int) -> str:
        return f"http://127.0.0.1:{port}"

    @property
    def router_url(self) -> str:
        return self.url(self.processes["router"].port)

    @property
    def api_base(self) -> str:
        return f"{self.router_url}/v1"

    @property
    def metrics_urls(self) -> dict[str, str]:
        return {name: f"{self.url(p.port)}/metrics" for name, p in self.processes.items()}

    def start(self, ready_timeout_s: float = 120.0) -> LocalDeployment:
        for name in ("prefill", "decode", "router"):
            self._spawn(self.processes[name])
        try:
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="kvguard-launcher-watch", daemon=True)
        self._watcher.start()
        return self

    def _spawn(self, process: _Process) -> None:
        stdout: int | object = subprocess.DEVNULL
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            stdout = open(self.config.log_dir / f"{process.name}.log", "ab")  # noqa: SIM115 - owned by the child
        process.popen = subprocess.Popen(
            process.argv,
            env=self._env,
            stdout=stdout if self.config.log_dir else None,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT if self.config.log_dir else None,
            start_new_session=True,  # a Ctrl-C in the terminal reaches serve, which stops us in order
        )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for name in ("prefill", "decode", "router"):
            process = self.processes[name]
            while True:
                assert process.popen is not None
                if process.popen.poll() is not None:
                    raise RuntimeError(f"{name} worker exited with status {process.popen.returncode} during start-up")
                try:
                    if requests.get(f"{self.url(process.port)}/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} worker not healthy after {timeout_s:.0f} s")
                time.sleep(0.1)

    def _watch(self) -> None:
        """Restart a worker that died, on the same port, like a Deployment replacing its pod."""
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
        self._stopping.set()
        for name in ("router", "prefill", "decode"):
            popen = self.processes[name].popen
            if popen is not None and popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            if process.popen is None:
                continue
            try:
                process.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
