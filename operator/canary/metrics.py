"""Worker metrics for the canary: KV pool capacity and usage, context length, safety counters.

Prometheus text is parsed with `prometheus_client.parser`; each engine's names are mapped onto one
`WorkerSnapshot` (a worker may hold several pools: one per DP rank / vLLM engine).

| quantity | kvguard | SGLang (`--enable-metrics`) | vLLM |
|---|---|---|---|
| pool capacity (tokens) | `kvguard_kv_pool_capacity_tokens` | `sglang:max_total_num_tokens`; older builds: `GET /server_info` -> `internal_states[].memory_usage.token_capacity`, else `max_total_num_tokens` | `vllm:cache_config_info` labels: `kv_cache_size_tokens`, else `num_gpu_blocks` x `block_size` (one pool per `engine` label) |
| pool used (tokens) | `kvguard_kv_pool_used_tokens` | `sglang:num_used_tokens`, else `sglang:token_usage` x capacity | `vllm:kv_cache_usage_perc` (or deprecated `vllm:gpu_cache_usage_perc`) x capacity |
| context length | `kvguard_context_length_tokens` | `/server_info` `context_length`; `/v1/models` `max_model_len` | `/v1/models` `max_model_len` |
| tokens generated | `kvguard_generation_tokens_total` | `sglang:generation_tokens_total` (counted when a request ends) | `vllm:generation_tokens_total` |
| safety counters | `kvguard_tag_violations_total`, `kvguard_checksum_failures_total`, `kvguard_hmac_failures_total`, `kvguard_stale_writes_dropped_total` | `sglang:num_transfer_failed_reqs_total`, `sglang:num_bootstrap_failed_reqs_total` (no KV-checksum counter exists) | `vllm:nixl_num_failed_transfers`, `vllm:nixl_num_failed_notifications` |

Series are matched per label set (a pool's `used` pairs with the `capacity` that has the same
rank labels); counters are summed over labels. SGLang exports from TP rank 0 only unless
`--enable-metrics-for-all-schedulers` is set, so one SGLang metrics URL stands for its whole TP group.

Provenance, checked by tests/test_engine_conformance.py against the releases' own code:
- SGLang 0.5.22/0.5.23 `srt/observability/metrics_collector.py`: every name above, with labels
  model_name, engine_type, tp_rank, pp_rank, moe_ep_rank, optional dp_rank and priority;
  `/server_info` fields from `srt/entrypoints/http_server.py` `server_info` (internal_states,
  version), `managers/scheduler_components/memory_usage.py` (token_capacity) and the scheduler
  info (max_total_num_tokens). No KV-checksum or KV-canary metric exists.
- vLLM 0.33.0 `v1/metrics/loggers.py`: `vllm:cache_config_info` (labels = `CacheConfig` fields,
  `config/cache.py`), `vllm:kv_cache_usage_perc` (0.33 no longer has the deprecated
  `vllm:gpu_cache_usage_perc`; both are read), labels model_name and engine;
  `distributed/kv_transfer/kv_connector/v1/nixl/stats.py`: the NIXL counters.
Not verified: whether an idle SGLang refreshes `num_used_tokens` (it is set when batch statistics
are logged); if the abort probe's pool check flags an idle SGLang deployment, compare with
`GET /v1/loads` before trusting it.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, ValidationError

from kvguard.operator.canary.client import get_text
from kvguard.operator.canary.report import clip
from kvguard.operator.canary.responses import parse_json_text

Labels = tuple[tuple[str, str], ...]
SampleIndex = dict[str, list[tuple[Labels, float]]]

KVGUARD_CAPACITY = "kvguard_kv_pool_capacity_tokens"
KVGUARD_USED = "kvguard_kv_pool_used_tokens"
KVGUARD_CONTEXT = "kvguard_context_length_tokens"
SGLANG_CAPACITY = "sglang:max_total_num_tokens"
SGLANG_USED = "sglang:num_used_tokens"
SGLANG_USAGE = "sglang:token_usage"
VLLM_CACHE_INFO = "vllm:cache_config_info"
GENERATION_COUNTERS = ("kvguard_generation_tokens_total", "sglang:generation_tokens_total", "vllm:generation_tokens")
"""Tokens generated, per engine. kvguard and vLLM count them step by step, SGLang when a request
ends; either way a generation that ran to its end is counted by the time its pages are free."""
VLLM_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# Labels that tell pools apart; anything else (model_name, help-only labels) is ignored when
# pairing a usage series with its capacity.
_POOL_KEY_LABELS = ("engine", "dp_rank", "rank", "role", "tp_rank", "moe_ep_rank", "pp_rank")


@dataclass(frozen=True)
class PoolReading:
    pool: str  # e.g. "engine=0" or "" for a worker's only pool
    capacity_tokens: int
    used_tokens: float | None
    source: str


@dataclass
class WorkerSnapshot:
    url: str
    engine: str = "unknown"  # kvguard | sglang | vllm | unknown
    pools: list[PoolReading] = field(default_factory=list)
    context_length: int | None = None
    samples: SampleIndex = field(default_factory=dict)
    error: str | None = None
    unreadable_pools: list[str] = field(default_factory=list)
    """Pool sizes it reports that are not finite numbers (NaN, Inf): a worker with a pool no one
    can read, not a router without one (outside probe: it passed as "router?")."""

    @property
    def reachable(self) -> bool:
        return self.error is None

    def counter(self, name: str) -> float | None:
        """Sum of a sample name over all labels; None when this worker does not expose it."""
        series = self.samples.get(name)
        if series is None:
            # Counters appear with or without `_total` depending on the client library version.
            alias = name[: -len("_total")] if name.endswith("_total") else f"{name}_total"
            series = self.samples.get(alias)
        if series is None:
            return None
        return sum(value for _, value in series if not math.isnan(value))

    def used_tokens(self) -> float | None:
        used = [p.used_tokens for p in self.pools]
        if not used or any(u is None for u in used):
            return None
        return float(sum(u for u in used if u is not None))


MAX_METRICS_BYTES = 4 * 1024 * 1024
"""The most of one /metrics page the operator reads. vLLM's and SGLang's pages are tens to
hundreds of KB; a hostile pod's 16 MB page held the operator's event loop 6.7 s per scrape, on
every reconcile pass (outside probe)."""


def index_samples(text: str) -> SampleIndex:
    """Every sample of a Prometheus exposition, keyed by its sample name (`*_total` kept)."""
    index: SampleIndex = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            index[sample.name].append((labels, float(sample.value)))
    return dict(index)


def _pool_key(labels: Labels) -> str:
    return ",".join(f"{k}={v}" for k, v in labels if k in _POOL_KEY_LABELS)


def _first_gauge(index: SampleIndex, name: str) -> float | None:
    series = index.get(name)
    return series[0][1] if series else None


def _paired_pools(
    index: SampleIndex, capacity_name: str, used_name: str | None, usage_fraction_name: str | None
) -> tuple[list[PoolReading], list[str]]:
    """The pools `capacity_name` reports, each with its usage, and the sizes it gives that are not
    finite numbers."""
    used_by_key = {_pool_key(labels): v for labels, v in index.get(used_name or "", [])}
    fraction_by_key = {_pool_key(labels): v for labels, v in index.get(usage_fraction_name or "", [])}
    pools, unreadable = [], []
    for labels, capacity in index.get(capacity_name, []):
        if not math.isfinite(capacity):  # no pool size (outside probe: NaN or +Inf crashed the CLI here)
            unreadable.append(f"{capacity_name}{dict(labels) or ''} = {capacity}")
            continue
        key = _pool_key(labels)
        used = used_by_key.get(key)
        if used is None and key in fraction_by_key:
            used = fraction_by_key[key] * capacity
        pools.append(PoolReading(key, int(capacity), used if used is None or math.isfinite(used) else None, capacity_name))
    return pools, unreadable


def _vllm_pools(index: SampleIndex) -> tuple[list[PoolReading], list[str]]:
    """The pools vLLM's cache info reports, and the sizes it gives that are not numbers."""
    usage: dict[str, float] = {}
    for name in VLLM_USAGE_NAMES:
        for labels, value in index.get(name, []):
            usage.setdefault(_pool_key(labels), value)
    pools, unreadable = [], []
    for labels, _ in index.get(VLLM_CACHE_INFO, []):
        info = dict(labels)
        capacity = _vllm_capacity(info)
        if capacity is None:
            if info.get("kv_cache_size_tokens") not in _NO_LABEL:  # a size, but not a number
                unreadable.append(f'{VLLM_CACHE_INFO}{{kv_cache_size_tokens="{info["kv_cache_size_tokens"]}"}}')
            continue
        key = _pool_key(labels)
        used = usage[key] * capacity if key in usage else None
        source = f"{VLLM_CACHE_INFO}{{{'kv_cache_size_tokens' if 'kv_cache_size_tokens' in info else 'num_gpu_blocks x block_size'}}}"
        pools.append(PoolReading(key, capacity, used, source))
    return pools, unreadable


