"""How the real operator scales with the number of InferenceModels, against kmock.

    .venv/bin/python -P bench/operator_scale.py [--models 500] [--baseline 50] [--idle 60]

For each size (the baseline first, then --models), in a fresh emulator (tests/kmock_api.ApiServer:
resourceVersion, preconditions, selectors, server-side apply) and a fresh operator process
(`python -m kvguard operator`, the real kopf handlers and controller, one replica, its own
leader-election Lease), the bench creates N InferenceModels (the tiny CPU example) as fast as the
emulator takes them and measures:

- time until every model has a status (the operator planned, rendered, applied its children and
  wrote the status: Progressing / CanaryDeploying, since no kubelet ever makes pods ready);
- API requests per model per minute once idle: every request the emulator receives in a window
  of --idle seconds that starts once the operator has been quiet for --settle seconds (the models
  still wait for their Deployments, the most expensive kind of rest: requeues with backoff);
- the operator's resident memory (RSS and peak) at the end;
- what a restart costs: the operator is stopped and a new process started over the settled models;
  the requests it makes (Lease renewals aside) until it is quiet again. A new process applies each
  child once before it trusts it (a no-op on an unchanged object): an edit made while no operator
  led is undone.

Goals (issue 12): 500 models with a status in <= 120 s, <= 1 request/model/min idle, RSS <= 300 MB.
The ratio lines compare each figure with its goal and the large run with the baseline run (time
per model, N x baseline: 1.0 means linear; O(N^2) shows as N/baseline). The emulator runs in this
process and competes with the operator for the same cores: on a shared machine these are upper
bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import kmock as km
import yaml
from kmock._internal import apps

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from kmock_api import ApiServer, declare_kvguard_resources  # noqa: E402

NAMESPACE = "bench"
MODELS = km.resource("kvguard.io", "v1alpha1", "inferencemodels")
GOALS = {"seconds_to_status": 120.0, "requests_per_model_minute": 1.0, "rss_mb": 300.0}


@dataclass
class Figures:
    models: int
    seconds_to_status: float
    requests_per_model_minute: float
    idle_requests: int
    idle_seconds: float
    rss_mb: float
    peak_rss_mb: float
    requests_to_status: int
    restart_requests: int
    restart_seconds: float


def model_body(index: int) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": f"m{index:04d}", "namespace": NAMESPACE}
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}, "revision": "r1"}
    return body


def kubeconfig(url: str, folder: Path) -> Path:
    path = folder / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "bench",
        "clusters": [{"name": "bench", "cluster": {"server": url}}],
        "users": [{"name": "bench", "user": {}}],
        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}],
    }))  # fmt: skip
    return path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (clock ticks in /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def pass_stats(session_url: str) -> tuple[float, float, float]:
    """(passes, mean seconds per pass, mean seconds per API request) from the operator's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, session.get(session_url) as resp:
        text = await resp.text()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    count = samples.get("kvguard_operator_reconcile_seconds_count", 0.0)
    requests = samples.get("kvguard_operator_api_request_seconds_count", 0.0)
    return (count, samples.get("kvguard_operator_reconcile_seconds_sum", 0.0) / count if count else 0.0,
            samples.get("kvguard_operator_api_request_seconds_sum", 0.0) / requests if requests else 0.0)  # fmt: skip


