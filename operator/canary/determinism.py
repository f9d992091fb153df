"""Determinism probe: the same greedy request gives the same text every time, streamed or not.

A request that reads KV it does not own (S1), a corrupted transfer (S3) or a late write into a
reused page (S5) typically makes the output depend on what ran before, so repeats differ. The
same prompt must also be counted the same (`usage.prompt_tokens`): a count that changes between
runs is usage attributed from another request.
"""

from __future__ import annotations

from kvguard.operator.canary.base import Outcome, Probe, ProbeSkipped, RunContext, empty_answer, failed, passed
from kvguard.operator.canary.client import Completion
from kvguard.operator.canary.report import Evidence, OutputMismatch
from kvguard.operator.canary.spec import ApiKind, ProbeName


class DeterminismProbe(Probe):
    name = ProbeName.DETERMINISM

    async def run(self, ctx: RunContext) -> Outcome:
        spec = ctx.spec.determinism
        api, max_tokens = ctx.spec.api, ctx.spec.max_tokens
        runs = []
        for i in range(spec.repetitions):
            out = await ctx.target.complete(spec.prompt, api=api, max_tokens=max_tokens, label=f"run {i + 1}")
            if not out.ok:
                return failed(out.describe_failure(), [out.evidence()])
            runs.append(out)
        ctx.remember_solo(spec.prompt, api, max_tokens, runs[0])
        evidence: list[Evidence] = [
            OutputMismatch(request=r.label, expected_from="run 1", expected=runs[0].text, actual=r.text)
            for r in runs[1:]
            if r.text != runs[0].text
        ]
        if evidence:
            return failed(f"{len(evidence)} of {len(runs) - 1} repeat(s) differ from run 1", evidence)
        if miscounted := prompt_token_disagreement(runs):
            return failed(miscounted, [r.evidence() for r in runs])
        if not runs[0].text:
            raise ProbeSkipped(empty_answer(runs[0]))  # identical empty answers prove nothing
        extra = ""
        if spec.compare_streaming:
            streamed = await ctx.target.complete(
                spec.prompt, api=api, max_tokens=max_tokens, stream=True, label="streamed run"
            )
            if not streamed.ok:
                return failed(streamed.describe_failure(), [streamed.evidence()])
            if streamed.text != runs[0].text:
                return failed(
                    "streamed output differs from the non-streamed output",
                    [OutputMismatch(request="streamed run", expected_from="run 1", expected=runs[0].text, actual=streamed.text)],
                )
            extra = " plus a streamed run"
            if (other := await _other_endpoint_streamed(ctx, spec.prompt)) is not None:
                if isinstance(other, Outcome):
                    return other
                extra += f" and the {other} endpoint's, plain and streamed"
        sample = runs[0].text if len(runs[0].text) <= 40 else runs[0].text[:37] + "..."
        return passed(f"{len(runs)} identical runs{extra} ({api}, max_tokens={max_tokens}): {sample!r}")


async def _other_endpoint_streamed(ctx: RunContext, prompt: str) -> str | Outcome | None:
    """The other endpoint (chat for completions) streamed must say what it says plainly (outside
    probe: streamed chat was never compared). Its name when it agrees, a failure when not, None
    when neither answers with text (a base model has no chat template: not this probe's finding).
    A plain answer with no text is compared all the same: one with text streamed fails (outside
    probe: plain chat answered 200 with empty content while streamed chat had text, and passed)."""
    other: ApiKind = "chat" if ctx.spec.api == "completions" else "completions"
    plain = await ctx.target.complete(prompt, api=other, max_tokens=ctx.spec.max_tokens, label=f"{other} run")
    if not plain.ok:
        return None
    streamed = await ctx.target.complete(prompt, api=other, max_tokens=ctx.spec.max_tokens, stream=True,
                                         label=f"{other} streamed run")  # fmt: skip
    if not streamed.ok:
        return failed(streamed.describe_failure(), [streamed.evidence()]) if plain.text else None
    if not plain.text and not streamed.text:
        return None
    if streamed.text != plain.text:
        return failed(f"streamed {other} output differs from the non-streamed {other} output",
                      [OutputMismatch(request=f"{other} streamed run", expected_from=f"{other} run",
                                      expected=plain.text, actual=streamed.text)])  # fmt: skip
    return other


def prompt_token_disagreement(runs: list[Completion]) -> str | None:
    """Why the runs' `usage.prompt_tokens` disagree (the same prompt each time), or None."""
    counts = {r.prompt_tokens for r in runs if r.prompt_tokens is not None}
    if len(counts) <= 1:
        return None
    by_run = ", ".join(f"{r.label} {r.prompt_tokens}" for r in runs if r.prompt_tokens is not None)
    return f"usage.prompt_tokens differs for the same prompt ({by_run}): usage counted from another request"
