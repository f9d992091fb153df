"""manifests/monitoring (ServiceMonitor, PodMonitor, PrometheusRule, Grafana dashboard): it renders,
it scrapes what the operator renders, every metric it reads exists in the code, and the alerts fire
on the safety signals (S1, S3, S4, S5, S7) under `promtool test rules`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from test_manifests import by_kind, kubectl

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "manifests" / "monitoring"
RULES_TEST = Path(__file__).resolve().parent / "data" / "kvguard_rules_test.yaml"
# A metric name in PromQL: what the expressions *use*; the names they may use come from the code.
PROMQL_KVGUARD_NAME = re.compile(r"\bkvguard_[a-z0-9_]+")
# Sample names a family exposes in the Prometheus text format, by family type.
SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum", "_created")}


def render(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], check=True, capture_output=True, text=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return render(MONITORING)


@pytest.fixture(scope="module")
def rule_groups(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (rule,) = by_kind(rendered, "PrometheusRule")
    return rule["spec"]["groups"]


def alerts(groups: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for group in groups:
        yield from (r for r in group["rules"] if "alert" in r)


def engine_registries() -> tuple[CollectorRegistry, CollectorRegistry]:
    """A worker's registry (engine, transfer and control-auth metrics) and a router's, registered
    for real as the servers register them."""
    from kvguard.workers.control_auth import auth_failures_counter
    from kvguard.workers.metrics import EngineMetrics
    from kvguard.workers.router import RouterMetrics
    from kvguard.workers.transfer import TransferMetrics

    engine = EngineMetrics(CollectorRegistry())
    TransferMetrics.create(engine.registry)  # the servers put all three on one registry
    auth_failures_counter(engine.registry)
    return engine.registry, RouterMetrics(registry=CollectorRegistry()).registry


def registered_sample_names() -> set[str]:
    """Every sample name the code can expose: the engine's, the transfer layer's, the router's and
    the operator's metrics, registered for real and read back from their registries."""
    from kvguard.operator import metrics as operator_metrics

    registries = (*engine_registries(), operator_metrics.REGISTRY)
    families = [family for registry in registries for family in registry.collect()]
    return {family.name + suffix for family in families for suffix in SAMPLE_SUFFIXES[family.type]}


def dashboard_expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return exprs + [var["query"]["query"] for var in dashboard["templating"]["list"] if var["type"] == "query"]


