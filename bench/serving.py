"""Serving speed on a realistic workload: kvguard in-process and over HTTP against what a user would
run instead, all in one run.

Backends, each fed the same seeded requests (greedy, EOS ignored so every request produces exactly
its drawn number of tokens):
  (a) hf        Hugging Face `generate()` in static batches of 16 (1 for the single-request case),
                left-padded, as a user would run it offline -- the baseline every ratio is against;
  (b) tfserve   `transformers serve` (its default, no continuous batching) over HTTP;
  (c) engine    kvguard's `Engine` in this process, driven by one loop that submits requests as
                they arrive and steps the engine;
  (d) http      `kvguard serve` (router + prefill + decode processes) over HTTP, every token its
                own streamed event (the default, and what the headline ratios measure);
  (e) http-si   the same with `--stream-interval N` (default 8): the first token at once, then one
                event per N tokens. Fewer, larger events are a trade a user sees, so it has its own
                rows and `*_si` ratios; its ITL is the gap between events, as a client sees it;
  (f) http-perreq  `kvguard serve --token-channel off`: decode's tokens on a stream per request
                instead of one token channel per decode worker (the design before issue 14's last
                step), for a same-run A/B of the channel: `channel_gain` is http / http-perreq;
  (g) http-raw  (d)'s server, driven by a minimal aiohttp SSE client (one `json.loads` per event)
                instead of the openai client: a diagnostic of how much of (d)'s gap to (c) is the
                client's own CPU on this shared machine, in `*_raw` keys, never the headline's.
HTTP backends (a)-(e) are driven by the official `openai` async client with streaming completions.

Workload: prompt lengths 8-512 and output lengths 8-256, log-uniform (many short requests, some
long ones), from `--seed`. Prompts are printable ASCII bytes after BOS, so the byte-level
tokenizer gives the same ids whether a server gets token ids (kvguard) or text (transformers).
Arrivals: closed loop at 1, 16 and 64 concurrent clients, and Poisson arrivals at fractions of the
engine's measured closed-loop-16 request rate. "mixed" = the closed loop at 16 concurrent: the
static-batch-16 baseline's own concurrency.

Reported per backend and scenario: output tokens per wall second, TTFT and inter-token latency
p50/p99, CPU seconds per output token (this process for hf/engine; the whole server process tree
for HTTP, the client's own CPU apart), and the ratio of throughput to (a). Greedy outputs of (c)
and (d) are checked against (a). Every process runs torch with 1 thread (`torch.set_num_threads`
here, OMP_NUM_THREADS for servers), as the measurements in issue 14 did: the comparison is of
serving designs, not of how many cores each grabs on a shared 2-core machine.

    .venv/bin/python bench/serving.py --quick            # < 5 min; last line: one JSON object
    .venv/bin/python bench/serving.py [--model medium] [--reps 3] [--plot-dir bench/plots]
    .venv/bin/python bench/serving.py --client-procs 4   # many cores: the client split over 4 processes

`--model tiny` is the 0.5 MB test model (Python-bound: measures the serving machinery);
`--model medium` a random ~25M-parameter Llama (hidden 512, 8 layers) where compute matters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvguard.workers.tiny import BOS_ID, write_random_model, write_tiny_model

MODELS: dict[str, dict[str, Any] | None] = {
    "tiny": None,  # workers/tiny.py's fixed shape
    "medium": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 64, "intermediate_size": 1536},
}
PAD_ID = 258  # <|pad|> in the tiny tokenizer
# Every backend, in the order a repetition runs them (each repetition rotates who goes first), and
# kvguard's own among them (greedy parity and TTFT are reported for these).
BACKENDS = ("hf", "engine", "http", "http-perreq", "http-si", "http-raw", "tfserve")
KVGUARD_BACKENDS = ("engine", "http", "http-perreq", "http-si", "http-raw")
HF_BATCH = 16
MIXED = "closed-16"


# ------------------------------------------------------------------------------------ workload


@dataclass(frozen=True)
class WorkItem:
    index: int
    prompt_ids: tuple[int, ...]  # BOS + printable ASCII bytes
    max_tokens: int

    @property
    def prompt_text(self) -> str:
        """The prompt as text (servers that tokenize themselves add the BOS back)."""
        return bytes(self.prompt_ids[1:]).decode("ascii")


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def make_workload(count: int, seed: int) -> list[WorkItem]:
    rng = random.Random(seed)
    items = []
    for i in range(count):
        prompt = log_uniform(rng, 8, 512)
        items.append(WorkItem(i, (BOS_ID, *(rng.randrange(32, 127) for _ in range(prompt - 1))), log_uniform(rng, 8, 256)))
    return items


@dataclass(frozen=True)
class Scenario:
    """`concurrency` clients in a closed loop, or Poisson arrivals at `rate` requests/s."""

    name: str
    items: tuple[WorkItem, ...]
    concurrency: int | None = None
    rate: float | None = None
    offsets: list[float] | None = None  # a share's own arrival offsets (`--client-procs`), else drawn

    def arrivals(self, seed: int = 1) -> list[float]:
        """Poisson: offsets in seconds from the start at which each request arrives."""
        assert self.rate is not None
        rng, t, out = random.Random(seed), 0.0, []
        for _ in self.items:
            out.append(t)
            t += rng.expovariate(self.rate)
        return out


# ------------------------------------------------------------------------------------- records


@dataclass
class Record:
    """One request as its client saw it."""

    item: WorkItem
    submit: float = 0.0
    token_times: list[float] = field(default_factory=list)  # when each streamed piece arrived
    tokens: int = 0
    output_ids: list[int] | None = None
    text: str = ""


@dataclass
class Result:
    backend: str
    scenario: str
    records: list[Record]
    wall_s: float
    cpu_s: float  # the serving side's CPU
    client_cpu_s: float = 0.0
    decode_batch: float | None = None  # mean requests per decode step (kvguard_step_requests), kvguard only

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.records)

    def summary(self) -> dict[str, float]:
        ttft = [r.token_times[0] - r.submit for r in self.records if r.token_times]
        itl = [b - a for r in self.records for a, b in zip(r.token_times, r.token_times[1:])]
        return {
            "decode_batch": float("nan") if self.decode_batch is None else self.decode_batch,
            "tok_s": self.tokens / self.wall_s,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "cpu_ms_per_tok": 1e3 * self.cpu_s / max(1, self.tokens),
            "client_cpu_ms_per_tok": 1e3 * self.client_cpu_s / max(1, self.tokens),
        }


def decode_step_totals(exposition: str) -> tuple[float, float]:
    """(requests decoded, decode steps) so far, from an engine's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {"sum": 0.0, "count": 0.0}
    for family in text_string_to_metric_families(exposition):
        if family.name == "kvguard_step_requests":
            for sample in family.samples:
                kind = sample.name.rsplit("_", 1)[-1]
                if sample.labels.get("phase") == "decode" and kind in found:
                    found[kind] = sample.value
    return found["sum"], found["count"]


