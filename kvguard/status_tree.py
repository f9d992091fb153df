"""`kvguard status` as a tree (pure: a model's status and its pods' pools in, lines out).

    tiny  (namespace models)  Ready  stable 3f2a9c  target 3f2a9c
    ├── conditions  KVPoolSufficient=True  Ready=True  Degraded=False
    ├── rollout  Stable  (revision 3f2a9c)  RolloutComplete: revision 3f2a9c is serving
    │   ├── step 2/3  weight 50%                        (when the status has steps)
    │   ├── analysis error-ratio  Successful  value=0.01 threshold=0.05
    │   └── canary pass  12.3 s  capacity, golden, over_length: pass
    ├── continuous canary  every 300 s  action alert  last pass at ...
    ├── revision 3f2a9c  Stable, serving
    │   ├── pod tiny-3f2a9c-decode-x  decode  node-80gb  4096 / 2048 tokens (4.00x >= 2x)  verified
    │   └── pod ...
    └── revision 9b7e01  Superseded

Everything is read defensively: a status written by an older or newer operator still renders,
showing what it has; a top-level field of another type is left out, and a section that cannot be
read says so in its place instead of failing the whole tree. The traffic step, weight and analysis results are shown when
the status carries them (`status.rollout.step`, `.weight`, `.analysis`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvguard.operator.pool_gate import PodPool

CONDITION_ORDER = ("KVPoolSufficient", "PolicyCompliant", "CanaryPassed", "Progressing", "Ready", "Degraded")


@dataclass(frozen=True)
class Node:
    text: str
    children: list[Node] = field(default_factory=list)


def lines_of(root: Node) -> list[str]:
    out = [root.text]
    out += _branches(root.children, "")
    return out


def _branches(children: Sequence[Node], prefix: str) -> list[str]:
    out: list[str] = []
    for i, child in enumerate(children):
        last = i == len(children) - 1
        out.append(f"{prefix}{'└── ' if last else '├── '}{child.text}")
        out += _branches(child.children, prefix + ("    " if last else "│   "))
    return out


def _short(revision: Any) -> str:
    return str(revision) if revision else "-"


def _conditions(status: Mapping[str, Any]) -> Node:
    conds = {str(c.get("type")): c for c in status.get("conditions") or [] if isinstance(c, Mapping)}
    order = [t for t in CONDITION_ORDER if t in conds] + sorted(t for t in conds if t not in CONDITION_ORDER)
    # What needs a reader's eye: Degraded=True, any other condition not True, and what a rollout in
    # progress is doing now (Progressing=True: e.g. AnalysisInconclusive, why a step holds).
    shown = [t for t in order if (conds[t].get("status") == "True") == (t == "Degraded")
             or (t == "Progressing" and conds[t].get("status") == "True" and conds[t].get("reason"))]  # fmt: skip
    children = [Node(f"{t}: {conds[t].get('reason', '')}: {conds[t].get('message', '')}") for t in shown]
    text = "conditions  " + "  ".join(f"{t}={conds[t].get('status')}" for t in order)
    return Node(text, children)


def _canary(canary: Mapping[str, Any]) -> Node:
    failed = list(canary.get("failedProbes") or [])
    text = f"canary {canary.get('verdict', '?')}  {float(canary.get('durationSeconds') or 0):.1f} s"
    if canary.get("reason"):
        text += f"  {canary['reason']}"
    return Node(text, [Node(f"probe {p}: fail") for p in failed])


def _analysis(entry: Mapping[str, Any]) -> Node:
    name = entry.get("name") or entry.get("metric") or "analysis"
    result = entry.get("result") or entry.get("phase") or entry.get("verdict") or ""
    numbers = "  ".join(f"{k}={v}" for k, v in entry.items() if k not in ("name", "metric", "result", "phase", "verdict", "message")
                        and not isinstance(v, Mapping | list))  # fmt: skip
    text = f"analysis {name}  {result}  {numbers}".rstrip()
    return Node(text + (f"  {entry['message']}" if entry.get("message") else ""))


def _rollout(rollout: Mapping[str, Any], steps: int | None, target: Any = None) -> Node:
    """The rollout in status, which names its own revision: while a new target has not started
    (paused before it), what it shows is an earlier revision's (an outside probe: its steps and
    canary read as the target's)."""
    revision = rollout.get("revision")
    text = f"rollout  {rollout.get('state', '?')}" + (f"  (revision {revision})" if revision else "")
    if rollout.get("reason") or rollout.get("message"):
        text += f"  {rollout.get('reason') or ''}: {rollout.get('message') or ''}"
    children: list[Node] = []
    if revision and target and revision != target:
        if rollout.get("rollback"):  # a person's (or the continuous canary's) rollback-to pins it, not a pause
            children.append(Node(f"a rollback to revision {revision} (kvguard.io/rollback-to): the target {target} waits"))
        else:
            children.append(Node(f"of revision {revision}, not the target {target}: the target's rollout has not started"))
    if rollout.get("step") is not None or rollout.get("weight") is not None:
        index = rollout.get("step")  # from 0 in the status; counted from 1 here, as the events say it
        of = f"/{steps}" if steps and (not target or revision == target) else ""  # the spec's steps are the target's
        step = f"step {index + 1}{of}  " if isinstance(index, int) else ""
        weight = f"weight {rollout['weight']}%" if rollout.get("weight") is not None else ""
        children.append(Node(f"{step}{weight}".strip()))
    analysis = rollout.get("analysis")
    entries = analysis if isinstance(analysis, list) else (analysis.get("results") or [] if isinstance(analysis, Mapping) else [])
    children += [_analysis(a) for a in entries if isinstance(a, Mapping)]
    if isinstance(rollout.get("canary"), Mapping):
        children.append(_canary(rollout["canary"]))
    return Node(text, children)


