"""`kvguard canary`: run the canary coherence suite against an OpenAI-compatible deployment.

Exit status: 0 every enabled probe passed (or was skipped with a reason), 1 a probe failed,
2 the suite cannot run (unreachable target, baseline or metrics URLs, a URL that is not http://
or https:// with a host, an --engine-log that is not a readable file, bad spec file, unknown
probe, a --timeout or --context-length out of range, or every probe skipped) - with the reason on
stderr; 130 interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from kvguard.interrupts import run_interruptible, stop_signals_as_one_interrupt
from kvguard.workers.pool_ratio import DEFAULT_MIN_KV_RATIO

EXIT_PASS, EXIT_FAIL, EXIT_CANNOT_RUN = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EVIDENCE_ROWS = 4  # per failing probe in the table; -o json has all of it


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "canary",
        help="prove a deployment's outputs are coherent and isolated",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", required=True, help="API base URL of the deployment under test")
    parser.add_argument("--baseline-url", help="API base URL of the stable revision serving the same model: golden "
                        "equality, and the only way the isolation probe tells a prefix-cache collision (tenants given "
                        "one answer even alone) from a model that answers them alike; without it, that is a note")  # fmt: skip
    parser.add_argument(
        "--metrics-url", action="extend", nargs="+", default=[], metavar="URL",
        help="a worker's Prometheus /metrics URL (repeatable); enables capacity, pool and counter checks",
    )
    parser.add_argument(
        "--spec", type=Path, metavar="FILE.yaml",
        help="CanarySpec as YAML (or an InferenceModel manifest: its spec.canary is used)",
    )
    parser.add_argument(
        "--context-length", type=int, metavar="N",
        help="the target's context length, for servers that do not advertise it (overrides spec.contextLength)",
    )
    parser.add_argument(
        "--engine-log", action="append", default=[], type=Path, metavar="FILE",
        help="an engine's log file (repeatable): SGLang KV-canary violations logged during the run fail the suite",
    )
    parser.add_argument(
        "--baseline-match", choices=("exact", "tolerant"),
        help="compare with the baseline by exact text, or by logprobs when numerics differ (golden.baselineMatch)",
    )
    parser.add_argument("--probes", help="comma-separated probes to run (default: all enabled in the spec)")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.add_argument("--timeout", type=float, metavar="S", help="overall time limit for the suite, seconds")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with stop_signals_as_one_interrupt():  # SIGTERM ends it as Ctrl-C does: one line, exit 130
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from kvguard.operator.canary import Verdict, run_suite

    try:
        spec = _load_spec(args.spec, args.probes)
    except ValueError as exc:
        print(f"kvguard canary: cannot run: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if (problem := _bad_urls(args) or _bad_numbers(args) or _unreadable_log(args.engine_log)) is not None:
        print(f"kvguard canary: cannot run: {problem}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if args.baseline_match:
        spec = spec.model_copy(update={"golden": spec.golden.model_copy(update={"baseline_match": args.baseline_match})})
    table = args.output == "table"
    progress_stream = sys.stdout if table else (sys.stderr if sys.stderr.isatty() else None)
    printer = _ProgressPrinter(progress_stream) if progress_stream else None
    if printer:
        printer.header(args.url)
    try:
        report = run_interruptible(
            lambda: run_suite(
                args.url, spec, baseline_url=args.baseline_url, metrics_urls=args.metrics_url,
                progress=printer.on_event if printer else None, timeout_seconds=args.timeout,
                context_length=args.context_length, engine_logs=args.engine_log,
            )
        )
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's convention, not a traceback
        print("\nkvguard canary: interrupted; no verdict", file=sys.stderr)
        return EXIT_INTERRUPTED
    if table:
        _print_verdict(report, sys.stdout)
    else:
        print(report.to_json())
    if report.verdict == Verdict.CANNOT_RUN:
        print(f"kvguard canary: cannot run: {report.reason}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    return EXIT_PASS if report.verdict == Verdict.PASS else EXIT_FAIL


def _bad_urls(args: argparse.Namespace) -> str | None:
    """Why --url, --baseline-url or a --metrics-url is not an http(s) URL with a host, or None
    (`--url notaurl` was run, and failed as "InvalidUrlClientError: notaurl/v1/models")."""
    from urllib.parse import urlsplit

    named = [("--url", args.url)] + ([("--baseline-url", args.baseline_url)] if args.baseline_url is not None else [])
    for flag, url in named + [("--metrics-url", url) for url in args.metrics_url]:
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError on a port that is not one (`:99999`, `:x`)
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            return f"{flag} {url[:200]!r} is not an http:// or https:// URL with a host (e.g. http://127.0.0.1:8000/v1)"
    return None


def _bad_numbers(args: argparse.Namespace) -> str | None:
    """Why --timeout or --context-length is unusable, or None. `nan` and `inf` parse as floats: nan
    made every request time out at once, inf overflowed the timers."""
    from kvguard.operator.canary.spec import MAX_CONTEXT_TOKENS, MAX_TIMEOUT_SECONDS, MIN_CONTEXT_TOKENS

    if args.timeout is not None and not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_SECONDS):
        return f"--timeout must be a positive number of seconds, at most {MAX_TIMEOUT_SECONDS:g}"
    if args.context_length is not None and not MIN_CONTEXT_TOKENS <= args.context_length <= MAX_CONTEXT_TOKENS:
        return f"--context-length must be between {MIN_CONTEXT_TOKENS} and {MAX_CONTEXT_TOKENS:,} tokens"
    return None


def _unreadable_log(paths: list[Path]) -> str | None:
    """Why an --engine-log cannot be read, or None. A log that is not there would read as "no
    violation logged": a typo in its path must not turn into a pass."""
    for path in paths:
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "does not exist"
            return f"--engine-log {path} {what}"
        try:
            with path.open("rb"):
                pass
        except OSError as exc:
            return f"--engine-log {path}: {exc.strerror or exc}"
    return None