def test_renders_every_kind_in_the_install_namespace(rendered: list[dict[str, Any]]) -> None:
    kinds = sorted(obj["kind"] for obj in rendered)
    assert kinds == ["ConfigMap", "PodMonitor", "PodMonitor", "PrometheusRule", "ServiceMonitor"]
    assert {obj["metadata"]["namespace"] for obj in rendered} == {"kvguard-system"}
    assert all(obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvguard" for obj in rendered)


def test_base_install_does_not_need_prometheus_operator() -> None:
    base = yaml.safe_load((ROOT / "manifests" / "kustomization.yaml").read_text())
    assert "monitoring" not in str(base.get("resources", [])) + str(base.get("components", []))


def test_dashboard_configmap_carries_the_file(rendered: list[dict[str, Any]]) -> None:
    (configmap,) = by_kind(rendered, "ConfigMap")
    assert configmap["metadata"]["name"] == "kvguard-grafana-dashboard"  # no hash suffix
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["kvguard.json"])
    assert dashboard == json.loads((MONITORING / "dashboards" / "kvguard.json").read_text())
    assert dashboard["uid"] == "kvguard"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_service_monitor_scrapes_the_operator_metrics_service(rendered: list[dict[str, Any]]) -> None:
    (monitor,) = by_kind(rendered, "ServiceMonitor")
    services = [s for s in by_kind(render(ROOT / "manifests"), "Service")
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]  # fmt: skip
    (endpoint,) = monitor["spec"]["endpoints"]
    scraped = [s for s in services if endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}]
    assert [s["metadata"]["name"] for s in scraped] == ["kvguard-operator-metrics"]
    (deployment,) = by_kind(render(ROOT / "manifests"), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    (port,) = [p for p in container["ports"] if p["name"] == scraped[0]["spec"]["ports"][0]["targetPort"]]
    assert str(port["containerPort"]) == env["KVGUARD_METRICS_PORT"]  # the port operator/handlers.py serves
    assert endpoint["honorLabels"] is True  # keeps kvguard_operator_kv_ratio's model namespace


def _selects(monitor: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    selector = monitor["spec"]["selector"]
    if not selector["matchLabels"].items() <= pod_labels.items():
        return False
    for expr in selector["matchExpressions"]:
        value = pod_labels.get(expr["key"])
        if (expr["operator"] == "Exists" and value is None) or (expr["operator"] == "In" and value not in expr["values"]):
            return False
    return True


@pytest.mark.parametrize("engine", ["kvguard", "sglang"])
def test_pod_monitors_scrape_every_rendered_engine_pod_once_on_its_metrics_port(rendered: list[dict[str, Any]], engine: str) -> None:
    from kvguard.operator.api import InferenceModel
    from kvguard.operator.planner import plan
    from kvguard.operator.render import Owner, render_revision

    monitors = by_kind(rendered, "PodMonitor")
    raw = yaml.safe_load((ROOT / "manifests/samples/tiny-cpu.yaml").read_text())
    if engine != "kvguard":
        raw["spec"]["engine"] = {"kind": engine, "image": "example/engine:1"}
        raw["spec"]["hardware"] = {"device": "cuda", "memoryPerDevice": "80Gi", "gpuProduct": "H100"}
    model = InferenceModel.model_validate(raw)
    objects = render_revision(model.spec, plan(model.spec), Owner("tiny-cpu", "ns", "uid-1"), "r1")
    deployments = by_kind(objects, "Deployment")
    assert len(deployments) == 3  # prefill, decode, router
    for deployment in deployments:
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        (monitor,) = [m for m in monitors if _selects(m, pod_labels)]  # scraped exactly once
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        ports = {p["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        assert endpoint["port"] == ("metrics" if engine == "kvguard" else "http")
        relabelled = {r["targetLabel"]: r["sourceLabels"][0] for r in endpoint["relabelings"]}
        for target, source in relabelled.items():  # Prometheus sanitizes `kvguard.io/role` to `kvguard_io_role`
            label = source.removeprefix("__meta_kubernetes_pod_label_")
            assert label in {re.sub(r"[^a-zA-Z0-9_]", "_", k) for k in pod_labels}, target
        assert {"model", "role", "revision"} <= set(relabelled)
        assert monitor["spec"]["namespaceSelector"] == {"any": True}  # models live in their own namespaces
    if engine != "kvguard":
        return
    for netpol in by_kind(objects, "NetworkPolicy"):  # every role: a labelled Prometheus namespace gets in
        metrics_rules = [r for r in netpol["spec"]["ingress"] if r.get("ports") == [{"protocol": "TCP", "port": 8001}]]
        scrapers = [f["namespaceSelector"]["matchLabels"] for r in metrics_rules for f in r["from"] if "namespaceSelector" in f]
        assert {"kvguard.io/metrics-scraper": "true"} in scrapers


# What prometheus-operator puts on every series of a PodMonitor's targets, besides its relabelings.
POD_MONITOR_TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint"}


def engine_label_names() -> dict[str, set[str]]:
    """metric family -> its label names, for every metric an engine pod (worker or router) exports."""
    collectors = [c for registry in engine_registries() for c in registry._collector_to_names]  # noqa: SLF001
    return {c._name: set(c._labelnames) for c in collectors if hasattr(c, "_labelnames")}  # noqa: SLF001


def test_no_engine_metric_label_clashes_with_a_label_the_scrape_adds(rendered: list[dict[str, Any]]) -> None:
    """Outside probe: kvguard_kv_transfers_total's `role` (sender/receiver) met the PodMonitor's
    `role` (the pod's); without honorLabels Prometheus keeps the target's and renames ours to
    `exported_role`, so a query on the documented label found nothing."""
    for monitor in by_kind(rendered, "PodMonitor"):
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert not endpoint.get("honorLabels"), "the pod's model/role/revision must win over an engine's own labels"
            added = POD_MONITOR_TARGET_LABELS | {r["targetLabel"] for r in endpoint["relabelings"]}
            clashes = {name: labels & added for name, labels in engine_label_names().items() if labels & added}
            assert clashes == {}, f"{monitor['metadata']['name']}: these labels would reach Prometheus as exported_*"


def test_every_metric_the_rules_and_dashboard_read_exists_in_the_code(rule_groups: list[dict[str, Any]]) -> None:
    known = registered_sample_names()
    dashboard = json.loads((MONITORING / "dashboards" / "kvguard.json").read_text())
    exprs = [rule["expr"] for rule in alerts(rule_groups)] + dashboard_expressions(dashboard)
    used = {name for expr in exprs for name in PROMQL_KVGUARD_NAME.findall(expr)}
    assert used - known == set()
    # the safety signals the alerts are for (S1, S3, S4, S5, S7)
    alerted = {name for rule in alerts(rule_groups) for name in PROMQL_KVGUARD_NAME.findall(rule["expr"])}
    assert {
        "kvguard_tag_violations_total", "kvguard_checksum_failures_total", "kvguard_hmac_failures_total",
        "kvguard_stale_writes_dropped_total", "kvguard_kv_pool_capacity_tokens", "kvguard_context_length_tokens",
        "kvguard_aborts_total", "kvguard_operator_blocked_plans_total", "kvguard_operator_kv_ratio",
    } <= alerted  # fmt: skip


def test_every_alert_names_its_invariant(rule_groups: list[dict[str, Any]]) -> None:
    for rule in alerts(rule_groups):
        invariant = rule["labels"]["invariant"]
        assert re.fullmatch(r"S[1-9]", invariant) and rule["labels"]["severity"] in ("critical", "warning")
        assert invariant in rule["annotations"]["summary"] + rule["annotations"]["description"], rule["alert"]


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.skip("no promtool: Debian's `prometheus` package has it (make installs it when apt-get exists)")
    return found


def write_rule_file(path: Path, groups: list[dict[str, Any]], *, annotations: bool) -> Path:
    if not annotations:
        groups = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]} for g in groups]
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def test_promtool_check_rules(rule_groups: list[dict[str, Any]], tmp_path: Path) -> None:
    rules = write_rule_file(tmp_path / "kvguard-rules.yaml", rule_groups, annotations=True)
    result = subprocess.run([promtool(), "check", "rules", str(rules)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(1 for _ in alerts(rule_groups))} rules found" in result.stdout


def test_promtool_alerts_fire_on_the_safety_signals(rule_groups: list[dict[str, Any]], tmp_path: Path) -> None:
    # promtool compares annotations verbatim; their templates are covered by `check rules` above.
    write_rule_file(tmp_path / "kvguard-rules.yaml", rule_groups, annotations=False)
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    result = subprocess.run([promtool(), "test", "rules", RULES_TEST.name], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULES_TEST.read_text()))
    assert tested == {rule["alert"] for rule in alerts(rule_groups)}  # every alert has a unit test


def test_every_outcome_cause_and_reason_counter_is_exported_at_0_from_the_start() -> None:
    """docs/monitoring.md: a series that appears only at its first increment is invisible to
    rate() and increase() for it. The ticket-rejection and control-auth-failure counters had no
    series until the first forged ticket or call (outside probe)."""
    # A counter without labels always has its sample; one with labels has none until a label value is made.
    unexported = [family.name for registry in engine_registries() for family in registry.collect()
                  if family.type == "counter" and not any(s.name.endswith("_total") for s in family.samples)]  # fmt: skip
    assert unexported == []
    worker, _ = engine_registries()
    assert worker.get_sample_value("kvguard_ticket_rejections_total", {"reason": "bad_mac"}) == 0
    assert worker.get_sample_value("kvguard_control_auth_failures_total", {"reason": "replay"}) == 0


async def test_the_operators_metrics_port_spends_no_thread_on_a_connection() -> None:
    """prometheus_client's threaded server started a thread per connection and kept it while the
    client stayed silent: 3,000 idle connections made 3,000 threads (outside probe). Served from
    the operator's loop, 300 idle connections cost none, and a scrape among them is answered."""
    import asyncio
    import threading

    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    from kvguard.operator import metrics as operator_metrics

    runner = await operator_metrics.serve(0, addr="127.0.0.1")
    try:
        host, port = runner.addresses[0][:2]
        threads = threading.active_count()
        idle = [await asyncio.open_connection(host, port) for _ in range(300)]
        async with aiohttp.ClientSession() as session, session.get(f"http://{host}:{port}/metrics") as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            names = {f.name for f in text_string_to_metric_families(await resp.text())}
        assert "kvguard_operator_reconciles" in names
        assert threading.active_count() <= threads  # no thread per connection
        for _, writer in idle:
            writer.close()
    finally:
        await runner.cleanup()
