"""Golden probe: expected text (substring / regex) and agreement with the baseline (stable revision).

Decoding is greedy with a fixed seed, so a correct canary running the same numerics as the baseline
must produce the same text; a KV corruption (S3) or a stale read (S1) changes it
(`baselineMatch: exact`, the default). When a revision legitimately changes numerics (weights,
quantization, KV dtype, device, engine, sharding) the operator asks for `baselineMatch: tolerant`
(`CanarySpec.for_changed_numerics`): both servers are asked for logprobs and compared by per-token
agreement and logprob divergence (`logprob_compare`), so such a candidate is still judged against
stable. A server that returns no logprobs leaves only the expected-text checks, and the result
says so. The pass reason lists exactly what was checked: never a claim about expected text when
none was configured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvguard.operator.canary import logprob_compare
from kvguard.operator.canary.base import Outcome, Probe, ProbeSkipped, RunContext, failed, passed
from kvguard.operator.canary.client import Completion, EngineClient
from kvguard.operator.canary.report import Evidence, Note, OutputMismatch, one_line
from kvguard.operator.canary.spec import GoldenPrompt, ProbeName


@dataclass
class _Tally:
    """What the probe checked, for an exact pass reason."""

    expectations: int = 0
    exact_equal: int = 0
    tolerant_within: int = 0
    tolerant_unavailable: int = 0
    without_logprobs: set[str] = field(default_factory=set)  # "candidate" / "baseline"
    problems: list[str] = field(default_factory=list)
    evidence: list[Evidence] = field(default_factory=list)

    def reason(self, prompts: int) -> str:
        parts = []
        if self.expectations:
            parts.append(f"{self.expectations} expectation(s) met")
        if self.exact_equal:
            parts.append(f"{self.exact_equal} output(s) equal to the baseline's")
        if self.tolerant_within:
            parts.append(f"{self.tolerant_within} output(s) within logprob tolerance of the baseline's")
        if self.tolerant_unavailable:
            parts.append(f"{self.tolerant_unavailable} not compared with the baseline (no logprobs returned)")
        return f"{prompts} prompt(s): " + "; ".join(parts or ["nothing to compare"])


class GoldenProbe(Probe):
    name = ProbeName.GOLDEN

    async def run(self, ctx: RunContext) -> Outcome:
        spec = ctx.spec.golden
        use_baseline = spec.compare_baseline and ctx.baseline is not None
        checkable = [p for p in spec.prompts if p.expect_substring or p.expect_regex or use_baseline]
        if not checkable:
            if (same := await _one_answer_for_every_prompt(ctx)) is not None:
                return same
            why = "no baseline URL was given" if spec.compare_baseline else "compareBaseline is off"
            raise ProbeSkipped(f"no prompt has expectSubstring/expectRegex and {why}")
        tally = _Tally()
        for index, prompt in enumerate(checkable):
            await self._check_one(ctx, index, prompt, use_baseline, tally)
        if tally.problems:
            return failed(f"{len(tally.problems)} golden check(s) failed; first: {tally.problems[0]}", tally.evidence)
        if use_baseline and tally.tolerant_unavailable == len(checkable) and not tally.expectations:
            who = " and the ".join(sorted(tally.without_logprobs))
            raise ProbeSkipped(
                f"baselineMatch is tolerant, the outputs differ, but the {who} returned no logprobs, "
                "and no prompt has expected text"
            )
        return passed(tally.reason(len(checkable)), tally.evidence)

    async def _check_one(self, ctx: RunContext, index: int, prompt: GoldenPrompt, use_baseline: bool, tally: _Tally) -> None:
        max_tokens = prompt.max_tokens or ctx.spec.max_tokens
        label = f"golden #{index}"
        tolerant = use_baseline and ctx.spec.golden.baseline_match == "tolerant"
        top = ctx.spec.golden.logprob_tolerance.top_logprobs if tolerant else None
        out = await _complete(ctx, ctx.target, prompt.prompt, max_tokens, label, top)
        if not out.ok:
            tally.problems.append(out.describe_failure())
            tally.evidence.append(out.evidence())
            return
        if not tolerant:
            ctx.remember_solo(prompt.prompt, ctx.spec.api, max_tokens, out)
        for expected_from, matches, expected in _expectations(prompt, out.text):
            tally.expectations += matches
            if not matches:
                tally.problems.append(f"{label}: output does not match {expected_from}")
                tally.evidence.append(OutputMismatch(request=label, expected_from=expected_from, expected=expected, actual=out.text))
        if not use_baseline or ctx.baseline is None:
            return
        ref = await _complete(ctx, ctx.baseline, prompt.prompt, max_tokens, f"{label} on baseline", top)
        if not ref.ok:
            tally.problems.append(f"baseline could not answer: {ref.describe_failure()}")
            tally.evidence.append(ref.evidence())
        elif tolerant:
            _judge_tolerant(ctx, label, out, ref, tally)
        elif ref.text != out.text:
            tally.problems.append(f"{label}: output differs from the baseline's")
            tally.evidence.append(OutputMismatch(request=label, expected_from="baseline", expected=ref.text, actual=out.text))
        else:
            tally.exact_equal += 1


SAME_ANSWER_MIN_CHARS = 12
"""How long one answer to every golden prompt must be to fail the run when there are fewer than
SAME_ANSWER_MIN_PROMPTS of them: short ones may honestly be shared (outside probe: "The capital of
France is" and "... of Italy is" both gave 'd' at maxTokens 1), a dozen characters of the same text
for different prompts is a server ignoring them. With more prompts answered alone (golden,
determinism, B, the tenants: `RunContext.one_answer_failure`) a shared text that fills every token
budget fails however short, '!!!!!!!!' too."""


async def _one_answer_for_every_prompt(ctx: RunContext) -> Outcome | None:
    """With nothing to compare with, one check needs no reference: different prompts must not all
    get the same answer (outside probe: a server answering every prompt with one fixed text, or
    with an error message in a 200, passed without a baseline). A failed request fails as usual.
    None when the answers differ (or there are fewer than two prompts, or no text, or a short one
    shared by fewer than SAME_ANSWER_MIN_PROMPTS prompts)."""
    prompts = list(dict.fromkeys(p.prompt for p in ctx.spec.golden.prompts))
    if len(prompts) < 2:
        return None
    answers = []
    for index, prompt in enumerate(prompts):
        out = await _complete(ctx, ctx.target, prompt, ctx.spec.max_tokens, f"golden #{index}", None)
        if not out.ok:
            return failed(out.describe_failure(), [out.evidence()])
        ctx.remember_solo(prompt, ctx.spec.api, ctx.spec.max_tokens, out)
        answers.append(out)
    if (everywhere := ctx.one_answer_failure()) is not None:
        return everywhere
    if len(answers[0].text.strip()) < SAME_ANSWER_MIN_CHARS or any(a.text != answers[0].text for a in answers[1:]):
        return None  # (a short answer may honestly be every prompt's: "d", " 4")
    evidence: list[Evidence] = [OutputMismatch(request=a.label, expected_from="a different answer than golden #0's",
                                               expected="(any other text)", actual=a.text) for a in answers[1:]]  # fmt: skip
    return failed(f"all {len(answers)} golden prompts got the same answer {one_line(answers[0].text, 60)!r}: the server "
                  "does not answer its prompt (a fixed text, or an error in a 200)", evidence)  # fmt: skip


async def _complete(ctx: RunContext, client: EngineClient, prompt: str, max_tokens: int, label: str, top: int | None) -> Completion:
    """One golden request; with logprobs asked for, a server that rejects the parameter (4xx naming
    it) is asked again without, so the expected-text checks still run."""
    out = await client.complete(prompt, api=ctx.spec.api, max_tokens=max_tokens, label=label, top_logprobs=top)
    if top is not None and out.status is not None and 400 <= out.status < 500 and "logprobs" in out.body:
        out = await client.complete(prompt, api=ctx.spec.api, max_tokens=max_tokens, label=f"{label} (no logprobs)")
    return out


def _judge_tolerant(ctx: RunContext, label: str, out: Completion, ref: Completion, tally: _Tally) -> None:
    if out.text == ref.text:
        tally.exact_equal += 1
        return
    if not out.logprobs or not ref.logprobs:
        missing = [who for who, c in (("candidate", out), ("baseline", ref)) if not c.logprobs]
        tally.tolerant_unavailable += 1
        tally.without_logprobs.update(missing)
        tally.evidence.append(Note(message=f"{label}: outputs differ but {' and '.join(missing)} returned no logprobs; "
                                           "the baseline comparison was not possible"))
        return
    tolerance = ctx.spec.golden.logprob_tolerance
    agreement = logprob_compare.compare(out.logprobs, ref.logprobs, tolerance.max_logprob_divergence)
    problem = logprob_compare.judge(agreement, tolerance.min_token_agreement, tolerance.max_logprob_divergence)
    problem = problem or logprob_compare.text_contradiction(out.text, ref.text, out.logprobs, ref.logprobs, agreement)
    if problem is None:
        tally.tolerant_within += 1
        tally.evidence.append(Note(message=f"{label}: {agreement.describe()}"))
        return
    tally.problems.append(f"{label}: {problem}")
    tally.evidence.append(OutputMismatch(request=label, expected_from="baseline (logprobs)", expected=ref.text, actual=out.text))


def _expectations(prompt: GoldenPrompt, text: str) -> list[tuple[str, bool, str]]:
    checks = []
    if prompt.expect_substring is not None:
        checks.append(("expectSubstring", prompt.expect_substring in text, prompt.expect_substring))
    if prompt.expect_regex is not None:
        checks.append(("expectRegex", re.search(prompt.expect_regex, text) is not None, prompt.expect_regex))
    return checks
