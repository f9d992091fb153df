"""What the local splitter costs: the same streamed requests straight to a router and through
`kvguard splitter` in front of it, interleaved in one run.

A real `kvguard serve` trio (router, prefill, decode) on the tiny model, and a real `kvguard
splitter` process whose table sends 100% to that router. Closed loop: CONCURRENCY aiohttp clients,
each streaming completions of MAX_TOKENS greedy tokens, in alternating rounds (direct, split,
direct, ...) so that drift of a shared machine hits both sides alike. Prints per-round figures,
then one JSON line: `split_vs_direct` (request throughput ratio) and `ttft_added_ms_p50` (TTFT
p50 through the splitter minus direct). Results: bench/README.md.

    .venv/bin/python -P bench/splitter_overhead.py [--rounds 3] [--requests 120] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kvguard.workers.launcher import LocalDeployment, LocalServeConfig
from kvguard.workers.splitter import SplitBackend, SplitTable, write_table

MAX_TOKENS = 16
PROMPT = "The capital of France is"


async def one(session: aiohttp.ClientSession, url: str, model: str) -> float:
    """Stream one completion; the seconds to its first chunk."""
    started = time.perf_counter()
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    first = None
    async with session.post(f"{url}/completions", json=body) as resp:
        resp.raise_for_status()
        async for _ in resp.content.iter_any():
            first = first or time.perf_counter() - started
    return first or time.perf_counter() - started


async def round_of(url: str, model: str, requests: int, concurrency: int) -> tuple[float, list[float]]:
    """(requests per second, TTFTs) of one closed-loop round."""
    ttfts: list[float] = []
    left = iter(range(requests))
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            for _ in left:
                ttfts.append(await one(session, url, model))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return requests / (time.perf_counter() - started), ttfts


def wait_listening(url: str, timeout_s: float = 120.0) -> None:
    import requests as http

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http.get(f"{url}/models", timeout=2).status_code == 200:
                return
        except http.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        subprocess.run([sys.executable, "-P", "-m", "kvguard", "model", "tiny", str(root / "tiny")], check=True, stdout=subprocess.DEVNULL)
        with LocalDeployment(LocalServeConfig(model_dir=root / "tiny", log_dir=root)) as trio:
            direct = trio.api_base
            write_table(root / "split.json", SplitTable(backends=(SplitBackend(revision="bench", url=trio.router_url, weight=100),)))
            ports = [str(p) for p in _free_ports(2)]
            splitter = subprocess.Popen([sys.executable, "-P", "-m", "kvguard", "splitter", "--table", str(root / "split.json"),
                                         "--port", ports[0], "--metrics-port", ports[1]], env=dict(os.environ),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            try:
                split = f"http://127.0.0.1:{ports[0]}/v1"
                wait_listening(direct)
                wait_listening(split)
                import requests as http

                model = http.get(f"{direct}/models", timeout=5).json()["data"][0]["id"]
                asyncio.run(round_of(direct, model, 16, args.concurrency))  # warm-up, both paths
                asyncio.run(round_of(split, model, 16, args.concurrency))
                results: dict[str, list[tuple[float, list[float]]]] = {"direct": [], "split": []}
                for i in range(args.rounds):
                    for name, url in (("direct", direct), ("split", split)) if i % 2 == 0 else (("split", split), ("direct", direct)):
                        rate, ttfts = asyncio.run(round_of(url, model, args.requests, args.concurrency))
                        results[name].append((rate, ttfts))
                        print(f"round {i + 1} {name:<6} {rate:7.1f} req/s  TTFT p50 {statistics.median(ttfts) * 1000:6.1f} ms", flush=True)
            finally:
                splitter.terminate()
                splitter.wait(10)
    rate = {k: statistics.median(r for r, _ in v) for k, v in results.items()}
    ttft = {k: statistics.median(t for _, ts in v for t in ts) * 1000 for k, v in results.items()}
    print(json.dumps({"split_vs_direct": round(rate["split"] / rate["direct"], 3), "ttft_added_ms_p50": round(ttft["split"] - ttft["direct"], 2),
                      "direct_req_s": round(rate["direct"], 1), "split_req_s": round(rate["split"], 1),
                      "concurrency": args.concurrency, "requests_per_round": args.requests, "rounds": args.rounds}))  # fmt: skip
    return 0


def _free_ports(n: int) -> list[int]:
    import socket
    from contextlib import ExitStack

    with ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


if __name__ == "__main__":
    sys.exit(main())
