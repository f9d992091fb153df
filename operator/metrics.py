"""The operator's own Prometheus metrics, served on their own port (default 8080).

Names: `kvguard_operator_reconciles_total{result}`, `kvguard_operator_blocked_plans_total{reason}`,
`kvguard_operator_kv_ratio{namespace,model,role}` (planned pool / context length of the target
revision, S7; removed with the model), `kvguard_operator_continuous_canary_failures_total`,
`kvguard_operator_reconcile_seconds`, `kvguard_operator_leader` (1 on the replica holding the
Lease), and `kvguard_operator_api_requests_total{verb,code}` with
`kvguard_operator_api_request_seconds` (kube.py). A private registry keeps them apart from
anything else imported into the process.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvguard.operator.api import KVPlan

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "kvguard_operator_reconciles",
    "Reconciles of InferenceModels by result (ok, blocked, invalid, error).",
    ["result"],
    registry=REGISTRY,
)
BLOCKED_PLANS = Counter(
    "kvguard_operator_blocked_plans",
    "Reconciles that refused a spec, by reason (KVPoolTooSmall, InvalidSpec, ...).",
    ["reason"],
    registry=REGISTRY,
)
CONTINUOUS_FAILURES = Counter(
    "kvguard_operator_continuous_canary_failures",
    "Continuous-canary runs against a serving revision that did not pass (verdict fail or cannot_run).",
    ["namespace", "model", "verdict"],
    registry=REGISTRY,
)
KV_RATIO = Gauge(
    "kvguard_operator_kv_ratio",
    "Planned KV pool / context length of the target revision, per model and role (S7).",
    ["namespace", "model", "role"],
    registry=REGISTRY,
)
LEADER = Gauge(
    "kvguard_operator_leader",
    "1 while this replica holds the leader Lease and drives rollouts, 0 while it stands by.",
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "kvguard_operator_reconcile_seconds",
    "Time of one reconcile including its API calls.",
    registry=REGISTRY,
)


def record_plan(namespace: str, model: str, plan: KVPlan | None) -> None:
    if plan is None:
        return
    for role, role_plan in plan.roles.items():
        KV_RATIO.labels(namespace, model, role).set(role_plan.ratio)


def forget_model(namespace: str, model: str) -> None:
    for role in ("prefill", "decode"):
        try:
            KV_RATIO.remove(namespace, model, role)
        except KeyError:
            pass
    for verdict in ("fail", "cannot_run"):
        try:
            CONTINUOUS_FAILURES.remove(namespace, model, verdict)
        except KeyError:
            pass


def forget_all_models() -> None:
    """A replica that stops leading exports no per-model series: the leader's are the truth, and
    a standby's would outlive the models deleted after it stepped down (alerts on ghosts)."""
    KV_RATIO.clear()
    CONTINUOUS_FAILURES.clear()


IDLE_TIMEOUT_S = 30.0
"""How long a metrics connection may stay idle, or take to send its request's headers."""


async def serve(port: int, addr: str = "0.0.0.0") -> web.AppRunner:
    """Serve /metrics on `port` from the operator's own event loop; returns the runner (cleaned up
    by the caller, or with the process). prometheus_client's threaded server started a thread per
    connection and kept it while the client stayed silent: 3,000 idle connections made 3,000
    threads (outside probe). Here a connection costs no thread, and an idle one is closed."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=IDLE_TIMEOUT_S)
    await runner.setup()
    await web.TCPSite(runner, addr, port).start()
    return runner