def _continuous(continuous: Mapping[str, Any]) -> Node:
    text = f"continuous canary  every {continuous.get('intervalSeconds', '?')} s  action {continuous.get('action', 'alert')}"
    last = continuous.get("lastRun")
    if isinstance(last, Mapping):
        text += f"  last {last.get('verdict', '?')} at {last.get('finishedAt') or last.get('startedAt') or '?'} on {_short(last.get('revision'))}"
    children = [Node(f"probe {p}: fail") for p in (last or {}).get("failedProbes") or []]
    if isinstance(last, Mapping) and last.get("reason"):
        children.insert(0, Node(str(last["reason"])))
    pin = continuous.get("rollback")
    if isinstance(pin, Mapping):
        children.append(Node(f"rolled back to {_short(pin.get('toRevision'))} (from {_short(pin.get('fromRevision'))} at {pin.get('at', '?')}),"
                             " held until the spec's revision changes"))  # fmt: skip
    failed = continuous.get("failedRevisions")
    if isinstance(failed, list) and failed:
        children.append(Node(f"failed before (never rolled back to): {', '.join(_short(r) for r in failed)}"))
    return Node(text, children)


def pod_line(pool: PodPool) -> Node:
    have = f"{pool.pool_tokens:g}" if pool.pool_tokens is not None else "?"
    need = f"{pool.required}" if pool.required is not None else "?"
    ratio = f"{pool.pool_tokens / pool.context_length:.2f}x" if pool.pool_tokens is not None and pool.context_length else "?"
    mark = "verified" if pool.verified else {"KVPoolTooSmall": "TOO SMALL: out of rotation", "KVPoolUnreadable": "unreadable",
                                             "Verifying": "verifying"}.get(pool.reason, pool.reason)  # fmt: skip
    text = (f"pod {pool.pod}  {pool.role}  node {pool.node or '?'}  pool {have} / {need} tokens ({ratio} vs {pool.required_ratio:g}x)"
            f"  {mark}")  # fmt: skip
    return Node(text, [] if pool.verified else [Node(pool.message)])


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "phase": str, "message": str, "revision": str, "targetRevision": str,
    "rollout": Mapping, "continuous": Mapping, "conditions": list, "history": list,
}  # fmt: skip