_NO_LABEL = (None, "", "None")


def _vllm_capacity(info: dict[str, str]) -> int | None:
    try:
        if info.get("kv_cache_size_tokens") not in _NO_LABEL:
            return int(float(info["kv_cache_size_tokens"]))
        return int(info["num_gpu_blocks"]) * int(info["block_size"])
    except (KeyError, ValueError, OverflowError):  # absent, not a number, nan or inf
        return None


def snapshot_from_text(url: str, text: str) -> WorkerSnapshot:
    """Map one exposition onto a snapshot (pure)."""
    try:
        index = index_samples(text)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        # The parser's messages quote the offending text: clipped, one line of a pod condition.
        return WorkerSnapshot(url=url, error=f"unparseable metrics: {clip(' '.join(str(exc).split()), 200)}")
    snap = WorkerSnapshot(url=url, samples=index)  # (a counter gone infinite stays one: its probe fails on it)
    if any(name.startswith("kvguard_") for name in index):
        snap.engine = "kvguard"
        snap.pools, snap.unreadable_pools = _paired_pools(index, KVGUARD_CAPACITY, KVGUARD_USED, None)
        context = _first_gauge(index, KVGUARD_CONTEXT)
        snap.context_length = int(context) if context and math.isfinite(context) else None
    elif any(name.startswith("sglang:") for name in index):
        snap.engine = "sglang"
        snap.pools, snap.unreadable_pools = _paired_pools(index, SGLANG_CAPACITY, SGLANG_USED, SGLANG_USAGE)
    elif any(name.startswith("vllm:") for name in index):
        snap.engine = "vllm"
        snap.pools, snap.unreadable_pools = _vllm_pools(index)
    return snap