def known(value: float) -> float | None:
    """`value` rounded, None for the nan a backend without a decode batch reports."""
    return round(value, 2) if value == value else None


def mean_batch(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    steps = after[1] - before[1]
    return (after[0] - before[0]) / steps if steps else None


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


# --------------------------------------------------------------------------- (a) HF generate()


class StepTimes:
    """A `generate()` streamer that only timestamps each decoding step (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class HFBackend:
    name = "hf"

    def __init__(self, model_dir: Path, device: str) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(self.device)
        self._config = GenerationConfig
        self.run_batch([WorkItem(-1, (BOS_ID, 65, 66), 2)])  # warm-up

    def run_batch(self, items: Sequence[WorkItem]) -> list[Record]:
        width = max(len(i.prompt_ids) for i in items)
        ids = torch.tensor([[PAD_ID] * (width - len(i.prompt_ids)) + list(i.prompt_ids) for i in items], device=self.device)
        mask = torch.tensor([[0] * (width - len(i.prompt_ids)) + [1] * len(i.prompt_ids) for i in items], device=self.device)
        new = max(i.max_tokens for i in items)
        # eos_token_id=None: never stop early, like ignore_eos on the kvguard side.
        config = self._config(do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                              pad_token_id=PAD_ID, bos_token_id=BOS_ID)
        steps = StepTimes()
        submit = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=steps)
        generated = out[:, width:].tolist()
        return [Record(i, submit, steps.times[: i.max_tokens], i.max_tokens, row[: i.max_tokens])
                for i, row in zip(items, generated)]

    def run(self, scenario: Scenario) -> Result:
        """Static batching: batches of 16 (1 for the single-client case) in arrival order."""
        size = 1 if scenario.concurrency == 1 else HF_BATCH
        start, cpu = time.perf_counter(), time.process_time()
        records = [r for b in range(0, len(scenario.items), size) for r in self.run_batch(scenario.items[b : b + size])]
        return Result(self.name, scenario.name, records, time.perf_counter() - start, time.process_time() - cpu)


# ----------------------------------------------------------------------- (c) in-process engine


class EngineBackend:
    name = "engine"

    def __init__(self, model_dir: Path, pool_tokens: int, device: str) -> None:
        from kvguard.workers.config import EngineConfig
        from kvguard.workers.engine import Engine

        self.engine = Engine(EngineConfig(model_dir, device=device, kv_pool_tokens=pool_tokens, max_running_requests=64))
        self._serial = 0
        self.run(Scenario("warmup", (WorkItem(-1, (BOS_ID, 65, 66), 2),), concurrency=1))

    def run(self, scenario: Scenario) -> Result:
        from prometheus_client import generate_latest

        from kvguard.workers.device import synchronize
        from kvguard.workers.request import SamplingParams

        engine = self.engine
        steps_before = decode_step_totals(generate_latest(engine.metrics.registry).decode())
        records = [Record(i, output_ids=[]) for i in scenario.items]
        due = scenario.arrivals() if scenario.rate else None
        waiting = list(range(len(records)))[::-1]  # a stack: next to submit on top
        by_id: dict[str, Record] = {}
        live = 0
        start, cpu = time.perf_counter(), time.process_time()
        while waiting or engine.has_work():
            now = time.perf_counter()
            while waiting and (live < scenario.concurrency if due is None else start + due[waiting[-1]] <= now):
                position = waiting.pop()
                record = records[position]
                self._serial += 1
                rid = f"b{self._serial}"
                record.submit = now if due is None else start + due[position]
                engine.add_request(rid, record.item.prompt_ids, SamplingParams(max_tokens=record.item.max_tokens, temperature=0, ignore_eos=True))
                by_id[rid] = record
                live += 1
            if not engine.has_work():
                time.sleep(max(0.0, start + due[waiting[-1]] - time.perf_counter()) if due and waiting else 0.0)
                continue
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                record = by_id[out.request_id]
                if out.token_ids:
                    record.token_times.append(now)
                    record.tokens += len(out.token_ids)
                    record.output_ids += out.token_ids  # type: ignore[operator]
                live -= out.finished
        synchronize(engine.device)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        batch = mean_batch(steps_before, decode_step_totals(generate_latest(engine.metrics.registry).decode()))
        return Result(self.name, scenario.name, records, wall, cpu, decode_batch=batch)


# ------------------------------------------------------------------------------ HTTP servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_tree(root: int) -> list[int]:
    """root and every descendant, from /proc (kvguard's workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / os.sysconf("SC_CLK_TCK")


class Server:
    """An HTTP server process we start, time, account CPU for, and stop (never anything else)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.started = time.perf_counter()
        self.popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.pids: list[int] = [self.popen.pid]
        self.decode_metrics: str | None = None  # kvguard serve's decode worker /metrics

    def decode_steps(self) -> tuple[float, float] | None:
        if self.decode_metrics is None:
            return None
        import requests

        return decode_step_totals(requests.get(self.decode_metrics, timeout=10).text)

    def refresh_pids(self) -> None:
        self.pids = process_tree(self.popen.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.pids)

    def stop(self) -> None:
        self.refresh_pids()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for pid in self.pids[1:]:  # a worker the launcher failed to stop
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def server_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def start_kvguard(model_dir: Path, pool_tokens: int | None, device: str, stream_interval: int = 1,
                  token_channel: str = "on") -> tuple[Server, str]:
    """`kvguard serve` with a `pool_tokens` pool, or (None) the pool it sizes itself, as a user
    who passes only `--model` gets."""
    pool = ["--kv-pool-tokens", str(pool_tokens)] if pool_tokens is not None else []
    argv = [sys.executable, "-P", "-m", "kvguard", "serve", "--model", str(model_dir), *pool,
            "--stream-interval", str(stream_interval), "--device", device, "--token-channel", token_channel]
    server = Server(argv, server_env())
    assert server.popen.stdout is not None
    line = server.popen.stdout.readline()  # the JSON line once every worker is healthy
    if not line:
        raise RuntimeError(f"kvguard serve exited with {server.popen.wait()} before it was ready")
    ready = json.loads(line)
    server.decode_metrics = ready["metrics"]["decode"]
    return server, ready["router"]


def start_transformers(model_dir: Path, device: str) -> tuple[Server, str]:
    port = free_port()
    exe = Path(sys.executable).with_name("transformers")
    argv = [str(exe), "serve", str(model_dir), "--device", device, "--host", "127.0.0.1", "--port", str(port)]
    server = Server(argv, server_env())
    return server, f"http://127.0.0.1:{port}/v1"


def wait_answering(base_url: str, model: str, prompt: str | list[int], timeout_s: float = 180.0) -> float:
    """Seconds until the server answers a completion (it may report healthy before it can)."""
    import requests

    start = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    while time.perf_counter() - start < timeout_s:
        try:
            if requests.post(f"{base_url}/completions", json=body, timeout=30).status_code == 200:
                return time.perf_counter() - start
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{base_url} did not answer within {timeout_s:.0f} s")


def time_default_serve(model_dir: Path, device: str) -> float:
    """Seconds from starting `kvguard serve --model DIR` (every other flag at its default, the
    pool sized from the memory budget) to its first answer, with nothing else running: issue 14's
    start-up goal, as a user meets it."""
    t0 = time.perf_counter()
    server, url = start_kvguard(model_dir, None, device)
    try:
        return time.perf_counter() - t0 + wait_answering(url, model_dir.name, [BOS_ID, 65])
    finally:
        server.stop()


class HTTPBackend:
    """A server driven by the official openai async client, streaming completions."""

    def __init__(self, name: str, server: Server, base_url: str, model: str, token_prompts: bool,
                 client_procs: int = 1) -> None:
        import openai  # noqa: F401 - imported now: its ~1 s import must not land in the first timed run

        self.name, self.server, self.base_url, self.model, self.token_prompts = name, server, base_url, model, token_prompts
        self._pool: ProcessPoolExecutor | None = None
        if client_procs > 1:  # spawned once and warmed (imports) before anything is timed
            self._pool = ProcessPoolExecutor(client_procs, mp_context=multiprocessing.get_context("spawn"))
            list(self._pool.map(_warm_client, range(client_procs)))
        self.client_procs = client_procs
        self.run(Scenario("warmup", (WorkItem(-1, (BOS_ID, 65, 66), 2),), concurrency=1))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def run(self, scenario: Scenario) -> Result:
        self.server.refresh_pids()
        steps_before = self.server.decode_steps()
        cpu = self.server.cpu()
        start = time.perf_counter()
        records, client_cpu = self._drive_everywhere(scenario)
        wall = time.perf_counter() - start
        result = Result(self.name, scenario.name, records, wall, self.server.cpu() - cpu, client_cpu)
        steps_after = self.server.decode_steps()
        if steps_before is not None and steps_after is not None:
            result.decode_batch = mean_batch(steps_before, steps_after)
        return result

    def _drive_everywhere(self, scenario: Scenario) -> tuple[list[Record], float]:
        """The scenario's records and the clients' CPU seconds: driven here, or with
        `--client-procs N` split across N client processes (item k to process k mod N, each with
        its share of the closed loop's clients), so that one Python process's CPU does not bound
        what a many-core server is measured at."""
        if self._pool is None or len(scenario.items) < 2:
            cpu = time.process_time()
            return asyncio.run(self._drive(scenario)), time.process_time() - cpu
        n = min(self.client_procs, len(scenario.items))
        shares = []
        for k in range(n):
            concurrency = None if scenario.concurrency is None else max(1, round(scenario.concurrency / n))
            offsets = scenario.arrivals()[k::n] if scenario.rate else None
            shares.append(Scenario(scenario.name, scenario.items[k::n], concurrency, scenario.rate, offsets))
        settings = (type(self), self.name, self.base_url, self.model, self.token_prompts)
        done = list(self._pool.map(_drive_share, [settings] * n, shares))
        by_index = {record.item.index: record for records, _ in done for record in records}
        return [by_index[item.index] for item in scenario.items], sum(cpu for _, cpu in done)

    def _client(self) -> Any:
        """The async context manager `_one` sends through."""
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=600)

    async def _drive(self, scenario: Scenario) -> list[Record]:
        records = [Record(i) for i in scenario.items]
        async with self._client() as client:
            if scenario.rate:
                start = time.perf_counter()

                async def at(record: Record, offset: float) -> None:
                    await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                    await self._one(client, record)

                await asyncio.gather(*(at(r, t) for r, t in zip(records, scenario.offsets or scenario.arrivals())))
            else:
                queue = iter(records)

                async def client_loop() -> None:
                    for record in queue:
                        await self._one(client, record)

                await asyncio.gather(*(client_loop() for _ in range(scenario.concurrency or 1)))
        return records

    async def _one(self, client: Any, record: Record) -> None:
        item = record.item
        record.submit = time.perf_counter()
        stream = await client.completions.create(
            model=self.model, prompt=list(item.prompt_ids) if self.token_prompts else item.prompt_text,
            max_tokens=item.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            # transformers serve refuses unknown fields (422); its random-model outputs rarely hit EOS.
            extra_body={"ignore_eos": True} if self.token_prompts else None,
        )
        pieces = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                record.token_times.append(time.perf_counter())
                record.text += chunk.choices[0].text
                pieces += 1
            if chunk.usage is not None:
                record.tokens = chunk.usage.completion_tokens
        record.tokens = record.tokens or pieces


def _warm_client(_: int) -> None:
    import openai  # noqa: F401 - in a client process, before anything is timed


def _drive_share(settings: tuple[type[HTTPBackend], str, str, str, bool], scenario: Scenario) -> tuple[list[Record], float]:
    """In a client process: drive one share of a scenario; its records and this process's CPU."""
    cls, name, base_url, model, token_prompts = settings
    backend = cls.__new__(cls)  # no server, no warm-up: the parent did both
    backend.name, backend.base_url, backend.model, backend.token_prompts = name, base_url, model, token_prompts
    cpu = time.process_time()
    records = asyncio.run(backend._drive(scenario))
    return records, time.process_time() - cpu


class RawHTTPBackend(HTTPBackend):
    """(f): the same requests as `HTTPBackend`, through aiohttp and `json.loads`, nothing else."""

    def _client(self) -> Any:
        import aiohttp

        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600))

    async def _one(self, client: Any, record: Record) -> None:
        item = record.item
        record.submit = time.perf_counter()
        body = {"model": self.model, "prompt": list(item.prompt_ids), "max_tokens": item.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
        pieces = 0
        async with client.post(f"{self.base_url}/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    raise RuntimeError(f"stream failed: {chunk['error']}")
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    record.token_times.append(time.perf_counter())
                    record.text += chunk["choices"][0]["text"]
                    pieces += 1
                if chunk.get("usage"):
                    record.tokens = chunk["usage"]["completion_tokens"]
        record.tokens = record.tokens or pieces


# ---------------------------------------------------------------------------------- the run


def scenarios(items: list[WorkItem], quick: bool, rates: Sequence[float]) -> list[Scenario]:
    single = tuple(items[: 4 if quick else 16])
    out = [Scenario("closed-1", single, concurrency=1), Scenario(MIXED, tuple(items), concurrency=16)]
    if not quick:  # with --quick's 24 requests, 64 clients would be the same offline batch as 16 plus 8
        out.append(Scenario("closed-64", tuple(items), concurrency=64))
    out += [Scenario(f"poisson-{r:.1f}/s", tuple(items), rate=r) for r in rates]
    return out


def parity(reference: dict[int, list[int]], result: Result, tokenizer: Any) -> tuple[int, int]:
    """(equal, compared): greedy outputs against HF's, by ids in-process, by text over HTTP."""
    equal = compared = 0
    for record in result.records:
        expected = reference.get(record.item.index)
        if expected is None:
            continue
        compared += 1
        if record.output_ids is not None and result.backend == "engine":
            equal += record.output_ids == expected
        else:
            equal += record.text == tokenizer.decode(expected)
    return equal, compared


def model_folder(kind: str, root: Path) -> Path:
    folder = root / kind
    write_tiny_model(folder)  # tokenizer files for every model
    shape = MODELS[kind]
    if shape is not None:
        write_random_model(folder, shape, seed=0)
    return folder


def print_table(results: dict[tuple[str, str], list[Result]], baseline: Callable[[str], float | None]) -> None:
    print(f"{'backend':8} {'scenario':15} {'tok/s':>8} {'x hf':>6} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} "
          f"{'p99':>7} {'CPU ms/tok':>10} {'client':>7} {'batch':>5}")
    for (backend, scenario), runs in results.items():
        s = median_summary(runs)
        base = baseline(scenario)
        ratio = f"{s['tok_s'] / base:6.2f}" if base else "     -"
        batch = f"{s['decode_batch']:5.1f}" if s["decode_batch"] == s["decode_batch"] else "    -"  # nan: not kvguard
        print(f"{backend:8} {scenario:15} {s['tok_s']:8.1f} {ratio} {s['ttft_p50_ms']:7.1f}ms {s['ttft_p99_ms']:6.0f}ms "
              f"{s['itl_p50_ms']:6.1f}ms {s['itl_p99_ms']:5.0f}ms {s['cpu_ms_per_tok']:10.3f} {s['client_cpu_ms_per_tok']:7.3f} {batch}")


def median_summary(runs: list[Result]) -> dict[str, float]:
    summaries = [r.summary() for r in runs]
    return {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="24 requests, 1 rep, no 64-client loop, 1 Poisson rate (< 5 min)")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--requests", type=int, default=None, help="requests per scenario (default 64; 24 with --quick)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 3; 1 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset; "
                        "http-si is kvguard serve with --stream-interval, http-perreq with --token-channel off, http-raw "
                        "the http server driven by a minimal "
                        "client (each its own rows and *_si / *_raw ratios, never the headline's)")
    parser.add_argument("--stream-interval", type=int, default=8, help="tokens per streamed event for http-si (default 8)")
    parser.add_argument("--tfserve-scenarios", default=None,
                        help=f"scenarios for transformers serve (default: {MIXED} only with --quick, else all closed loops)")
    parser.add_argument("--scenarios", default=None, help="comma-separated subset, e.g. closed-1,closed-16")
    parser.add_argument("--client-procs", type=int, default=1,
                        help="client processes driving each HTTP backend (default 1): on a many-core machine one Python "
                        "client process can itself be the bound; the items and closed-loop clients are split among them")
    parser.add_argument("--plot-dir", type=Path, default=None, help="write throughput/latency PNGs here")
    parser.add_argument("--json-out", type=Path, default=None, help="also write every result as JSON here")
    parser.add_argument("--device", default="cpu", help="where every backend runs: cpu (default) or cuda[:N] "
                        "(HF and the engine in this process, `kvguard serve --device`, `transformers serve --device`)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    count = args.requests or (24 if args.quick else 64)
    reps = args.reps or (1 if args.quick else 3)
    backends = args.backends.split(",")
    items = make_workload(count, args.seed)
    pool_tokens = 64 * (512 + 256 + 16)
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-serving-"))
    servers: list[Server] = []
    try:
        return run(args, items, reps, backends, pool_tokens, tmp, servers)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, items: list[WorkItem], reps: int, backends: list[str], pool_tokens: int,
        tmp: Path, servers: list[Server]) -> int:
    from kvguard.workers.tokenizer import Tokenizer

    model_dir = model_folder(args.model, tmp)
    tokenizer = Tokenizer.from_dir(model_dir)
    startup: dict[str, float] = {}
    live: dict[str, Any] = {}
    # Servers first: they start (in parallel with each other) while HF and the engine load.
    if "http" in backends or "http-raw" in backends:
        startup["serve_default_first_answer_s"] = time_default_serve(model_dir, args.device)  # alone, before the rest
        t0 = time.perf_counter()
        server, url = start_kvguard(model_dir, pool_tokens, args.device)
        servers.append(server)
        startup["http_ready_s"] = time.perf_counter() - t0
        startup["http_first_answer_s"] = startup["http_ready_s"] + wait_answering(url, model_dir.name, [BOS_ID, 65])
        if "http" in backends:
            live["http"] = HTTPBackend("http", server, url, model_dir.name, token_prompts=True, client_procs=args.client_procs)
        if "http-raw" in backends:  # the same server: only the client differs
            live["http-raw"] = RawHTTPBackend("http-raw", server, url, model_dir.name, token_prompts=True, client_procs=args.client_procs)
    if "http-perreq" in backends:
        server, url = start_kvguard(model_dir, pool_tokens, args.device, token_channel="off")
        servers.append(server)
        live["http-perreq"] = HTTPBackend("http-perreq", server, url, model_dir.name, token_prompts=True, client_procs=args.client_procs)
    if "http-si" in backends:
        server, url = start_kvguard(model_dir, pool_tokens, args.device, args.stream_interval)
        servers.append(server)
        live["http-si"] = HTTPBackend("http-si", server, url, model_dir.name, token_prompts=True, client_procs=args.client_procs)
    if "tfserve" in backends:
        t0 = time.perf_counter()
        server, url = start_transformers(model_dir, args.device)
        servers.append(server)
        startup["tfserve_first_answer_s"] = wait_answering(url, str(model_dir), "AB")
        live["tfserve"] = HTTPBackend("tfserve", server, url, str(model_dir), token_prompts=False, client_procs=args.client_procs)
    if "hf" in backends:
        live["hf"] = HFBackend(model_dir, args.device)
    if "engine" in backends:
        live["engine"] = EngineBackend(model_dir, pool_tokens, args.device)
    print(f"model {args.model} ({sum(p.numel() for p in live['engine'].engine.model.parameters()) / 1e6:.2f}M params)"
          if "engine" in live else f"model {args.model}", f"requests {len(items)}, reps {reps}, torch threads 1 per process, client processes {args.client_procs}; "
          f"start-up: {', '.join(f'{k} {v:.1f}' for k, v in startup.items())}", flush=True)
    rates = rates_from_capacity(live, items, args.quick)
    plan = [s for s in scenarios(items, args.quick, rates) if not args.scenarios or s.name in args.scenarios.split(",")]
    tf_only = (args.tfserve_scenarios or (MIXED if args.quick else "closed-1,closed-16,closed-64")).split(",")
    results: dict[tuple[str, str], list[Result]] = {}
    order = [b for b in BACKENDS if b in live]
    for rep in range(reps):
        for scenario in plan:
            for name in order[rep % len(order):] + order[: rep % len(order)]:  # rotate who goes first
                if name == "hf" and (scenario.rate or scenario.name == "closed-64"):
                    continue  # static batches of 16 serve no arrivals and no 64: its batch-16 run is the baseline
                if name == "tfserve" and scenario.name not in tf_only:
                    continue
                result = live[name].run(scenario)
                results.setdefault((name, scenario.name), []).append(result)
                print(f"  rep {rep} {name:8} {scenario.name:15} {result.summary()['tok_s']:8.1f} tok/s", flush=True)
    for backend in live.values():
        if isinstance(backend, HTTPBackend):
            backend.close()
    return report(args, results, tokenizer, startup, rates)


def rates_from_capacity(live: dict[str, Any], items: list[WorkItem], quick: bool) -> list[float]:
    """Poisson rates as fractions of the engine's closed-loop-16 request rate, measured now (so the
    load means the same on a fast and a slow machine)."""
    if "engine" not in live:
        return [2.0] if quick else [1.0, 2.0, 4.0]
    probe = live["engine"].run(Scenario("probe", tuple(items[:16]), concurrency=16))
    per_s = len(probe.records) / probe.wall_s
    return [round(per_s * f, 1) for f in ((0.5,) if quick else (0.25, 0.5, 0.75))]


def report(args: argparse.Namespace, results: dict[tuple[str, str], list[Result]], tokenizer: Any,
           startup: dict[str, float], rates: list[float]) -> int:
    def tok_s(backend: str, scenario: str) -> float | None:
        runs = results.get((backend, scenario))
        return median_summary(runs)["tok_s"] if runs else None

    def baseline(scenario: str) -> float | None:
        return tok_s("hf", "closed-1" if scenario == "closed-1" else MIXED)

    print()
    print_table(results, baseline)
    reference = {r.item.index: r.output_ids for res in results.get(("hf", "closed-1"), []) + results.get(("hf", MIXED), [])
                 for r in res.records if r.output_ids is not None}
    checks = {}
    for (backend, scenario), runs in results.items():
        if backend in KVGUARD_BACKENDS:
            equal, compared = parity(reference, runs[0], tokenizer)
            checks[f"{backend}/{scenario}"] = f"{equal}/{compared}"
    print("greedy parity with hf:", ", ".join(f"{k} {v}" for k, v in checks.items()))

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    summary = {k: median_summary(v) for k, v in results.items()}
    ttft = {b: summary.get((b, MIXED), {}).get("ttft_p50_ms") for b in KVGUARD_BACKENDS}
    bound, floor = goal_limits(summary)
    headline = {
        "http_vs_hf": ratio(tok_s("http", MIXED), tok_s("hf", MIXED)),
        "http_vs_inprocess": ratio(tok_s("http", MIXED), tok_s("engine", MIXED)),
        "inprocess_vs_hf": ratio(tok_s("engine", MIXED), tok_s("hf", MIXED)),
        "ttft_ratio": ratio(ttft["http"], ttft["engine"]),
        # What this machine allows those two goals at best (see goal_limits).
        "http_vs_inprocess_bound": bound,
        "ttft_ratio_floor": floor,
        "inprocess_vs_hf_1": ratio(tok_s("engine", "closed-1"), tok_s("hf", "closed-1")),
        "http_vs_hf_1": ratio(tok_s("http", "closed-1"), tok_s("hf", "closed-1")),
        "inprocess_vs_hf_64": ratio(tok_s("engine", "closed-64"), tok_s("hf", MIXED)),
        "http_vs_hf_64": ratio(tok_s("http", "closed-64"), tok_s("hf", MIXED)),
        "tfserve_vs_hf": ratio(tok_s("tfserve", MIXED), tok_s("hf", MIXED)),
        "http_vs_tfserve": ratio(tok_s("http", MIXED), tok_s("tfserve", MIXED)),
        # The token channel against a stream per request, same run (--token-channel off).
        "channel_gain": ratio(tok_s("http", MIXED), tok_s("http-perreq", MIXED)),
        "http_perreq_vs_inprocess": ratio(tok_s("http-perreq", MIXED), tok_s("engine", MIXED)),
        "ttft_ratio_perreq": ratio(ttft["http-perreq"], ttft["engine"]),
        # --stream-interval N: fewer, larger events (a user-visible trade), so its own keys.
        "stream_interval": args.stream_interval if any(b == "http-si" for b, _ in results) else None,
        "http_si_vs_hf": ratio(tok_s("http-si", MIXED), tok_s("hf", MIXED)),
        "http_si_vs_inprocess": ratio(tok_s("http-si", MIXED), tok_s("engine", MIXED)),
        "ttft_ratio_si": ratio(ttft["http-si"], ttft["engine"]),
        # The http server with a minimal client: how much of the gap is the openai client's CPU.
        "http_raw_vs_hf": ratio(tok_s("http-raw", MIXED), tok_s("hf", MIXED)),
        "http_raw_vs_inprocess": ratio(tok_s("http-raw", MIXED), tok_s("engine", MIXED)),
        "ttft_ratio_raw": ratio(ttft["http-raw"], ttft["engine"]),
        "ttft_p50_ms": {b: round(v, 1) if v else None for b, v in ttft.items()},
        # Mean requests per decode step at 16 concurrent: the HTTP path's requests spend part of
        # their life outside decode (router, prefill, transfer), so its batches run emptier.
        "decode_batch": {b: known(summary.get((b, MIXED), {}).get("decode_batch", math.nan)) for b in KVGUARD_BACKENDS},
        "poisson_rates": rates,
        "parity": checks,
        "startup_s": {k: round(v, 2) for k, v in startup.items()},
        "client_procs": args.client_procs,
        "model": args.model,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps({"headline": headline, "results": [
            {"backend": b, "scenario": s, **median_summary(v)} for (b, s), v in results.items()]}, indent=2))
    if args.plot_dir:
        plot(args.plot_dir, results, args.model)
    print(json.dumps(headline))
    return 0


def goal_limits(summary: dict[tuple[str, str], dict[str, float]]) -> tuple[float | None, float | None]:
    """The best `http_vs_inprocess` and `ttft_ratio` any HTTP server could reach in this run.

    Bound: every core busy, the servers spending no more CPU per token than the in-process engine
    does (the same model work, no HTTP at all), the client its measured CPU per token (the openai
    client's work per streamed event is not the server's to cut). Floor: the HTTP path's TTFT
    with nothing queued (one client) against the in-process TTFT at 16 clients. A goal beyond
    these is out of reach on this machine whatever the servers do."""
    engine, http, idle = (summary.get(key) for key in (("engine", MIXED), ("http", MIXED), ("http", "closed-1")))
    bound = floor = None
    if engine and http:
        cores = len(os.sched_getaffinity(0))
        best_tok_s = cores * 1e3 / (engine["cpu_ms_per_tok"] + http["client_cpu_ms_per_tok"])
        bound = round(best_tok_s / engine["tok_s"], 3)
    if engine and idle and engine["ttft_p50_ms"]:
        floor = round(idle["ttft_p50_ms"] / engine["ttft_p50_ms"], 3)
    return bound, floor


def plot(folder: Path, results: dict[tuple[str, str], list[Result]], model: str) -> None:
    """Throughput against concurrency, and TTFT / inter-token latency CDFs at 16 concurrent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for backend in BACKENDS:
        points = [(c, median_summary(results[(backend, f"closed-{c}")])["tok_s"]) for c in (1, 16, 64)
                  if (backend, f"closed-{c}") in results]
        if points:
            ax.plot(*zip(*points), marker="o", label=backend)
    ax.set(xscale="log", xlabel="concurrent clients (closed loop)", ylabel="output tokens / s",
           title=f"Throughput vs concurrency ({model} model, 1 torch thread/process)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / f"serving_throughput_{model}.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for backend in BACKENDS:
        runs = results.get((backend, MIXED))
        if not runs:
            continue
        ttft = sorted(1e3 * (r.token_times[0] - r.submit) for res in runs for r in res.records if r.token_times)
        itl = sorted(1e3 * (b - a) for res in runs for r in res.records for a, b in zip(r.token_times, r.token_times[1:]))
        for ax, values in zip(axes, (ttft, itl)):
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=backend)
    for ax, what in zip(axes, ("time to first token (ms)", "inter-token latency (ms)")):
        ax.set(xscale="log", xlabel=what, ylabel="fraction of requests" if "first" in what else "fraction of tokens")
        ax.legend()
    fig.suptitle(f"Latency CDFs, {MIXED} ({model} model)")
    fig.tight_layout()
    fig.savefig(folder / f"serving_latency_{model}.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
