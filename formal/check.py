"""Model-check formal/kvtransfer.pml with SPIN: the model at its bounds, then every mutant.

    python3 formal/check.py                   # the model (must verify) + every mutant (each must fail)
    python3 formal/check.py --model           # the model only (2 requests, every row; 3 requests)
    python3 formal/check.py --mutant incident # one mutant, with its counterexample trail summarised

Each run: ``spin -a`` with the run's -D macros, ``gcc -O0`` (pan.c is ~0.5 MB: -O2 costs a minute
of compile for a 2.5x faster search, a loss at these state counts), then ``./pan`` -- an
exhaustive search (full state storage, no bitstate hashing) for assertion violations and invalid
end states. The model passes only if pan reports no error AND searched everything (no depth
truncation, no "search not completed"). A mutant passes only if pan found a counterexample
violating the invariant named for it; its trail is replayed and summarised (formal/trail.py).
Work directories are formal/build/<run>/ (git-ignored): the trails stay there to read.
Pure standard library: runs without the project's virtual environment.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE / "kvtransfer.pml"
BUILD = HERE / "build"

# pan's compile flags: safety properties only, state-vector compression, room for the vector.
PAN_CFLAGS = ["-O0", "-DSAFETY", "-DCOLLAPSE", "-DVECTORSZ=4096"]
MAX_DEPTH = 100_000  # the model's runs are ~500 steps deep: truncation would show as an error
HASH_BITS = 25  # 32M hash slots: the bounds store ~15M states (1.8 GB with COLLAPSE)


@dataclass(frozen=True)
class Run:
    name: str
    defines: tuple[str, ...]
    violates: str | None  # None: must verify; else the invariant the counterexample must break
    why: str
    min_states: int = 100_000  # a model run that stores fewer did not run its rows


# The model as the code implements it: two requests under every row of BOUNDS (kvtransfer.pml) in
# one search, three requests competing for the same two decode pages without faults, and a prefill
# pool of two contexts, where prefill computes ahead of its tickets (the early budget is not 0):
# with decode's engine errors in any state (row 12), and behind a router that lets over-length requests through
# (row 11: the workers' own intake checks hold S2; the incident's shape); and three requests on
# workers with few running slots (max_running_requests: 2 on prefill, 1 on decode), which reach
# the two workers in any order, without timers (row 13): the early budget's count bound.
#
# model_slots' configuration (the mutant early_takes_every_slot uses it too): the running slots bind,
# the pages do not (prefill's pool holds two contexts, decode's one slot is the request's own).
SLOTS = ("-DNREQ=3", "-DNPP=4", "-DPRUN=2", "-DDRUN=1", "-DROW=13")

MODEL_RUNS: dict[str, Run] = {
    run.name: run
    for run in (
        Run("model", (), None, "2 requests, every row of BOUNDS"),
        Run("model_3req", ("-DNREQ=3", "-DROW=1"), None, "3 requests, row 1 (no faults; timers when idle)"),
        Run("model_early", ("-DNPP=4", "-DROW=3"), None,
            "a prefill pool of two contexts (S7), so both requests may compute before their ticket; row 3 (no timers)"),
        Run("model_early_intake", ("-DNPP=4", "-DROW=11"), None,
            "a prefill pool of two contexts behind a router without its intake check; row 11 (the workers reject)",
            min_states=5_000),
        Run("model_onpath", ("-DONPATH", "-DROW=8"), None,
            "an on-path adversary that injects captured frames into prefill's own connection; row 8 (replays)"),
        Run("model_early_hang", ("-DNPP=4", "-DROW=15"), None,
            "a prefill pool of two contexts behind a router that hangs (row 15): prefill computed ahead of a "
            "ticket that never comes, and only its bootstrap timer frees its pages", min_states=5_000),
        Run("model_slots", SLOTS, None,
            "3 requests, 2 running slots on prefill and 1 on decode, prefill pool of two contexts (pages never "
            "the bound); row 13 (no faults, no timers): a request with a ticket always finds a prefill slot"),
    )
}

# Mutants mirroring the real bugs (../shared/reference/pd-bug-classes.md). Each names the row of
# BOUNDS whose faults its counterexample needs, so the search stops at the first violation quickly.
MUTANTS: dict[str, Run] = {
    run.name: run
    for run in (
        Run("incident", ("-DMUTANT_INCIDENT", "-DROW=1"), "S2",
            "a rejected (over-length) request is still transferred (the incident, sglang#30233)"),
        Run("no_abort_propagation", ("-DMUTANT_NO_ABORT_PROPAGATION", "-DROW=6"), "S4",
            "an abort never reaches decode: it keeps the pages (sglang#28651)"),
        Run("free_in_flight", ("-DMUTANT_FREE_IN_FLIGHT", "-DROW=6"), "S5",
            "decode frees a page while a write may still land in it, and writes skip the generation check"),
        Run("done_without_manifest", ("-DMUTANT_DONE_WITHOUT_MANIFEST", "-DROW=10"), "S3",
            "decode trusts prefill's 'done' without checking the manifest and the written pages (vllm#50754)"),
        Run("no_ticket_binding", ("-DMUTANT_NO_TICKET_BINDING", "-DROW=8"), "NOREPLAY",
            "frames accepted without their ticket nonce, on any connection (the protocol before #11)"),
        Run("router_ignores_prefill", ("-DWATCH_PREFILL=0", "-DROW=5"), "S4",
            "the router before this model: a prefill dead before OPEN leaves decode waiting for its stall timer"),
        Run("decode_ignores_close", ("-DNO_D_GONE", "-DROW=14"), "S4",
            "decode not ending a request whose router closed its call: a lost abort call leaves the pages held"),
        Run("unbounded_early", ("-DMUTANT_UNBOUNDED_EARLY", "-DROW=3"), "S4",
            "prefill computes ahead of every ticket: its pool waits on decode's, decode's on prefill (the first overlap)"),
        Run("no_conn_seq", ("-DMUTANT_NO_CONN_SEQ", "-DONPATH", "-DROW=8"), "S6",
            "wire v2: frames carry no connection number, so a frame injected back into its own connection verifies"),
        Run("token_first", ("-DMUTANT_TOKEN_FIRST", "-DROW=12"), "S3",
            "decode sends the first token when the transfer completes, before start_decode's checks: a request "
            "the engine aborted (a failed step) still gives its client a token (the router's S3)"),
        # Single guards: each removes exactly one check of the code (formal/README.md lists the
        # guards whose removal alone another guard covers, which therefore have no mutant here).
        Run("no_generation_check", ("-DONLY_NO_GEN_CHECK", "-DROW=12"), "S5",
            "the pool applies a write without the lease/generation check: a CHUNK lands in pages the engine freed "
            "when a step failed (AsyncEngine._step) while the transfer was live"),
        Run("decode_admits_overlength", ("-DMUTANT_DECODE_ADMITS_OVERLEN", "-DROW=11"), "S2",
            "decode's intake does not reject an over-length request the router let through: it allocates pages"),
        Run("prefill_admits_overlength", ("-DMUTANT_PREFILL_ADMITS_OVERLEN", "-DNPP=4", "-DROW=11"), "S2",
            "the incident's shape: router and prefill let an over-length request through, decode rejects it, "
            "but prefill already computed it ahead of its ticket (needs the early budget: NPP=4)"),
        Run("no_manifest_checksum", ("-DMUTANT_NO_MANIFEST_CHECKSUM", "-DROW=9"), "S3",
            "decode takes the MANIFEST's first-token record without its checksum (wire v3's MANIFEST): a record "
            "corrupted in flight becomes the client's first token (the router's S3)"),
        Run("early_takes_every_slot", ("-DMUTANT_EARLY_TAKES_EVERY_SLOT", *SLOTS), "S4",
            "EarlyBudget without limit_requests (only pages bounded): prefill computes ahead of tickets in every "
            "running slot, its slots wait on tickets, decode's on prefill (the 1,000-request burst deadlock)"),
        # The workers' own timers: each mutant turns one off behind a router that hangs (row 15), and
        # verifies with it on (tests/test_formal_model.py runs each without its switch).
        Run("no_decode_timers", ("-DNO_D_TIMER", "-DROW=15"), "S4",
            "decode without its open and stall timers (KVReceiver._arm/_on_timer): a router that hangs before "
            "delivering the ticket leaves decode's pages held for a transfer that never opens"),
        Run("no_bootstrap_timer", ("-DNO_P_TIMER", "-DNPP=4", "-DROW=15"), "S4",
            "prefill without its bootstrap timer (--bootstrap-timeout, PrefillServer._ticket_of): a request "
            "computed ahead of its ticket keeps prefill's pages when the router hangs before delivering it"),
        Run("error_as_finish", ("-DMUTANT_ERROR_AS_FINISH", "-DROW=12"), "OUTCOME",
            "the router takes decode's error event as its finish (awaits prefill, ends cleanly): the client "
            "hears a finished request that decode aborted"),
    )
}


@dataclass
class Result:
    run: Run
    errors: int = -1
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    complete: bool = False  # the search covered everything (no truncation)
    violated: str | None = None  # the assertion's name, or "invalid end state"
    trail: list[str] = field(default_factory=list)
    output: str = ""

    @property
    def ok(self) -> bool:
        if self.run.violates is None:
            return self.errors == 0 and self.complete
        return self.errors > 0 and self.violated == self.run.violates

    def line(self) -> str:
        verdict = "ok" if self.ok else "FAILED"
        found = f", violates {self.violated}" if self.violated else ""
        return (f"{self.run.name:24s} {verdict:6s} errors={self.errors} states={self.states:,} "
                f"transitions={self.transitions:,} depth={self.depth}{found} ({self.seconds:.1f}s)")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found: `make model-check` installs spin (apt-get) and needs gcc")
    return path


def build(run: Run, workdir: Path) -> Path:
    """spin -a + gcc in ``workdir``; returns the pan binary."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    shutil.copy(MODEL, workdir / MODEL.name)
    spin = subprocess.run([_tool("spin"), "-a", *run.defines, MODEL.name], cwd=workdir,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if spin.returncode != 0 or not (workdir / "pan.c").exists():
        raise RuntimeError(f"spin -a failed for {run.name}:\n{spin.stdout}{spin.stderr}")
    gcc = subprocess.run([_tool("gcc"), *PAN_CFLAGS, *run.defines, "-o", "pan", "pan.c"], cwd=workdir,
                         capture_output=True, text=True, check=False)  # fmt: skip
    if gcc.returncode != 0:
        raise RuntimeError(f"gcc failed for {run.name}:\n{gcc.stderr[-4000:]}")
    return workdir / "pan"


def _number(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    return int(float(m.group(1))) if m else 0


def parse(run: Run, output: str, seconds: float) -> Result:
    """pan's report: errors, states stored, transitions, depth, completeness, what was violated."""
    m = re.search(r"assertion violated (\w+)", output)
    violated = m.group(1) if m else ("invalid end state" if "invalid end state (" in output else None)
    errors = _number(r"errors: (\d+)", output) if "errors:" in output else -1
    truncated = "max search depth too small" in output or "Search not completed" in output
    return Result(run, errors=errors, states=_number(r"([\d.e+]+) states, stored", output),
                  transitions=_number(r"([\d.e+]+) transitions \(= stored\+matched\)", output),
                  depth=_number(r"depth reached (\d+)", output), seconds=seconds,
                  complete=errors == 0 and not truncated, violated=violated, output=output)  # fmt: skip


def check(run: Run, build_dir: Path = BUILD) -> Result:
    """Build and search one run; for a counterexample, summarise its trail."""
    workdir = build_dir / run.name
    started = time.monotonic()
    pan = build(run, workdir)
    out = subprocess.run([str(pan), f"-m{MAX_DEPTH}", f"-w{HASH_BITS}"], cwd=workdir,
                         capture_output=True, text=True, check=False)  # fmt: skip
    result = parse(run, out.stdout + out.stderr, time.monotonic() - started)
    if result.errors > 0 and (workdir / f"{MODEL.name}.trail").exists():
        sys.path.insert(0, str(HERE))
        import trail  # formal/trail.py: replays the trail with spin -t

        replayed = trail.replay(workdir / MODEL.name, list(run.defines), workdir)
        result.trail = trail.summarise(replayed, MODEL.read_text(), trail.nreq_of(list(run.defines)))
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="store_true", help="check the model only")
    parser.add_argument("--mutant", action="append", choices=sorted(MUTANTS), help="check this mutant (repeatable)")
    parser.add_argument("--trail", action="store_true", help="print each counterexample's summarised trail")
    args = parser.parse_args(argv)
    runs = list(MODEL_RUNS.values()) if args.model or not args.mutant else []
    if not args.model:
        runs += [MUTANTS[name] for name in args.mutant] if args.mutant else list(MUTANTS.values())
    failed = 0
    for run in runs:
        result = check(run)
        print(result.line(), flush=True)
        if run.violates is not None:
            print(f"{'':24s} ({run.why})")
        if result.trail and (args.trail or not result.ok):
            print("\n".join("    " + line for line in result.trail))
        if not result.ok:
            failed += 1
            if run.violates is None:
                print(result.output[-3000:])
    print(f"model-check: {len(runs) - failed} of {len(runs)} runs as expected")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
