"""A peer engine we did not write, and a fault proxy in front of it (test and bench support; holds
no tests, and is not part of any installed package).

The peer is `transformers serve` (transformers 5.x, the `serving` extra: fastapi, uvicorn,
accelerate) on a local model folder, offline. It answers /v1/models (without max_model_len),
/v1/completions and /v1/chat/completions, streams ending with a finish chunk and usage but no
`data: [DONE]`, and has no /metrics. It also has no admission control at all: a prompt longer
than the model's context is answered with HTTP 200 and tokens (seen with transformers 5.24.0).

`FaultProxy` sits between the canary and the peer and reproduces, at the HTTP level, the bug
classes of `../shared/reference/pd-bug-classes.md`. In `healthy` mode it is the admission check a
router puts in front of an engine (prompt + max_tokens over the context length -> 400 with the
OpenAI error body, counted with the model's own tokenizer) and exports a vLLM-format
`vllm:cache_config_info` for the capacity probe (the pool size is the proxy's claim: the peer has
no paged pool to report). Every other mode breaks one thing:

| mode | bug class | what the proxy does |
|---|---|---|
| over_length_accepted | A, the incident (sglang#30233) | no admission: the peer answers an over-length request with 200 and tokens |
| spliced_content | A/G, another request's content (sglang#30233, #17259) | splices the previous request's prompt into the answer |
| stream_no_finish | H, a stream cut short | drops the finish chunk (and [DONE]) from every stream |
| abort_as_length | B, sglang#33507 | cuts every answer to half its tokens and reports finish_reason "length" |
| nondeterministic | I, output depends on what ran before | changes every other answer's text |
| pool_below_ratio | S7 | reports a KV pool of 1.5 x the context length |
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from ports import reserved_port
from tokenizers import Tokenizer

FAULT_MODES: tuple[str, ...] = (
    "healthy", "over_length_accepted", "spliced_content", "stream_no_finish",
    "abort_as_length", "nondeterministic", "pool_below_ratio",
)  # fmt: skip
HEALTHY_POOL_RATIO = 4.0
FAULTY_POOL_RATIO = 1.5
CHAT_TEMPLATE_TOKENS = 16  # upper bound of what the tiny model's chat template adds around a message


def transformers_serve_available() -> str | None:
    """Why `transformers serve` cannot run here, or None when it can."""
    try:
        from transformers.utils.import_utils import is_serve_available
    except ImportError as exc:  # pragma: no cover - transformers is a dev dependency
        return f"transformers is not installed ({exc})"
    if not is_serve_available():
        return "transformers serve needs fastapi and uvicorn (the dev extra installs them)"
    try:
        import accelerate  # noqa: F401  (transformers serve loads with a device map)
    except ImportError:
        return "transformers serve needs accelerate (the dev extra installs it)"
    return None


class PeerServer:
    """`transformers serve MODEL --device cpu` on a free loopback port, offline; stopped with SIGTERM."""

    def __init__(self, model_dir: Path, *, start_timeout: float = 180.0) -> None:
        self.model_dir = model_dir
        # Held (bound, never listening) until stop(): picking a free port and closing it before
        # uvicorn binds it is a window another process may take it in (tests/ports.py).
        self._port = contextlib.ExitStack()
        self.port = self._port.enter_context(reserved_port())
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "TRANSFORMERS_VERBOSITY": "error"}  # fmt: skip
        self.log = tempfile.NamedTemporaryFile(prefix="transformers-serve-", suffix=".log", delete=False)
        cli = Path(sys.executable).with_name("transformers")
        self.proc = subprocess.Popen(
            [str(cli), "serve", str(model_dir), "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return str(self.model_dir)  # transformers serve names the model by the path it was given

    def _wait_ready(self, timeout: float) -> None:
        """Ready once a 1-token completion answers (the weights load on the first request)."""
        import requests

        deadline = time.monotonic() + timeout
        body = {"model": self.model, "prompt": "ready", "max_tokens": 1, "temperature": 0}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if requests.post(f"{self.url}/v1/completions", json=body, timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"transformers serve did not become ready; log {self.log.name}:\n{Path(self.log.name).read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._port.close()

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class ProxyState:
    """Mutable per-proxy state: the previous prompt (for splicing) and a request counter."""

    previous_prompt: str | None = None
    requests: int = 0
    seen_modes: list[str] = field(default_factory=list)


class FaultProxy:
    """An aiohttp server on a loopback port, in its own thread, forwarding to `upstream`."""

    def __init__(self, upstream: str, model_dir: Path, context_length: int, mode: str = "healthy") -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {mode!r} (known: {', '.join(FAULT_MODES)})")
        self.upstream = upstream.rstrip("/")
        self.mode = mode
        self.context_length = context_length
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.state = ProxyState()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"fault-proxy-{mode}")
        self.port = 0

    # --- lifecycle -------------------------------------------------------------------------
    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._session = self._loop.run_until_complete(self._new_session())
        runner = web.AppRunner(self.app(), handler_cancellation=True)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.run_until_complete(self._session.close())

    @staticmethod
    async def _new_session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(60):  # a thread's server: under a second idle, far more on a loaded machine
            raise RuntimeError("fault proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    # --- routes ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self.forward_get)
        app.router.add_get("/health", self.forward_get)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def forward_get(self, request: web.Request) -> web.Response:
        async with self._session.get(self.upstream + request.path) as resp:
            return web.Response(status=resp.status, body=await resp.read(), content_type=resp.content_type)

    async def metrics(self, _request: web.Request) -> web.Response:
        ratio = FAULTY_POOL_RATIO if self.mode == "pool_below_ratio" else HEALTHY_POOL_RATIO
        return web.Response(text=vllm_cache_info(int(ratio * self.context_length)), content_type="text/plain")

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        if "messages" in body:
            text = "".join(str(m.get("content") or "") for m in body["messages"])
            return len(self.tokenizer.encode(text).ids) + CHAT_TEMPLATE_TOKENS
        return len(self.tokenizer.encode(str(body.get("prompt") or "")).ids)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["messages"][-1]["content"] if "messages" in body else str(body.get("prompt") or "")
        self.state.requests += 1
        previous, self.state.previous_prompt = self.state.previous_prompt, prompt
        if self.mode != "over_length_accepted":
            rejection = self._admission(body)
            if rejection is not None:
                return rejection
        async with self._session.post(self.upstream + request.path, json=body) as upstream:
            if upstream.status != 200:
                return web.Response(status=upstream.status, body=await upstream.read(), content_type=upstream.content_type)
            if body.get("stream"):
                return await self._stream(request, upstream, previous)
            payload = await upstream.json()
        return web.json_response(self._rewrite_body(payload, previous, int(body.get("max_tokens") or 16)))

    def _admission(self, body: dict[str, Any]) -> web.Response | None:
        """The check transformers serve lacks: prompt + max_tokens must fit the context (vLLM's wording)."""
        prompt, max_tokens = self.prompt_tokens(body), int(body.get("max_tokens") or 16)
        if prompt + max_tokens <= self.context_length:
            return None
        message = (f"This model's maximum context length is {self.context_length} tokens. However, your request has "
                   f"{prompt} input tokens and max_tokens={max_tokens}.")  # fmt: skip
        error = {"message": message, "type": "BadRequestError", "param": None, "code": "context_length_exceeded"}
        return web.json_response({"error": error}, status=400)

    # --- answer rewriting (pure per mode) -------------------------------------------------
    def _rewrite_text(self, text: str, previous: str | None) -> str:
        if self.mode == "spliced_content" and previous:
            half = len(text) // 2
            return text[:half] + previous[:48] + text[half:]
        if self.mode == "nondeterministic" and self.state.requests % 2 == 0:
            return text[::-1] + "~"
        return text

    def _rewrite_body(self, payload: dict[str, Any], previous: str | None, max_tokens: int) -> dict[str, Any]:
        for choice in payload.get("choices", []):
            key = "message" if "message" in choice else None
            text = choice["message"].get("content") or "" if key else choice.get("text") or ""
            text = self._rewrite_text(text, previous)
            if self.mode == "abort_as_length":
                usage = payload.get("usage") or {}
                kept = max(1, int(usage.get("completion_tokens") or max_tokens) // 2)
                text = text[:kept]  # the tiny model's byte-level tokens: one character each
                choice["finish_reason"] = "length"
                usage["completion_tokens"] = kept
                usage["total_tokens"] = int(usage.get("prompt_tokens") or 0) + kept
                payload["usage"] = usage
            if key:
                choice["message"]["content"] = text
            else:
                choice["text"] = text
        return payload

    async def _stream(self, request: web.Request, upstream: aiohttp.ClientResponse, previous: str | None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            async for frame in self._rewritten_frames(upstream, previous):
                await resp.write(f"data: {frame}\n\n".encode())
        except ConnectionResetError:
            pass  # the canary disconnected on purpose (abort probe); leaving closes the upstream too
        return resp

    async def _rewritten_frames(self, upstream: aiohttp.ClientResponse, previous: str | None) -> AsyncIterator[str]:
        """The upstream's SSE data frames, per mode: spliced, truncated, or without the finish chunk."""
        chunks = 0
        async for raw in upstream.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if self.mode != "stream_no_finish":
                    yield data
                continue
            frame = json.loads(data)
            finishing = any(c.get("finish_reason") for c in frame.get("choices", []))
            if finishing and self.mode == "stream_no_finish":
                return  # the stream just ends: no finish reason ever arrives
            if self.mode == "abort_as_length" and chunks >= 2 and not finishing:
                continue  # dropped tokens; the finish chunk below claims "length"
            if finishing and self.mode == "abort_as_length":
                usage = frame.get("usage") or {}
                usage["completion_tokens"] = min(chunks, 2)
                frame["usage"] = usage
                for c in frame["choices"]:
                    c["finish_reason"] = "length"
            if not finishing:
                chunks += 1
                if self.mode == "spliced_content" and chunks == 2 and previous:
                    _append_text(frame, previous[:48])
            yield json.dumps(frame)


def _append_text(frame: dict[str, Any], extra: str) -> None:
    for choice in frame.get("choices", []):
        if "delta" in choice:
            choice["delta"]["content"] = (choice["delta"].get("content") or "") + extra
        else:
            choice["text"] = (choice.get("text") or "") + extra


def vllm_cache_info(pool_tokens: int, block_size: int = 16) -> str:
    """vLLM 0.33's `vllm:cache_config_info` (CacheConfig fields as labels, one series per engine)."""
    blocks = pool_tokens // block_size
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",engine="0",'
        f'gpu_memory_utilization="0.92",num_gpu_blocks="{blocks}",enable_prefix_caching="True"}} 1.0\n'
    )


@contextlib.contextmanager
def proxied(peer: PeerServer, model_dir: Path, context_length: int, mode: str) -> Iterator[FaultProxy]:
    with FaultProxy(peer.url, model_dir, context_length, mode) as proxy:
        yield proxy