def well_formed(status: Any) -> dict[str, Any]:
    """The status without the top-level fields this renderer reads that have another type (e.g.
    `rollout: 5` from another version, or kmock, which checks no schema): left out, not guessed."""
    if not isinstance(status, Mapping):
        return {}
    return {k: v for k, v in status.items() if k not in _FIELD_TYPES or isinstance(v, _FIELD_TYPES[k])}


def _section(name: str, build: Callable[[], Node]) -> Node:
    """One part of the tree; a part whose nested fields cannot be read says so in its place."""
    try:
        return build()
    except (AttributeError, TypeError, ValueError) as exc:
        return Node(f"{name}  unreadable here ({type(exc).__name__}: {exc})")


def revision_order(status: Mapping[str, Any], also: Iterable[str] = ()) -> list[str]:
    """Stable first, then the target and the rollout's candidate, then history, then the rest."""
    status = well_formed(status)
    rollout = status.get("rollout") or {}
    found = [status.get("revision"), status.get("targetRevision"), rollout.get("revision")]
    found += [h.get("revision") for h in status.get("history") or [] if isinstance(h, Mapping)]
    found += list(also)
    seen: list[str] = []
    for rev in found:
        if rev and isinstance(rev, str | int) and str(rev) not in seen:
            seen.append(str(rev))
    return seen


def _revision(status: Mapping[str, Any], rev: str, serving: str | None, pools: Sequence[PodPool], note: str | None) -> Node:
    tags = []
    if rev == status.get("revision"):
        tags.append("stable")
    if serving == rev:
        tags.append("serving")
    if rev == status.get("targetRevision") and rev != status.get("revision"):
        tags.append("target")
    state = next((h.get("state") for h in status.get("history") or [] if isinstance(h, Mapping) and h.get("revision") == rev), None)
    text = f"revision {rev}  " + ", ".join([t for t in [state, *tags] if t] or ["-"])
    if note:
        text += f"  ({note})"
    mine = sorted((p for p in pools if p.revision == rev), key=lambda p: (p.role, p.pod))
    return Node(text, [pod_line(p) for p in mine])


def status_tree(name: str, namespace: str, status: Mapping[str, Any], pools: Sequence[PodPool], *,
                serving: str | None = None, notes: Mapping[str, str] | None = None, steps: int | None = None) -> Node:  # fmt: skip
    """The tree of one model. `pools`: every pod's measured pool (status.pools on a cluster, a live
    scrape locally); `serving`: the revision traffic goes to when known apart from the status;
    `notes`: a word per revision from the backend (e.g. `scaled to zero`); `steps`: how many traffic
    steps the spec has (the status names only the current one)."""
    notes, status = notes or {}, well_formed(status)
    head = (f"{name}  (namespace {namespace})  {status.get('phase') or 'Unknown'}  stable {_short(status.get('revision'))}"
            f"  target {_short(status.get('targetRevision'))}")  # fmt: skip
    if status.get("message"):
        head += f"  - {status['message']}"
    children = [_section("conditions", lambda: _conditions(status))]
    if "rollout" in status:
        children.append(_section("rollout", lambda: _rollout(status["rollout"], steps, status.get("targetRevision"))))
    if "continuous" in status:
        children.append(_section("continuous canary", lambda: _continuous(status["continuous"])))
    serving = serving or status.get("revision")
    for rev in revision_order(status, [*notes, *(p.revision for p in pools)]):
        children.append(_section(f"revision {rev}", partial(_revision, status, rev, serving, pools, notes.get(rev))))
    return Node(head, children)


def render(name: str, namespace: str, status: Mapping[str, Any], pools: Sequence[PodPool], **kwargs: Any) -> str:
    return "\n".join(lines_of(status_tree(name, namespace, status, pools, **kwargs)))


__all__ = ["Node", "lines_of", "pod_line", "render", "revision_order", "status_tree"]
