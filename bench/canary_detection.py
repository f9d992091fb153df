"""Canary detection benchmark: run the default suite under each fault mode, on two engines.

kvguard: for every mode it starts `kvguard serve` with `KVGUARD_FAULTS` set (the stable revision,
without faults, runs beside it as the baseline URL), runs the suite with default settings, and
records the verdict, the failing probes and the time to verdict.

peer: `transformers serve` on the same model folder, behind the test-only fault proxy
(`tests/peer_harness.py`) in each of its modes (healthy, then one bug class each), with
`--context-length` given as for any server that does not advertise it.

For each engine it prints a table, the detection rate over the fault modes (goal 100%), whether
the fault-free run passed (no false alarm), and each mode's time to verdict against the fault-free
run measured in the same run and against the 30 s goal.

    .venv/bin/python bench/canary_detection.py [--engines kvguard,peer] [--model DIR] [--context-length N]

Exit status: 0 when every fault was detected by an expected probe and the clean runs passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvguard.operator.canary import CanaryReport, CanarySpec, Verdict, run_suite

GOAL_SECONDS = 30.0


@dataclass(frozen=True)
class FaultMode:
    faults: str  # KVGUARD_FAULTS value; "" = none
    expected_probes: frozenset[str]  # a detection must come from one of these (empty: must pass)
    observable: bool = True  # False: no black-box probe can see it (reported, not counted)


_OUTPUT_PROBES = frozenset({"golden", "determinism", "isolation", "abort"})

FAULT_MODES: tuple[FaultMode, ...] = (
    FaultMode("", frozenset()),
    # The incident: an over-length request is served from a placeholder and reads stale KV.
    FaultMode("unsafe_reject_path,no_tags", frozenset({"over_length"})),
    # Same engine with page tags: the stale read is caught, but the request was still admitted.
    FaultMode("unsafe_reject_path", frozenset({"over_length", "safety_counters"})),
    # Every chunk corrupted in flight and nothing verifies it: outputs change.
    FaultMode("corrupt_chunk=1,no_checksum", _OUTPUT_PROBES),
    # Some chunks corrupted, unverified: only some requests change. With 2 repeats the suite passed
    # such a build (1 chunk in 10) and it shipped (an outside probe); 30 catch 1 request in 10.
    FaultMode("corrupt_chunk=0.3,no_checksum", _OUTPUT_PROBES),
    # A client disconnect never reaches the workers: pages stay busy until the generation ends.
    FaultMode("no_abort_propagation", frozenset({"abort"})),
    # Decode skips the manifest check. While every chunk arrives, its output is byte-identical to a
    # correct engine's, so it is unobservable from outside on its own...
    FaultMode("ignore_manifest", _OUTPUT_PROBES | {"safety_counters"}, observable=False),
    # ...and shows as soon as a chunk goes missing: caught by page tags (errors, tag violations),
    # or, without tags, as silently wrong outputs.
    FaultMode("ignore_manifest,drop_chunk=0.3", _OUTPUT_PROBES | {"safety_counters"}),
    FaultMode("ignore_manifest,drop_chunk=0.3,no_tags", _OUTPUT_PROBES | {"safety_counters"}),
)


class ServeProcess:
    """`kvguard serve` as a child process: its API URL and metrics URLs, stopped with SIGINT."""

    def __init__(self, model: Path, *, faults: str = "", context_length: int | None = None,
                 kv_pool_tokens: int | None = None, start_timeout: float = 120.0) -> None:
        cmd = [sys.executable, "-m", "kvguard", "serve", "--model", str(model)]
        if context_length:
            cmd += ["--context-length", str(context_length)]
        if kv_pool_tokens:
            cmd += ["--kv-pool-tokens", str(kv_pool_tokens)]
        env = {**os.environ, "KVGUARD_FAULTS": faults} if faults else {k: v for k, v in os.environ.items() if k != "KVGUARD_FAULTS"}
        self.log = tempfile.NamedTemporaryFile(prefix="kvguard-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.url, self.metrics_urls = self._read_urls(start_timeout)

    def _read_urls(self, timeout: float) -> tuple[str, list[str]]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith("{"):
                    info = json.loads(line)
                    # Keep draining stdout so later output can never fill the pipe and block serve.
                    threading.Thread(target=self._drain, daemon=True).start()
                    metrics = info["metrics"]
                    return info["router"], list(metrics.values()) if isinstance(metrics, dict) else list(metrics)
            elif self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"kvguard serve did not start; log: {self.log.name}\n{Path(self.log.name).read_text()[-3000:]}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.stop()
        # The log is kept only when something went wrong, to be read; a clean run leaves nothing in /tmp.
        if exc_type is None:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)


def ensure_tiny_model(directory: Path) -> Path:
    if not (directory / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "kvguard", "model", "tiny", str(directory)], check=True,
                       stdout=subprocess.DEVNULL)
    return directory


def detected(mode: FaultMode, report: CanaryReport) -> bool:
    """A fault mode counts as detected when the suite failed and an expected probe says why."""
    failing = {p.value for p in report.failed_probes()}
    if not mode.expected_probes:
        return report.verdict == Verdict.PASS
    return report.verdict == Verdict.FAIL and bool(failing & mode.expected_probes)


async def run_mode(mode: FaultMode, model: Path, baseline_url: str, spec: CanarySpec,
                   context_length: int | None, kv_pool_tokens: int | None) -> CanaryReport:
    with ServeProcess(model, faults=mode.faults, context_length=context_length, kv_pool_tokens=kv_pool_tokens) as serve:
        return await run_suite(serve.url, spec, baseline_url=baseline_url, metrics_urls=serve.metrics_urls)


# The peer's fault-proxy modes (tests/peer_harness.py) and the probes that must name each one.
PEER_MODES: tuple[FaultMode, ...] = (
    FaultMode("healthy", frozenset()),
    FaultMode("over_length_accepted", frozenset({"over_length"})),
    FaultMode("spliced_content", frozenset({"isolation", "determinism", "golden"})),
    FaultMode("stream_no_finish", frozenset({"determinism", "abort"})),
    FaultMode("abort_as_length", frozenset({"determinism", "isolation", "golden", "abort"})),
    FaultMode("nondeterministic", frozenset({"determinism"})),
    FaultMode("pool_below_ratio", frozenset({"capacity"})),
)


def run_kvguard(model: Path, args: argparse.Namespace, spec: CanarySpec) -> list[tuple[FaultMode, CanaryReport]]:
    modes = [FAULT_MODES[int(i)] for i in args.modes.split(",")] if args.modes else list(FAULT_MODES)
    rows: list[tuple[FaultMode, CanaryReport]] = []
    with ServeProcess(model, context_length=args.context_length, kv_pool_tokens=args.kv_pool_tokens) as stable:
        for mode in modes:
            report = asyncio.run(run_mode(mode, model, stable.url, spec, args.context_length, args.kv_pool_tokens))
            rows.append((mode, report))
            print(f"  {mode.faults or 'no faults'}: {report.verdict.value} ({report.reason}) "
                  f"in {report.time_to_verdict_seconds:.1f} s", file=sys.stderr, flush=True)
    return rows


def run_peer(model: Path, context_length: int, spec: CanarySpec) -> list[tuple[FaultMode, CanaryReport]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from peer_harness import FaultProxy, PeerServer, transformers_serve_available

    missing = transformers_serve_available()
    if missing:
        print(f"peer: skipped: {missing}", file=sys.stderr)
        return []
    rows: list[tuple[FaultMode, CanaryReport]] = []
    with PeerServer(model) as peer:
        for mode in PEER_MODES:
            with FaultProxy(peer.url, model, context_length, mode.faults) as proxy:
                report = asyncio.run(run_suite(proxy.url, spec, metrics_urls=[proxy.metrics_url], context_length=context_length))
            rows.append((mode, report))
            print(f"  peer {mode.faults}: {report.verdict.value} ({report.reason}) in {report.time_to_verdict_seconds:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="kvguard,peer", help="kvguard, peer or both (default)")
    parser.add_argument("--model", type=Path, help="model folder (default: a fresh `kvguard model tiny`)")
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--kv-pool-tokens", type=int, default=8192)
    parser.add_argument("--modes", help="kvguard: comma-separated indexes into the mode list (default: all)")
    parser.add_argument("--json", type=Path, help="also write every report here")
    args = parser.parse_args()
    model = ensure_tiny_model(args.model or Path(tempfile.mkdtemp(prefix="kvguard-tiny-")))
    spec = CanarySpec()  # default settings: that is what the goal is about
    engines = {e.strip() for e in args.engines.split(",")}
    results: dict[str, list[tuple[FaultMode, CanaryReport]]] = {}
    clean_modes = {"kvguard serve (KVGUARD_FAULTS)": "", "transformers serve behind the fault proxy": "healthy"}
    if "kvguard" in engines:
        results["kvguard serve (KVGUARD_FAULTS)"] = run_kvguard(model, args, spec)
    if "peer" in engines:
        results["transformers serve behind the fault proxy"] = run_peer(model, args.context_length, spec)
    if args.json:
        args.json.write_text(json.dumps({k: [json.loads(r.to_json()) for _, r in v] for k, v in results.items()}, indent=2))
    status = 0
    for title, rows in results.items():
        print(f"\n== {title}")
        status |= print_summary(rows, clean_mode=clean_modes[title])
    return status


def print_summary(rows: list[tuple[FaultMode, CanaryReport]], clean_mode: str = "") -> int:
    clean = next((r for m, r in rows if m.faults == clean_mode), None)
    reference = clean.duration_seconds if clean else None
    print(f"{'FAULTS':<40} {'VERDICT':<10} {'DETECTED':<9} {'VERDICT S':>9} {'x CLEAN':>8}  FAILING PROBES")
    for mode, report in rows:
        ratio = f"{report.time_to_verdict_seconds / reference:.2f}" if reference else "-"
        failing = ",".join(p.value for p in report.failed_probes()) or "-"
        flag = str(detected(mode, report)).lower() + ("" if mode.observable else "*")
        print(f"{mode.faults or '(none)':<40} {report.verdict.value:<10} {flag:<9} "
              f"{report.time_to_verdict_seconds:>9.1f} {ratio:>8}  {failing}")
    faulty = [(m, r) for m, r in rows if m.faults != clean_mode and m.observable]
    hits = sum(detected(m, r) for m, r in faulty)
    worst = max((r.time_to_verdict_seconds for _, r in rows), default=0.0)
    print(f"detection rate: {hits}/{len(faulty)} = {100 * hits / max(1, len(faulty)):.0f}% of observable fault modes (goal 100%)")
    if any(not m.observable for m, _ in rows):
        print("* not observable alone (identical outputs while every chunk arrives); not counted")
    if clean is not None:
        print(f"fault-free engine: {clean.verdict.value} in {clean.duration_seconds:.1f} s")
    print(f"worst time to verdict: {worst:.1f} s = {worst / GOAL_SECONDS:.2f} x the {GOAL_SECONDS:g} s goal")
    ok = hits == len(faulty) and (clean is None or clean.verdict == Verdict.PASS)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
