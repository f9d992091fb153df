"""Golden probe: expected text (substring / regex) and equality with the baseline (stable revision).

Decoding is greedy with a fixed seed, so a correct canary running the same weights as the baseline
must produce the same text; a KV corruption (S3) or a stale read (S1) changes it. When a revision
legitimately changes numerics (weights, quantization, KV dtype, device, engine, sharding) the operator does
not ask for the baseline's text (`RunCanary.compare_outputs`); expected text is still checked.
"""

from __future__ import annotations

import re

from kvguard.operator.canary.base import Outcome, Probe, ProbeSkipped, RunContext, failed, passed
from kvguard.operator.canary.report import Evidence, Note, OutputMismatch
from kvguard.operator.canary.spec import GoldenPrompt, ProbeName


class GoldenProbe(Probe):
    name = ProbeName.GOLDEN

    async def run(self, ctx: RunContext) -> Outcome:
        spec = ctx.spec.golden
        use_baseline = spec.compare_baseline and ctx.baseline is not None
        checkable = [p for p in spec.prompts if p.expect_substring or p.expect_regex or use_baseline]
        if not checkable:
            raise ProbeSkipped("no prompt has expected text and no baseline URL was given")
        problems: list[str] = []
        evidence: list[Evidence] = []
        for index, prompt in enumerate(checkable):
            await self._check_one(ctx, index, prompt, use_baseline, problems, evidence)
        if problems:
            return failed(f"{len(problems)} golden check(s) failed; first: {problems[0]}", evidence)
        source = "expected text" + (" and baseline" if use_baseline else "")
        return passed(f"{len(checkable)} prompt(s) matched {source}", [Note(message=source)])

    async def _check_one(
        self,
        ctx: RunContext,
        index: int,
        prompt: GoldenPrompt,
        use_baseline: bool,
        problems: list[str],
        evidence: list[Evidence],
    ) -> None:
        max_tokens = prompt.max_tokens or ctx.spec.max_tokens
        label = f"golden #{index}"
        out = await ctx.target.complete(prompt.prompt, api=ctx.spec.api, max_tokens=max_tokens, label=label)
        if not out.ok:
            problems.append(out.describe_failure())
            evidence.append(out.evidence())
            return
        ctx.remember_solo(prompt.prompt, ctx.spec.api, max_tokens, out)
        for expected_from, matches, expected in _expectations(prompt, out.text):
            if not matches:
                problems.append(f"{label}: output does not match {expected_from}")
                evidence.append(
                    OutputMismatch(request=label, expected_from=expected_from, expected=expected, actual=out.text)
                )
        if use_baseline and ctx.baseline is not None:
            ref = await ctx.baseline.complete(
                prompt.prompt, api=ctx.spec.api, max_tokens=max_tokens, label=f"{label} on baseline"
            )
            if not ref.ok:
                problems.append(f"baseline could not answer: {ref.describe_failure()}")
                evidence.append(ref.evidence())
            elif ref.text != out.text:
                problems.append(f"{label}: output differs from the baseline's")
                evidence.append(
                    OutputMismatch(request=label, expected_from="baseline", expected=ref.text, actual=out.text)
                )


def _expectations(prompt: GoldenPrompt, text: str) -> list[tuple[str, bool, str]]:
    checks = []
    if prompt.expect_substring is not None:
        checks.append(("expectSubstring", prompt.expect_substring in text, prompt.expect_substring))
    if prompt.expect_regex is not None:
        checks.append(("expectRegex", re.search(prompt.expect_regex, text) is not None, prompt.expect_regex))
    return checks