def _load_spec(path: Path | None, probes: str | None) -> Any:
    """The spec from YAML (field-level messages on error) with --probes applied."""
    from pydantic import ValidationError

    from kvguard.operator.canary import CanarySpec, ProbeName
    from kvguard.yaml_files import load_all

    data: Any = {}
    if path is not None:
        documents = load_all(path)  # YAMLFileError is a ValueError: one line, naming the file and line
        if len(documents) > 1:
            raise ValueError(f"{path}: {len(documents)} YAML documents; a canary spec is one")
        data = documents[0] if documents else {}
        if isinstance(data, dict) and "kind" in data:
            data = _gate_repetitions(_model_canary(_model_spec(path, data)))
    try:
        spec = CanarySpec.model_validate(data)
        if probes is not None:
            named = [ProbeName.parse(p) for p in probes.split(",") if p.strip()]
            if not named:  # `--probes ""` (an unset variable) ran every probe: it names none
                raise ValueError(f"--probes names no probe; the probes are {', '.join(p.value for p in ProbeName)}")
            spec = spec.only(named)
    except ValidationError as exc:
        where = f"{path}: " if path else ""
        raise ValueError(where + _field_errors(exc)) from None
    return spec


def _model_spec(path: Path, manifest: dict[str, Any]) -> Any:
    """An InferenceModel manifest's spec, refused by field as `plan` and `apply` refuse it: another
    kind was read as a CanarySpec ("apiVersion: Extra inputs are not permitted; ..."), and a
    misspelled field outside spec.canary (`contextLenght`) ran the canary anyway (a new user's
    report). Only the spec: a manifest read back from a cluster carries status and server fields;
    and a field left out is no error here: a manifest holding only spec.canary is a canary spec."""
    from pydantic import ValidationError

    from kvguard.operator.api import InferenceModelSpec

    kind = manifest.get("kind")
    if kind != "InferenceModel":
        raise ValueError(f"{path}: kind: {str(kind)[:60]!r}, expected InferenceModel (or a CanarySpec, which has no kind)")
    spec = manifest.get("spec") or {}
    try:
        whole = InferenceModelSpec.model_validate(spec)
    except ValidationError as exc:
        wrong = [err for err in exc.errors() if err["type"] != "missing"]
        if wrong:
            raise ValueError(f"{path}: " + _field_errors(wrong, prefix="spec.")) from None
        return spec
    # A whole spec: the canary's fields against the rest, as admission judges them (a review: a
    # longRequestMaxTokens over contextLength ran here, where plan refuses the file).
    from kvguard.operator.spec_checks import canary_problems

    if problems := canary_problems(whole):
        raise ValueError(f"{path}: " + "; ".join(problems))
    return spec