async def passes_at_least(metrics_url: str, count: int, timeout: float) -> None:
    """Until the operator at `metrics_url` has run `count` passes (its /metrics may not answer yet)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            if (await pass_stats(metrics_url))[0] >= count:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the restarted operator's {count} passes")
        await asyncio.sleep(0.5)


def rss_mb(pid: int) -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def with_status(emulator: ApiServer) -> int:
    keys = [k for k in list(emulator.objects.keys()) if k[0] == MODELS]
    return sum(1 for k in keys if not emulator.objects[k].deleted and (emulator.objects[k].get("status") or {}).get("targetRevision"))


async def until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.2)


def model_traffic(emulator: ApiServer) -> int:
    """Requests about anything but the leader-election Lease (whose renewals never stop)."""
    return sum(n for (_, resource), n in emulator.requests_by.items() if resource != "leases")


async def quiet(emulator: ApiServer, settle: float, timeout: float) -> None:
    """Until nothing but Lease renewals arrived for `settle` seconds (the operator is at rest)."""
    deadline = time.monotonic() + timeout
    last, since = model_traffic(emulator), time.monotonic()
    while time.monotonic() - since < settle:
        if time.monotonic() > deadline:
            return  # not quiet: the idle window measures it as it is
        await asyncio.sleep(0.5)
        now = model_traffic(emulator)
        if now != last:
            last, since = now, time.monotonic()


async def run_one(models: int, idle: float, settle: float, timeout: float, log_dir: Path) -> Figures:
    async with ApiServer() as emulator, apps.Server(emulator) as server:
        declare_kvguard_resources(emulator, policies=True)
        emulator.keep_requests = 200  # kmock's log is only for the watch check below; counts are kept apart
        url = str(server.url).rstrip("/")
        metrics_port = free_port()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig(url, log_dir)), "KVGUARD_METRICS_PORT": str(metrics_port),
               "KVGUARD_LEASE_NAMESPACE": NAMESPACE, "POD_NAME": f"bench-{models}"}  # fmt: skip
        log = open(log_dir / f"operator-{models}.log", "w")  # noqa: SIM115 - closed below
        operator = start_operator(env, log_dir, log)
        restart_requests, restart_seconds = 0, 0.0
        try:
            await until(lambda: any("watch" in str(r.url) and "inferencemodels" in str(r.url) for r in list(emulator)), 60, "the operator's watch")
            async with aiohttp.ClientSession() as session:
                started, operator_cpu, emulator_cpu = time.monotonic(), cpu_seconds(operator.pid), time.process_time()
                for i in range(models):
                    async with session.post(f"{url}/apis/kvguard.io/v1alpha1/namespaces/{NAMESPACE}/inferencemodels", json=model_body(i)) as r:
                        assert r.status < 300, await r.text()
            await until(lambda: with_status(emulator) == models, timeout, f"all {models} models to have a status")
            seconds = time.monotonic() - started
            passes = await pass_stats(session_url=f"http://127.0.0.1:{metrics_port}/metrics")
            operator_cpu, emulator_cpu = cpu_seconds(operator.pid) - operator_cpu, time.process_time() - emulator_cpu
            to_status = emulator.requests_total - models  # the operator's (and kopf's) requests so far
            breakdown = dict(emulator.requests_by)
            await quiet(emulator, settle, timeout)
            before, began, idle_by = emulator.requests_total, time.monotonic(), collections.Counter(emulator.requests_by)
            await asyncio.sleep(idle)
            idle_requests, elapsed = emulator.requests_total - before, time.monotonic() - began
            idle_by = collections.Counter(emulator.requests_by) - idle_by
            rss, peak = rss_mb(operator.pid)
            await stop(operator)
            before, began = model_traffic(emulator), time.monotonic()
            operator = start_operator(env, log_dir, log)
            await until(lambda: model_traffic(emulator) > before, timeout, "the restarted operator's first request")
            # Every model passed once before the quiet window: read from requests alone, a restarted
            # operator still working through its first listing (no request for 10 s at 200 models,
            # on a loaded machine) looked at rest, and the figure left most of its work out.
            await passes_at_least(f"http://127.0.0.1:{metrics_port}/metrics", models, timeout)
            await quiet(emulator, settle, timeout)
            restart_requests, restart_seconds = model_traffic(emulator) - before, time.monotonic() - began - settle
        finally:
            await stop(operator)
            log.close()
    print(f"  {models} models, requests until every status, by (verb, resource): "
          + ", ".join(f"{m} {r}: {n}" for (m, r), n in sorted(breakdown.items(), key=lambda kv: -kv[1])[:12]), flush=True)  # fmt: skip
    print(f"  passes until every status: {passes[0]:.0f}, mean {passes[1] * 1000:.0f} ms each; "
          f"API requests {passes[2] * 1000:.0f} ms each (the operator's client)", flush=True)  # fmt: skip
    print(f"  CPU until every status: operator {operator_cpu:.1f} s, emulator (+ this bench) {emulator_cpu:.1f} s", flush=True)
    print("  idle window: " + (", ".join(f"{m} {r}: {n}" for (m, r), n in idle_by.most_common(8)) or "no request"), flush=True)
    print(f"  restart: {restart_requests} requests ({restart_requests / models:.1f} per model) in {restart_seconds:.1f} s", flush=True)
    return Figures(models, round(seconds, 1), round(idle_requests / models / (elapsed / 60), 4), idle_requests,
                   round(elapsed, 1), round(rss, 1), round(peak, 1), to_status, restart_requests, round(restart_seconds, 1))  # fmt: skip


def start_operator(env: dict[str, str], log_dir: Path, log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-P", "-m", "kvguard", "operator"], env=env, cwd=log_dir, stdout=log, stderr=subprocess.STDOUT)


async def stop(operator: subprocess.Popen[bytes]) -> None:
    if operator.poll() is not None:
        return
    operator.send_signal(signal.SIGTERM)
    try:  # off the loop: the emulator on it must answer the operator's last calls (its Lease)
        await asyncio.to_thread(operator.wait, 30)
    except subprocess.TimeoutExpired:
        operator.kill()


def report(base: Figures, big: Figures) -> dict[str, Any]:
    per_model = (big.seconds_to_status / big.models) / (base.seconds_to_status / base.models)
    ratios = {
        "time_vs_goal": round(big.seconds_to_status / GOALS["seconds_to_status"], 3),
        "idle_requests_vs_goal": round(big.requests_per_model_minute / GOALS["requests_per_model_minute"], 3),
        "rss_vs_goal": round(big.rss_mb / GOALS["rss_mb"], 3),
        "time_per_model_vs_baseline": round(per_model, 3),
        "requests_to_status_per_model_vs_baseline": round((big.requests_to_status / big.models) / (base.requests_to_status / base.models), 3),
        "restart_requests_per_model_vs_baseline": round((big.restart_requests / big.models) / max(base.restart_requests / base.models, 1e-9), 3),
    }
    return {"baseline": asdict(base), "run": asdict(big), "goals": GOALS, "ratios": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--baseline", type=int, default=50, help="models in the baseline run (same machine, same run)")
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of the idle window")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds without requests before the idle window")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="kvguard-scale-")  # the operator's logs stay there
    print(f"operator logs: {folder}", flush=True)
    if True:
        base = asyncio.run(run_one(args.baseline, args.idle, args.settle, args.timeout, Path(folder)))
        print(f"baseline  {base.models:5d} models: status in {base.seconds_to_status:7.1f} s, idle "
              f"{base.requests_per_model_minute:.3f} req/model/min, RSS {base.rss_mb:.0f} MB (peak {base.peak_rss_mb:.0f})", flush=True)  # fmt: skip
        big = asyncio.run(run_one(args.models, args.idle, args.settle, args.timeout, Path(folder)))
        print(f"run       {big.models:5d} models: status in {big.seconds_to_status:7.1f} s, idle "
              f"{big.requests_per_model_minute:.3f} req/model/min, RSS {big.rss_mb:.0f} MB (peak {big.peak_rss_mb:.0f})", flush=True)  # fmt: skip
    summary = report(base, big)
    for name, value in summary["ratios"].items():
        print(f"ratio {name}: {value}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
