"""What one request costs each process of `kvguard serve`, and what that does to TTFT under a burst.

Issue 14's TTFT goal (HTTP p50 <= 2x the in-process engine's at 16 concurrent) is missed; this
says why in numbers. Every client of a closed loop of `C` sends the same short request (a 64-token
prompt, 2 new tokens: almost all of the work is per request, not per token) through the minimal
aiohttp client of bench/serving.py's `http-raw`, and the CPU time each server process spent is
divided by the requests it served. The in-process engine runs the same loop in the same run, as
the baseline. Where the HTTP path's TTFT at 16 is close to `16 x (server CPU per request) /
cores / 2` (the median request waits for half the burst's work), TTFT there is bound by CPU per
request, not by waiting on any one hop: only doing less per request moves it.

    .venv/bin/python bench/request_cost.py [--concurrency 1,4,16] [--rounds 20] [--reps 2]

Last line: one JSON object, at the largest `clients` (`cpu_ratio`: HTTP server CPU per request / in-process;
`ttft_ratio`; `ttft_vs_cpu_bound`: HTTP TTFT p50 / the CPU-bound estimate above).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import (  # noqa: E402 - bench/ is not a package
    EngineBackend,
    RawHTTPBackend,
    Result,
    Scenario,
    Server,
    WorkItem,
    cpu_seconds,
    model_folder,
    start_kvguard,
)

from kvguard.workers.tiny import BOS_ID  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS = 64, 2
POOL_TOKENS = 64 * 1024


def roles(server: Server) -> dict[str, int]:
    """The pid of each process of `kvguard serve` by its role (the launcher itself included)."""
    server.refresh_pids()
    found = {}
    for pid in server.pids:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        role = argv[argv.index(b"--role") + 1].decode() if b"--role" in argv else "launcher"
        found[role] = pid
    return found


def burst(concurrency: int, rounds: int) -> Scenario:
    prompt = (BOS_ID, *(32 + i % 95 for i in range(PROMPT_TOKENS - 1)))
    items = tuple(WorkItem(i, prompt, NEW_TOKENS) for i in range(concurrency * rounds))
    return Scenario(f"closed-{concurrency}", items, concurrency=concurrency)


def ttft_ms(result: Result) -> float:
    return result.summary()["ttft_p50_ms"]


def measure(http: RawHTTPBackend, pids: dict[str, int], engine: EngineBackend, scenario: Scenario) -> dict[str, float]:
    """One closed loop through each backend: TTFT p50 and CPU ms per request (HTTP: per process)."""
    before = {role: cpu_seconds([pid]) for role, pid in pids.items()}
    over_http = http.run(scenario)
    requests = len(scenario.items)
    row = {f"{role}_ms": 1e3 * (cpu_seconds([pid]) - before[role]) / requests for role, pid in pids.items()}
    row["server_ms"] = sum(row.values())  # every process of `kvguard serve`, the launcher included
    in_process = engine.run(scenario)
    row |= {"http_ttft_ms": ttft_ms(over_http), "engine_ttft_ms": ttft_ms(in_process),
            "engine_ms": 1e3 * in_process.cpu_s / requests}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,16", help="closed-loop client counts")
    parser.add_argument("--rounds", type=int, default=20, help="requests per client")
    parser.add_argument("--reps", type=int, default=2, help="repetitions (medians are reported)")
    parser.add_argument("--device", default="cpu", help="where the engine runs: cpu (default) or cuda[:N]")
    args = parser.parse_args()
    torch.set_num_threads(1)
    levels = [int(c) for c in args.concurrency.split(",")]
    cores = len(os.sched_getaffinity(0))
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-request-cost-"))
    server = None
    try:
        model_dir = model_folder("tiny", tmp)
        server, url = start_kvguard(model_dir, POOL_TOKENS, args.device)
        http = RawHTTPBackend("http-raw", server, url, model_dir.name, token_prompts=True)
        engine = EngineBackend(model_dir, POOL_TOKENS, args.device)
        pids = roles(server)
        rows: dict[int, list[dict[str, float]]] = {c: [] for c in levels}
        for _ in range(args.reps):
            for c in levels:
                rows[c].append(measure(http, pids, engine, burst(c, args.rounds)))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{cores} cores; closed loops of {args.rounds} requests per client, {PROMPT_TOKENS}-token prompts, "
          f"{NEW_TOKENS} new tokens; CPU ms per request, medians of {args.reps}")
    print(f"{'clients':>7} {'router':>7} {'prefill':>8} {'decode':>7} {'servers':>8} {'engine':>7} "
          f"{'TTFT http':>10} {'engine':>7} {'CPU bound':>10}")
    summary: dict[int, dict[str, float]] = {}
    for c in levels:
        med = {k: statistics.median(r[k] for r in rows[c]) for k in rows[c][0]}
        med["cpu_bound_ms"] = c * med["server_ms"] / cores / 2
        summary[c] = med
        print(f"{c:>7} {med.get('router_ms', 0):7.2f} {med.get('prefill_ms', 0):8.2f} {med.get('decode_ms', 0):7.2f} "
              f"{med['server_ms']:8.2f} {med['engine_ms']:7.2f} {med['http_ttft_ms']:8.1f}ms {med['engine_ttft_ms']:5.1f}ms "
              f"{med['cpu_bound_ms']:8.1f}ms")
    top = summary[max(levels)]
    print(json.dumps({
        "clients": max(levels),
        "cpu_ratio": round(top["server_ms"] / top["engine_ms"], 2),
        "ttft_ratio": round(top["http_ttft_ms"] / top["engine_ttft_ms"], 2),
        "ttft_vs_cpu_bound": round(top["http_ttft_ms"] / top["cpu_bound_ms"], 2),
        "server_ms_per_request": {c: round(s["server_ms"], 2) for c, s in summary.items()},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