def _model_canary(spec: Any) -> Any:
    """An InferenceModel's spec.canary, with capacity.minRatio defaulting to the model's minKVRatio
    as the operator runs it (InferenceModelSpec): judged by 2, a pool the planner passed at
    minKVRatio 1.5 failed here. A manifest without minKVRatio has the model's default, which caps
    a written minRatio as well (a docs review: minRatio 3 ran at 3 where the operator runs 2)."""
    canary = (spec.get("canary") or {}) if isinstance(spec, dict) else {}
    ratio = spec.get("minKVRatio", DEFAULT_MIN_KV_RATIO) if isinstance(spec, dict) else None
    if ratio is None or not isinstance(canary, dict):
        return canary  # a bad shape is refused by field
    capacity = canary.get("capacity")
    if capacity is None:
        return {**canary, "capacity": {"minRatio": ratio}}
    if isinstance(capacity, dict) and capacity.get("minRatio") is None:
        return {**canary, "capacity": {**capacity, "minRatio": ratio}}
    written = capacity.get("minRatio") if isinstance(capacity, dict) else None
    if isinstance(written, int | float) and isinstance(ratio, int | float) and written > ratio:
        # As the operator runs it (InferenceModelSpec.canary_to_run): a manifest read back from a
        # cluster holds an older CRD's default of 2, whatever its minKVRatio (a review).
        return {**canary, "capacity": {**capacity, "minRatio": ratio}}
    return canary


def _gate_repetitions(canary: Any) -> Any:
    """A manifest's determinism repeats as the operator's gate runs them: at least GATE_REPETITIONS
    (InferenceModelSpec.canary_to_run). A model read back from a cluster holds an older CRD's 2,
    which ran here where the gate runs 30 (a review). A CanarySpec file runs what it says."""
    from kvguard.operator.canary.spec import GATE_REPETITIONS

    determinism = canary.get("determinism") if isinstance(canary, dict) else None
    if not isinstance(determinism, dict):
        return canary  # the default, or a bad value refused by field
    repetitions = determinism.get("repetitions")
    if not isinstance(repetitions, int) or isinstance(repetitions, bool) or repetitions >= GATE_REPETITIONS:
        return canary
    return {**canary, "determinism": {**determinism, "repetitions": GATE_REPETITIONS}}


def _field_errors(exc: Any, prefix: str = "") -> str:
    """`field: message; ...` for a ValidationError (or a list of its errors)."""
    from kvguard.workers.field_messages import field_line

    parts = []
    for err in exc if isinstance(exc, list) else exc.errors():
        # A list index in brackets, as the operator's webhook writes paths (reconcile.field_errors).
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        parts.append(field_line(prefix + loc if loc else prefix.rstrip("."), err, whole="spec"))
    return "; ".join(parts)


TABLE_HEADER = f"{'PROBE':<16} {'STATUS':<8} {'TIME':>7}  REASON"


def probe_row(result: Any) -> str:
    """One probe's row of the result table."""
    return f"{result.name.value:<16} {result.status.value:<8} {result.duration_seconds:>6.1f}s  {result.reason}"


LEFT_OUT = " not checked"
"""How a note words a check the probe could not make (a path the server does not serve, cases it
could not size, a collision without a baseline): such notes make a passing row narrower than it
reads, so the table shows them. Notes on cases skipped by the spec's own limits (maxPromptBytes)
or on a server's missing extras (logprobs, a KV pool metric) stay in -o json."""


def evidence_rows(result: Any, where_more: str = "see -o json") -> list[str]:
    """The evidence lines under a failed probe's row (the first EVIDENCE_ROWS pieces); under any
    other row, its notes on cases left out (an outside probe: a run the docs call incomplete,
    usage missing, read as a plain pass in the table, the notes only in -o json)."""
    from kvguard.operator.canary.report import Note, one_line

    if result.status.value == "fail":
        shown, what = list(result.evidence), "piece(s) of evidence"
    else:
        shown, what = [e for e in result.evidence if isinstance(e, Note) and LEFT_OUT in e.message], "note(s) of checks left out"
    # one_line: evidence quotes server text (error messages, notes); each row stays one clean line.
    rows = [f"{'':<16} {one_line(text)}" for evidence in shown[:EVIDENCE_ROWS] for text in describe_evidence(evidence)]
    if len(shown) > EVIDENCE_ROWS:
        rows.append(f"{'':<16} ... {len(shown) - EVIDENCE_ROWS} more {what} ({where_more})")
    return rows


