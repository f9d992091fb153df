"""A tenant's small request while another tenant sends the worst inputs, against the same
tenant's latency on an idle deployment, in one run (issue 11; goal: within 2x of idle).

A real router + prefill + decode trio on loopback (tiny CPU model). The victim sends 4-token
completions one after another; per attack, attacker threads loop on their input while the victim
is measured. Attacks (each the input that stalled everyone before issue 11, or the worst one
still allowed):

- huge_stop: a 1 MB stop string (was O(len^2) per token on the engine thread: 114 s)
- worst_stops: 4 stop strings of the longest allowed length that the text keeps almost matching,
  900 tokens of generation (the worst the stop matcher still accepts)
- long_generation: the same 900-token generation without stop strings: the control that shows what
  sharing the engine with a long request costs, so worst_stops - long_generation is the matcher's cost
- huge_prompt: 10 MB (over the body limit) and 5 MB (over the prompt byte limit) prompts (were
  tokenized on the event loop: 39 s)
- long_prompt: the longest prompt that fits the context: legitimate maximal work, shown for
  scale (a concurrent request shares the engine with it by design), not part of the goal
- deep_json: JSON nested 100k deep (was a RecursionError, 500)
- slowloris: connections trickling header bytes (were held forever)
- all: every attack above at once

    .venv/bin/python bench/adversarial_latency.py [--victim-requests 20] [--attackers 2]

Prints one row per attack: the victim's p50 / p95 in ms idle (measured just before that attack: a
shared machine drifts) and under the attack, and their ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import requests

from kvguard.workers.launcher import LocalDeployment, LocalServeConfig
from kvguard.workers.tiny import write_tiny_model

Attack = Callable[[], object]


class Bench:
    def __init__(self, deployment: LocalDeployment) -> None:
        self.d = deployment
        self.session = requests.Session()
        self.model = self.session.get(f"{deployment.api_base}/models", timeout=30).json()["data"][0]["id"]

    def post(self, body: dict | bytes, session: requests.Session | None = None) -> requests.Response:
        session = session or requests.Session()
        if isinstance(body, bytes):
            return session.post(f"{self.d.api_base}/completions", data=body, timeout=300,
                                headers={"Content-Type": "application/json"})
        return session.post(f"{self.d.api_base}/completions", json=body, timeout=300)

    def victim(self, rounds: int) -> list[float]:
        took = []
        for i in range(rounds):
            started = time.perf_counter()
            answer = self.post({"model": self.model, "prompt": f"victim {i}", "max_tokens": 4, "temperature": 0}, self.session)
            assert answer.status_code == 200, answer.text
            took.append(time.perf_counter() - started)
        return took

    # -- the attacks -------------------------------------------------------------------------
    def attacks(self) -> dict[str, list[Attack]]:
        """Bodies are encoded once here: the attackers' own JSON encoding would compete for the CPU."""
        m = self.model
        text = self.post({"model": m, "prompt": "stall", "max_tokens": 900, "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
        stops = [text[: min(len(text), 1023 - i)] + chr(0x10FFF0 + i) for i in range(4)]
        bodies = {
            "huge_stop": [{"model": m, "prompt": "stall", "max_tokens": 200, "stop": "a" * 1_000_000}],
            "worst_stops": [{"model": m, "prompt": "stall", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stop": stops}],
            # control for worst_stops: the same generation without stop strings (what sharing costs)
            "long_generation": [{"model": m, "prompt": "stall", "max_tokens": 900, "temperature": 0, "ignore_eos": True}],
            "huge_prompt": [{"model": m, "prompt": "z" * 10_000_000}, {"model": m, "prompt": "z" * 5_000_000}],
            "long_prompt": [{"model": m, "prompt": [65] * (1024 - 5), "max_tokens": 4}],
        }
        attacks: dict[str, list[Attack]] = {
            name: [self._poster(json.dumps(body).encode()) for body in group] for name, group in bodies.items()
        }
        attacks["deep_json"] = [self._poster(b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")]
        host, port = self.d.router_url.removeprefix("http://").split(":")
        attacks["slowloris"] = [lambda: _slowloris(host, int(port), connections=100, seconds=5)]
        attacks["all"] = [a for name, group in attacks.items() if name != "long_generation" for a in group]
        return attacks

    def _poster(self, body: bytes) -> Attack:
        session = requests.Session()
        return lambda: self.post(body, session)


def _slowloris(host: str, port: int, connections: int, seconds: float) -> None:
    socks = []
    try:
        for _ in range(connections):
            sock = socket.create_connection((host, port), timeout=5)
            sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(sock)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.send(b"X")
            time.sleep(0.5)
    finally:
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def running(attacks: list[Attack], per_attack: int) -> Iterator[None]:
    stop = threading.Event()

    def loop(attack: Attack) -> None:
        while not stop.is_set():
            with contextlib.suppress(requests.RequestException, OSError):  # a refused upload may be cut short
                attack()

    threads = [threading.Thread(target=loop, args=(a,), daemon=True) for a in attacks for _ in range(per_attack)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # let the attack get going
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(300)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--victim-requests", type=int, default=20)
    parser.add_argument("--attackers", type=int, default=2, help="threads per attack input")
    parser.add_argument("--only", nargs="*", help="attacks to run (default: all)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "tiny", seed=0)
        config = LocalServeConfig(model_dir=model_dir, device="cpu", kv_pool_tokens=4096, context_length=1024)
        with LocalDeployment(config) as deployment:
            bench = Bench(deployment)
            bench.victim(5)  # warm up
            rows: dict[str, tuple[list[float], list[float]]] = {}  # attack -> (idle just before, under attack)
            for name, attack in bench.attacks().items():
                if args.only and name not in args.only:
                    continue
                idle = bench.victim(args.victim_requests)  # the baseline next to each attack: the machine drifts
                with running(attack, args.attackers):
                    rows[name] = (idle, bench.victim(args.victim_requests))
    print(f"{'attack':<13} {'idle p50':>9} {'p50 ms':>8} {'x idle':>7} {'idle p95':>9} {'p95 ms':>8} {'x idle':>7}")
    summary = {}
    for name, (idle, took) in rows.items():
        i50, i95, p50, p95 = statistics.median(idle), percentile(idle, 0.95), statistics.median(took), percentile(took, 0.95)
        summary[name] = {"idle_p50_ms": round(i50 * 1000, 1), "p50_ms": round(p50 * 1000, 1), "ratio_p50": round(p50 / i50, 2),
                         "idle_p95_ms": round(i95 * 1000, 1), "p95_ms": round(p95 * 1000, 1), "ratio_p95": round(p95 / i95, 2)}
        print(f"{name:<13} {i50 * 1000:>9.1f} {p50 * 1000:>8.1f} {p50 / i50:>7.2f} {i95 * 1000:>9.1f} {p95 * 1000:>8.1f} {p95 / i95:>7.2f}")
    print(json.dumps(summary))
    adversarial = [v["ratio_p50"] for k, v in summary.items() if k not in ("long_prompt", "long_generation", "all")]
    if adversarial:
        print(f"worst victim p50 under a single adversarial input: {max(adversarial):.2f}x idle (goal <= 2x)")
    if "worst_stops" in summary and "long_generation" in summary:
        cost = summary["worst_stops"]["p50_ms"] / summary["long_generation"]["p50_ms"]
        print(f"worst_stops vs the same generation without stop strings: {cost:.2f}x (the stop matcher's share)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
