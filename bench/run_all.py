"""Run every benchmark under bench/ as a subprocess and print one table of their headline ratios.

Each benchmark is run exactly as its row's command says (the command is printed beside the
number it produced) and its headline is parsed from its own output: its last-line JSON object when
it prints one, else the summary lines it prints. A benchmark that is missing, fails, times out or
prints nothing recognisable gets a row saying so; the others still run. With `--plot-dir`, PNGs
are written there: serving throughput vs concurrency and latency CDFs (from bench/serving.py) and
KV transfer goodput vs chunk size (from bench/transfer.py).

    .venv/bin/python bench/run_all.py [--quick] [--plot-dir bench/plots] [--only serving,transfer]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
Parsed = list[tuple[str, str, str]]  # (headline, value, goal)


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    args: tuple[str, ...]
    quick_args: tuple[str, ...]
    parse: Callable[[str], Parsed]
    timeout_s: float = 900.0


def last_json(output: str) -> dict | None:
    for line in reversed(output.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def parse_serving(output: str) -> Parsed:
    data = last_json(output) or {}
    if data.get("model", "tiny") != "tiny":  # the same goals on a model where compute matters
        return [(f"{head} ({data['model']} model)", value, goal) for head, value, goal in _serving_rows(data)]
    return _serving_rows(data)


def _serving_rows(data: dict) -> Parsed:
    rows = [
        ("kvguard serve (HTTP) / HF generate, mixed, 16 concurrent", data.get("http_vs_hf"), ">= 2.0"),
        ("kvguard serve (HTTP) / in-process engine, 16 concurrent", data.get("http_vs_inprocess"), ">= 0.8"),
        ("in-process engine / HF generate, mixed, 16 concurrent", data.get("inprocess_vs_hf"), ">= 3.0"),
        ("in-process engine / HF generate, 1 request", data.get("inprocess_vs_hf_1"), ">= 1.0"),
        ("TTFT p50 HTTP / in-process, 16 concurrent", data.get("ttft_ratio"), "<= 2.0"),
        ("HTTP / in-process at best on this machine (servers at the engine's CPU/token + the client's)",
         data.get("http_vs_inprocess_bound"), "-"),
        ("TTFT p50 HTTP with nothing queued (1 client) / in-process at 16", data.get("ttft_ratio_floor"), "-"),
        ("kvguard serve / transformers serve, 16 concurrent", data.get("http_vs_tfserve"), "-"),
        ("token channel / a stream per request (--token-channel off), 16 concurrent", data.get("channel_gain"), "-"),
        (f"kvguard serve --stream-interval {data.get('stream_interval')} / HF generate, mixed", data.get("http_si_vs_hf"), "-"),
        (f"kvguard serve --stream-interval {data.get('stream_interval')} / in-process, 16 concurrent",
         data.get("http_si_vs_inprocess"), "-"),
        (f"TTFT p50 --stream-interval {data.get('stream_interval')} / in-process, 16 concurrent", data.get("ttft_ratio_si"), "-"),
        ("kvguard serve, minimal client (diagnostic) / in-process, 16 concurrent", data.get("http_raw_vs_inprocess"), "-"),
        ("TTFT p50 minimal client (diagnostic) / in-process, 16 concurrent", data.get("ttft_ratio_raw"), "-"),
    ]
    out = [(h, f"{v:.2f}x", g) for h, v, g in rows if v is not None]
    startup = data.get("startup_s", {}).get("serve_default_first_answer_s")
    if startup is not None:
        out.append(("`kvguard serve --model DIR`: start to first answer", f"{startup:.1f} s", "< 5 s"))
    return out


def parse_tag_overhead(output: str) -> Parsed:
    data = last_json(output) or {}
    out = []
    if "ratio_cpu" in data:
        out.append(("tags on / off, decode tokens per CPU second", f"{data['ratio_cpu']:.4f}", ">= 0.99"))
    if "ratio" in data:
        out.append(("tags on / off, decode tokens per wall second (median)", f"{data['ratio']:.4f}", ">= 0.99"))
    share = re.search(r"tag work per decode step \(isolated\): (\d+) us = ([\d.]+)%", output)
    if share:
        out.append(("tag work per decode step, isolated", f"{share.group(2)}% ({share.group(1)} us)", "< 1%"))
    return out


TRANSFER_LINE = re.compile(  # aes-gcm's column is optional: older transfer.py runs printed none
    r"chunk\s+(\d+) KiB:(?:\s+aes-gcm\s+([\d.]+))?\s+checked\s+([\d.]+)\s+unchecked\s+([\d.]+)\s+raw\s+([\d.]+)")


@dataclass(frozen=True)
class TransferRow:
    """One chunk size's goodput (MB/s) as bench/transfer.py prints it."""

    kib: int
    aes_gcm: float | None
    checked: float
    unchecked: float
    raw: float


