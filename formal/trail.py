"""Summarise a SPIN counterexample trail of formal/kvtransfer.pml into one line per protocol step.

    python3 formal/trail.py formal/kvtransfer.pml [-D...]        # after pan wrote kvtransfer.pml.trail

Runs ``spin -t -p`` (replaying the trail) and keeps the steps that move the protocol: request and
transfer state changes, messages, frames, pool and credit changes, faults and the failing assertion.
mtype numbers are shown as the names the code uses (RequestState, TransferState, FrameType).
Pure text processing apart from running spin; the test suite and `make model-check` use it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

_MTYPE_DECL = re.compile(r"^mtype:(\w+)\s*=\s*\{([^}]*)\}", re.MULTILINE)
_STEP = re.compile(r"^\s*(\d+):\s+proc\s+(\d+)\s+\((\w+):\d+\)\s+\S+:(\d+)\s+\(state \d+\)\s+\[(.*)\]\s*$")

# which mtype a variable or channel field holds
_VAR_TYPES = {
    "ds": "request_state", "ps": "request_state",
    "xstate": "transfer_state", "pxs": "transfer_state",
    "rphase": "router_phase",
}
_CHAN_TYPES = {"p2d": "frame", "d2p": "frame", "dstream": "decode_event"}
_KEEP_VARS = (
    "ds", "ps", "xstate", "pxs", "rphase", "pres", "presult", "abort_d", "abort_p", "dq", "pq", "nst",
    "pc_st", "dfree", "pfree", "cred", "tokens_streamed", "rgone", "dbroken", "d_epoch", "p_epoch",
    "dwgen", "dcont", "dverified", "xfirst", "silent_fault", "b_disc", "b_perr", "b_derr", "b_reset", "b_drop", "b_corrupt",
    "b_drestart", "b_prestart", "b_replay", "b_expire", "b_tmo", "over",
)
_ROLES = ("router", "decode", "prefill")


def mtype_names(model: str) -> dict[str, list[str]]:
    """mtype name -> its names in declaration order (SPIN numbers them last = 1, first = n)."""
    return {m.group(1): [n.strip() for n in m.group(2).split(",") if n.strip()]
            for m in _MTYPE_DECL.finditer(model)}


def _value_name(types: dict[str, list[str]], kind: str, value: str) -> str:
    names = types.get(kind, [])
    try:
        number = int(value)
    except ValueError:
        return value
    return names[len(names) - number] if 1 <= number <= len(names) else value


def _rename(stmt: str, types: dict[str, list[str]]) -> str:
    def var(m: re.Match[str]) -> str:
        return f"{m.group(1)}{m.group(2)} = {_value_name(types, _VAR_TYPES[m.group(1)], m.group(3))}"

    stmt = re.sub(r"\b(ds|ps|xstate|pxs|rphase)(\[[^\]]*\])? = (\d+)\b", var, stmt)

    def chan(m: re.Match[str]) -> str:
        return f"{m.group(1)}{m.group(2)}{m.group(3)}{_value_name(types, _CHAN_TYPES[m.group(1)], m.group(4))}"

    return re.sub(r"\b(p2d|d2p|dstream)(\[[^\]]*\])([!?])(\d+)\b", chan, stmt)


def _who(pid: int, proc: str, nreq: int) -> str:
    if 1 <= pid <= 3 * nreq and proc in ("router", "decode_handler", "prefill_handler"):
        return f"r{(pid - 1) // 3} {_ROLES[(pid - 1) % 3]}"
    return proc


def _interesting(stmt: str) -> bool:
    if stmt.startswith("assert("):
        return True
    if re.search(r"\b(p2d|d2p|dstream)\[[^\]]*\][!?]", stmt):
        return True
    m = re.match(r"(\w+)(\[[^\]]*\])? = ", stmt)
    return bool(m and m.group(1) in _KEEP_VARS)


def summarise(spin_output: str, model: str, nreq: int) -> list[str]:
    types = mtype_names(model)
    lines = []
    for raw in spin_output.splitlines():
        m = _STEP.match(raw)
        if m:
            step, pid, proc, line, stmt = m.groups()
            if _interesting(stmt):
                lines.append(f"{int(step):4d} {_who(int(pid), proc, nreq):18s} {_rename(stmt, types)}")
        elif "assertion violated" in raw or "invalid end state" in raw:
            lines.append("     " + raw.strip())
    return lines


def replay(model_path: Path, defines: list[str], cwd: Path) -> str:
    """spin -t -p on the trail pan wrote next to the model (in ``cwd``)."""
    result = subprocess.run(["spin", "-t", "-p", *defines, model_path.name], cwd=cwd,
                            capture_output=True, text=True, check=False)
    return result.stdout + result.stderr


def nreq_of(defines: list[str]) -> int:
    for d in defines:
        if d.startswith("-DNREQ="):
            return int(d.split("=", 1)[1])
    return 2


def main(argv: list[str]) -> int:
    model_path = Path(argv[1])
    defines = argv[2:]
    out = replay(model_path, defines, model_path.parent)
    for line in summarise(out, model_path.read_text(), nreq_of(defines)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
