"""Prometheus metrics of one engine, in its own registry (several engines can share a process).

The metric names are a contract: the canary suite and the operator read them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Requests in one forward pass: a decode worker whose batches run well below its concurrent
# requests is waiting on the request path (prefill, transfer, the router), not on its model.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ROUTER_LATENCY_BUCKETS = tuple(round(0.001 * 1.25**i, 6) for i in range(51))  # 1 ms .. 70 s, each 1.25x the last
"""The router's latency histograms, which a progressive rollout's analysis compares between
revisions with maxRatioToStable (1.5 by default): buckets 2-2.5x apart hid a 2x slower candidate
inside one bucket and failed an equal one whose percentile crossed an edge (outside probe); at
1.25x a percentile moves with the latencies, bucket by bucket."""
REQUEST_OUTCOMES = ("finished", "aborted", "failed", "rejected")  # kvguard_requests_total{outcome}
# kvguard_rejected_requests_total{reason}: the engine's intake refusals and the router's own.
REJECT_REASONS = ("context_length_exceeded", "invalid_value", "duplicate_request_id", "invalid_request_id")


def zeroed(counter: Counter, **values: Iterable[str]) -> Counter:
    """The counter with every combination of the given label values created at 0. A series that
    appears only at its first increment is invisible to rate() and increase() for that increment
    (outside probe: decode's first two client_disconnect aborts read as 0 in a 10-minute increase),
    so every value a label can take is exported from the start, as Prometheus' guidance asks."""
    names = list(values)
    for combination in itertools.product(*(list(v) for v in values.values())):
        counter.labels(**dict(zip(names, map(str, combination))))
    return counter


class EngineMetrics:
    """`kvguard_*` engine metrics. Servers register their own metrics in `self.registry` too."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.pool_capacity_tokens = Gauge(
            "kvguard_kv_pool_capacity_tokens", "Tokens the KV pool can hold.", registry=r)
        self.pool_used_tokens = Gauge(
            "kvguard_kv_pool_used_tokens", "Tokens of KV pool pages currently allocated.", registry=r)
        self.context_length_tokens = Gauge(
            "kvguard_context_length_tokens", "Maximum prompt + completion tokens per request.", registry=r)
        self.tag_violations = Counter(
            "kvguard_tag_violations_total", "Reads of KV pages not written for the reader (S1).", registry=r)
        self.rejected = zeroed(Counter(
            "kvguard_rejected_requests_total", "Requests rejected at intake, by reason.", ["reason"], registry=r),
            reason=REJECT_REASONS)
        self.requests = zeroed(Counter(
            "kvguard_requests_total", "Requests that ended, by outcome.", ["outcome"], registry=r), outcome=REQUEST_OUTCOMES)
        self.prompt_tokens = Counter(
            "kvguard_prompt_tokens_total", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter(
            "kvguard_generation_tokens_total", "Tokens generated.", registry=r)
        self.time_to_first_token = Histogram(
            "kvguard_time_to_first_token_seconds", "Arrival to first generated token.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "kvguard_inter_token_latency_seconds", "Time between consecutive generated tokens.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.running_requests = Gauge(
            "kvguard_running_requests", "Requests holding KV pages.", registry=r)
        self.waiting_requests = Gauge(
            "kvguard_waiting_requests", "Admitted requests waiting for KV pages.", registry=r)
        step_requests = Histogram(
            "kvguard_step_requests", "Requests in one forward pass, by phase (prefill: prompts computed; "
            "decode: one token generated for each).", ["phase"], buckets=BATCH_BUCKETS, registry=r)
        self.step_prompts, self.step_decodes = step_requests.labels("prefill"), step_requests.labels("decode")

    def exposition(self) -> bytes:
        """The Prometheus text format of this registry."""
        return generate_latest(self.registry)