def transfer_rows(output: str) -> list[TransferRow]:
    return [TransferRow(int(m[1]), float(m[2]) if m[2] else None, float(m[3]), float(m[4]), float(m[5]))
            for m in TRANSFER_LINE.finditer(output)]


def parse_transfer(output: str) -> Parsed:
    out = []
    for row in transfer_rows(output):
        out.append((f"KV transfer checked / raw socket, {row.kib} KiB chunks", f"{row.checked / row.raw:.2f}", ">= 0.50"))
        out.append((f"KV transfer integrity cost, {row.kib} KiB chunks", f"{100 * (1 - row.checked / row.unchecked):.1f}%", "< 3%"))
        if row.aes_gcm is not None:
            out.append((f"KV transfer aes-gcm / checked, {row.kib} KiB chunks", f"{row.aes_gcm / row.checked:.2f}", "-"))
    return out


def parse_splitter(output: str) -> Parsed:
    data = last_json(output) or {}
    if "split_vs_direct" not in data:
        return []
    return [("through the local splitter / straight to the router, streamed requests/s", f"{data['split_vs_direct']:.3f}", "-"),
            ("TTFT p50 added by the splitter", f"{data['ttft_added_ms_p50']:.1f} ms", "-")]


def parse_planner(output: str) -> Parsed:
    return [(f"planner accuracy vs logged {m[1]} pools ({m[2]} rows), median / max |error|", f"{m[3]} / {m[4]}",
             "<= 3% / 10%")
            for m in re.finditer(r"^(\w+)\s+rows\s+(\d+)\s+median \|error\| ([\d.]+%)\s+max \|error\| ([\d.]+%)", output, re.M)]


def parse_canary(output: str) -> Parsed:
    out = []
    rate = re.search(r"detection rate: (\d+/\d+ = \d+%)", output)
    worst = re.search(r"worst time to verdict: ([\d.]+ s)", output)
    if rate:
        out.append(("canary detection rate, observable fault modes", rate.group(1), "100%"))
    if worst:
        out.append(("canary worst time to verdict", worst.group(1), "<= 30 s"))
    return out


def parse_adversarial(output: str) -> Parsed:
    worst = re.search(r"worst victim p50 under a single adversarial input: ([\d.]+x) idle", output)
    return [("a tenant's p50 under another's worst input / idle", worst.group(1), "<= 2x")] if worst else []


def parse_operator_scale(output: str) -> Parsed:
    data = last_json(output) or {}
    run, ratios = data.get("run", {}), data.get("ratios", {})
    if not ratios:
        return []
    models = run.get("models", "?")
    return [
        (f"operator, {models} models: seconds until every status / goal", f"{ratios['time_vs_goal']:.2f}", "<= 1"),
        (f"operator, {models} models: idle API requests per model-minute / goal", f"{ratios['idle_requests_vs_goal']:.2f}", "<= 1"),
        (f"operator, {models} models: RSS / goal", f"{ratios['rss_vs_goal']:.2f}", "<= 1"),
        ("operator: seconds to status per model, vs the baseline run", f"{ratios['time_per_model_vs_baseline']:.2f}", "~1 (linear)"),
    ]


def parse_request_cost(output: str) -> Parsed:
    data = last_json(output) or {}
    if "cpu_ratio" not in data:
        return []
    clients = data.get("clients", "?")
    return [(f"HTTP path CPU per request / the engine's, {clients} clients", f"{data['cpu_ratio']:.2f}", "-"),
            (f"HTTP TTFT / the CPU bound, {clients} clients", f"{data['ttft_vs_cpu_bound']:.2f}", "-")]


BENCHMARKS = (
    Benchmark("serving", "serving.py", (), ("--quick",), parse_serving, 1800),
    # The 25M model, where the matmuls matter: what the HTTP path costs when the engine is not
    # all Python overhead. hf, engine and http only (transformers serve alone would take minutes).
    Benchmark("serving_medium", "serving.py", ("--model", "medium", "--backends", "hf,engine,http"),
              ("--model", "medium", "--backends", "hf,engine,http", "--quick"), parse_serving, 1800),
    Benchmark("tag_overhead", "tag_overhead.py", ("--threads", "1"),
              ("--threads", "1", "--rounds", "3", "--prompt", "128", "--decode", "16"), parse_tag_overhead, 1800),
    Benchmark("tag_overhead_tiny", "tag_overhead.py", ("--model", "tiny", "--threads", "1", "--rounds", "8", "--decode", "64"),
              ("--model", "tiny", "--threads", "1", "--rounds", "4", "--decode", "64"), parse_tag_overhead, 600),
    Benchmark("transfer", "transfer.py", (), ("--rounds", "2", "--mib", "64"), parse_transfer, 900),
    Benchmark("splitter_overhead", "splitter_overhead.py", (), ("--rounds", "2", "--requests", "60"), parse_splitter, 600),
    Benchmark("planner_accuracy", "planner_accuracy.py", (), (), parse_planner, 300),
    Benchmark("canary_detection", "canary_detection.py", (), (), parse_canary, 900),
    Benchmark("adversarial_latency", "adversarial_latency.py", (), ("--victim-requests", "10"), parse_adversarial, 900),
    Benchmark("request_cost", "request_cost.py", (), ("--reps", "1", "--rounds", "10"), parse_request_cost, 600),
    Benchmark("operator_scale", "operator_scale.py", (),
              ("--models", "100", "--baseline", "20", "--idle", "20", "--settle", "5"), parse_operator_scale, 1800),
)