def print_probe_table(report: Any, out: TextIO, indent: str = "", where_more: str = "see -o json") -> None:
    """The whole result table of a finished report, as `kvguard canary` prints it row by row;
    `where_more` says where the evidence left out is."""
    rows = [row for r in report.probes for row in [probe_row(r), *evidence_rows(r, where_more)]]
    for line in [TABLE_HEADER, *rows]:
        print(f"{indent}{line}", file=out)
    out.flush()


class _ProgressPrinter:
    """Rows of the result table, printed as each probe finishes."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.live = out.isatty()

    def header(self, url: str) -> None:
        print(f"kvguard canary {url}", file=self.out)
        print(TABLE_HEADER, file=self.out, flush=True)

    def on_event(self, event: Any) -> None:
        if event.kind == "started":
            if self.live:
                print(f"{event.probe.value:<16} {'running':<8}", end="\r", file=self.out, flush=True)
            return
        print(probe_row(event.result) + (" " * 8 if self.live else ""), file=self.out, flush=True)
        for row in evidence_rows(event.result):
            print(row, file=self.out)


def describe_evidence(evidence: Any) -> list[str]:
    """One or two short lines per piece of evidence, for the table."""
    kind = evidence.kind
    if kind == "output_mismatch":
        return [
            f"- {evidence.request}: expected ({evidence.expected_from}) {_short(evidence.expected)}",
            f"  {'':<{len(evidence.request)}}  got {_short(evidence.actual)}",
        ]
    if kind == "http":
        status = f"HTTP {evidence.status}" if evidence.status is not None else "no HTTP response"
        detail = evidence.error or _short(evidence.body)
        finish = f", finish_reason {evidence.finish_reason}" if evidence.finish_reason else ""
        return [f"- {evidence.request}: {status}, {evidence.tokens_received} chunk(s){finish}: {detail}"]
    if kind == "nonce_leak":
        return [f"- nonce of {evidence.owner} found in {evidence.found_in}: {_short(evidence.output)}"]
    if kind == "counters":
        changed = {k: v for k, v in evidence.deltas.items() if v}
        return [f"- counter deltas: {changed or evidence.deltas}"]
    if kind == "pool_usage":
        return [f"- pool used {evidence.final_tokens:,.0f} tokens after {evidence.waited_seconds:g} s (baseline {evidence.baseline_tokens:,.0f})"]
    if kind == "capacity":
        size = f"{evidence.capacity_tokens:,}" if evidence.capacity_tokens is not None else "?"
        return [f"- {evidence.worker}: {size} tokens, ratio {evidence.ratio} (needs {evidence.required_ratio:g})"]
    return [f"- {getattr(evidence, 'message', evidence)}"]


def _short(text: str, limit: int = 100) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_target(target: Any) -> list[str]:
    """The target facts the probes were sized from, one line each (pure)."""
    from kvguard.operator.canary.report import one_line

    context = f"{target.context_length:,} tokens ({target.context_length_source})" if target.context_length else "unknown"
    pool = f"{target.min_pool_tokens:,} tokens" if target.min_pool_tokens is not None else "not reported"
    if target.engines:
        engines = ", ".join(target.engines) + (f" {target.engine_version}" if target.engine_version else "")
    else:
        engines = "not recognised (no engine metrics" + (")" if not target.metrics_urls else " at the metrics URLs)")
    # The server names its model: one line, quoted, so a name like "x verdict: PASS" reads as a name.
    model = json.dumps(one_line(target.model, 200)) if target.model is not None else "not identified"
    lines = [f"target: model {model}; context {context}; smallest KV pool {pool}; engine {engines}"]
    if target.metrics_without_engine:
        lines.append(f"  metrics without engine series (router?): {', '.join(target.metrics_without_engine)}")
    lines += [f"  note: {one_line(note)}" for note in [*target.context_notes, *target.notes]]
    return lines


def _print_verdict(report: Any, out: TextIO) -> None:
    for line in describe_target(report.target):
        print(line, file=out)
    print(
        f"verdict: {report.verdict.value.upper()} ({report.reason}) in {report.duration_seconds:.1f} s; "
        f"time to verdict {report.time_to_verdict_seconds:.1f} s",
        file=out,
    )