class _MemoryUsage(BaseModel):
    model_config = ConfigDict(extra="allow")
    token_capacity: int | None = None


class _InternalState(BaseModel):
    model_config = ConfigDict(extra="allow")
    memory_usage: _MemoryUsage | None = None


class SglangServerInfo(BaseModel):
    """The fields of SGLang's GET /server_info the canary reads."""

    model_config = ConfigDict(extra="allow")
    max_total_num_tokens: int | None = None
    context_length: int | None = None
    internal_states: list[_InternalState] = []


def pools_from_server_info(payload: Any) -> tuple[list[PoolReading], int | None]:
    """SGLang's /server_info: one pool per DP rank when reported, else the global figure (pure)."""
    try:
        info = SglangServerInfo.model_validate(payload)
    except ValidationError:
        return [], None
    per_rank = [
        PoolReading(f"dp_rank={i}", s.memory_usage.token_capacity, None, "/server_info internal_states")
        for i, s in enumerate(info.internal_states)
        if s.memory_usage and s.memory_usage.token_capacity
    ]
    if per_rank:
        return per_rank, info.context_length
    if info.max_total_num_tokens:
        return [PoolReading("", info.max_total_num_tokens, None, "/server_info max_total_num_tokens")], info.context_length
    return [], info.context_length


def server_base(metrics_url: str) -> str:
    return metrics_url[: -len("/metrics")] if metrics_url.endswith("/metrics") else metrics_url.rstrip("/")


async def fetch_snapshot(
    session: aiohttp.ClientSession, url: str, timeout_seconds: float, *, server_info: bool = True
) -> WorkerSnapshot:
    """Scrape one metrics URL; for SGLang without a capacity gauge, fall back to /server_info."""
    status, body, error = await get_text(session, url, timeout_seconds, limit=MAX_METRICS_BYTES)
    if error is not None or status != 200:
        return WorkerSnapshot(url=url, error=error or f"HTTP {status}")
    # prometheus_client's parser is pure Python (~0.4 s per MB here): on a thread, the operator's
    # loop -- every model's reconciles and watches -- keeps its turns while a big page parses.
    snap = await asyncio.to_thread(snapshot_from_text, url, body)
    if server_info and snap.engine == "sglang" and not snap.pools:
        await _add_server_info(session, snap, timeout_seconds)
    return snap


async def _add_server_info(session: aiohttp.ClientSession, snap: WorkerSnapshot, timeout: float) -> None:
    base = server_base(snap.url)
    for path in ("/server_info", "/get_server_info"):
        status, body, error = await get_text(session, base + path, timeout)
        if error is None and status == 200:
            payload, bad = parse_json_text(body)
            if bad is None:
                pools, context = pools_from_server_info(payload)
                used = snap.counter(SGLANG_USED)
                if len(pools) == 1 and used is not None:
                    pools = [PoolReading(pools[0].pool, pools[0].capacity_tokens, used, pools[0].source)]
                snap.pools = pools
                snap.context_length = snap.context_length or context
                return


async def fetch_all(
    session: aiohttp.ClientSession, urls: list[str], timeout_seconds: float, *, server_info: bool = True
) -> list[WorkerSnapshot]:
    return list(
        await asyncio.gather(
            *(fetch_snapshot(session, u, timeout_seconds, server_info=server_info) for u in urls)
        )
    )


def total_used_tokens(snapshots: list[WorkerSnapshot]) -> float | None:
    """Used KV tokens over all reachable workers that report usage; None when none do."""
    values = [s.used_tokens() for s in snapshots if s.reachable]
    known = [v for v in values if v is not None]
    return float(sum(known)) if known else None


def generated_tokens(snapshots: list[WorkerSnapshot]) -> dict[str, float]:
    """Tokens generated so far, by worker URL, for the reachable workers that expose a counter.
    By worker, so that a worker missing from one scrape does not read as a jump in the sum."""
    generated: dict[str, float] = {}
    for snap in snapshots:
        counts = [c for c in (snap.counter(n) for n in GENERATION_COUNTERS) if c is not None] if snap.reachable else []
        if counts:
            generated[snap.url] = sum(counts)
    return generated


def counter_totals(snapshots: list[WorkerSnapshot], names: list[str]) -> dict[str, float]:
    """Each counter summed over workers; counters no worker exposes are left out."""
    totals: dict[str, float] = {}
    for name in names:
        values = [s.counter(name) for s in snapshots if s.reachable]
        known = [v for v in values if v is not None]
        if known:
            totals[name] = float(sum(known))
    return totals