@dataclass
class Outcome:
    benchmark: Benchmark
    command: str
    rows: Parsed
    note: str = ""
    output: str = ""


def run_one(bench: Benchmark, quick: bool, extra: tuple[str, ...]) -> Outcome:
    script = BENCH / bench.script
    argv = [sys.executable, "-P", str(script), *(bench.quick_args if quick else bench.args), *extra]
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", f"bench/{bench.script}", *argv[3:]])
    if not script.is_file():
        return Outcome(bench, command, [], "skipped: bench/" + bench.script + " is absent")
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=bench.timeout_s)
    except subprocess.TimeoutExpired:
        return Outcome(bench, command, [], f"timed out after {bench.timeout_s:.0f} s")
    output = proc.stdout + proc.stderr
    rows = bench.parse(proc.stdout) if proc.returncode == 0 else []
    note = f"{time.monotonic() - start:.0f} s"
    if proc.returncode != 0:
        tail = (output.strip().splitlines() or ["no output"])[-1][:120]
        note = f"exit {proc.returncode}: {tail}"
    elif not rows:
        note = "ran, but printed no headline this parser knows"
    return Outcome(bench, command, rows, note, output)


def print_table(outcomes: list[Outcome]) -> None:
    width = max([len(r[0]) for o in outcomes for r in o.rows] + [40])
    print(f"\n{'headline':{width}}  {'value':>18}  {'goal':>12}")
    for outcome in outcomes:
        print(f"-- {outcome.benchmark.name}: {outcome.command}  ({outcome.note})")
        for headline, value, goal in outcome.rows:
            print(f"{headline:{width}}  {value:>18}  {goal:>12}")


def plot_transfer(output: str, folder: Path) -> Path | None:
    rows = transfer_rows(output)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    chunks = [r.kib for r in rows]
    series = [("checked (xxh3 + HMAC)", [r.checked for r in rows]), ("unchecked", [r.unchecked for r in rows]),
              ("raw socket", [r.raw for r in rows])]
    if all(r.aes_gcm is not None for r in rows):
        series.insert(0, ("aes-gcm (AES-256-GCM + HMAC)", [r.aes_gcm for r in rows]))
    for label, values in series:
        ax.plot(chunks, values, marker="o", label=label)
    ax.set(xscale="log", xlabel="chunk size (KiB)", ylabel="goodput (MB/s)", title="KV transfer goodput vs chunk size")
    ax.legend()
    fig.tight_layout()
    path = folder / "transfer_goodput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's short settings")
    parser.add_argument("--only", default=None, help="comma-separated benchmark names")
    parser.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    args = parser.parse_args()
    names = [b.name for b in BENCHMARKS]
    unknown = sorted(set(args.only.split(",")) - set(names)) if args.only is not None else []
    if unknown:
        parser.error(f"--only: no benchmark named {', '.join(unknown)} (there are: {', '.join(names)})")
    chosen = [b for b in BENCHMARKS if args.only is None or b.name in args.only.split(",")]
    outcomes = []
    for bench in chosen:
        extra: tuple[str, ...] = ()
        if bench.name == "serving" and args.plot_dir:
            extra = ("--plot-dir", str(args.plot_dir))
        if bench.name == "transfer" and not args.quick:
            extra = ("--chunk-kib", "16,64,256,1024,4096")
        print(f"running {bench.name} ...", flush=True)
        outcomes.append(run_one(bench, args.quick, extra))
    print_table(outcomes)
    if args.plot_dir:
        args.plot_dir.mkdir(parents=True, exist_ok=True)
        transfer = next((o for o in outcomes if o.benchmark.name == "transfer"), None)
        path = plot_transfer(transfer.output, args.plot_dir) if transfer else None
        written = sorted(p.name for p in args.plot_dir.glob("*.png"))
        print(f"plots in {args.plot_dir}: {', '.join(written) or 'none'}" + ("" if path else " (no transfer numbers)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
