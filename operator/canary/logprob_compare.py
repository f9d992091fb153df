"""Comparing a candidate's greedy output with the baseline's by logprobs (pure).

Exact text equality is the right test when candidate and baseline run the same numerics. When a
revision legitimately changes them (another weights file, quantization, KV dtype, GPU, a kernel
that is not batch-invariant) greedy outputs may part ways at a near-tie, and later tokens are then
conditioned on different text. So the comparison walks both token lists position by position up to
the first divergence and asks:

- logprob divergence: over the positions where both chose the same token, the mean |candidate
  logprob - baseline logprob| (nats). A numerics change moves these a little; a corrupted KV read
  moves them a lot.
- token agreement: the share of compared positions that agree. A divergence that is a near-tie
  under the baseline (the candidate's token is among the baseline's top alternatives, within the
  divergence threshold of the baseline's own choice) is explained by numerics: the positions after
  it cannot be judged and count as agreeing. Any other divergence counts every position from it on
  as disagreeing.

Logprobs only say which tokens were chosen; the text is what users get. So where the tokens agree,
the texts must too (`text_contradiction`): a text that differs under identical tokens was changed
after sampling (detokenization, streaming), which no numerics change explains.

Inputs are the OpenAI logprobs shapes (`responses.token_logprobs`), as vLLM and SGLang return them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.operator.canary.responses import TokenLogprob


@dataclass(frozen=True)
class Divergence:
    position: int
    candidate_token: str
    baseline_token: str
    baseline_gap: float | None  # baseline logprob of its token minus that of the candidate's; None: not in its top
    near_tie: bool


@dataclass(frozen=True)
class LogprobAgreement:
    compared: int
    agreed_prefix: int
    token_agreement: float
    mean_logprob_divergence: float | None  # None when no agreed position carried both logprobs
    max_logprob_divergence: float | None
    divergence: Divergence | None
    ended_early: str | None = None  # "candidate" or "baseline": its answer has fewer tokens, all agreeing

    def describe(self) -> str:
        mean = "n/a" if self.mean_logprob_divergence is None else f"{self.mean_logprob_divergence:.3f}"
        text = f"{self.agreed_prefix}/{self.compared} tokens agree (agreement {self.token_agreement:.2f}), mean |dlogprob| {mean} nats"
        d = self.divergence
        if d is not None:
            gap = "not in the baseline's top alternatives" if d.baseline_gap is None else f"baseline gap {d.baseline_gap:.3f} nats"
            kind = "near-tie" if d.near_tie else "not a near-tie"
            text += f"; first divergence at token {d.position}: {d.candidate_token!r} vs {d.baseline_token!r} ({gap}, {kind})"
        if self.ended_early is not None:
            text += f"; the {self.ended_early}'s answer ends after {self.agreed_prefix} tokens, the other's after {self.compared}"
        return text


def compare(candidate: list[TokenLogprob], baseline: list[TokenLogprob], tie_threshold: float) -> LogprobAgreement:
    compared = min(len(candidate), len(baseline))
    diffs: list[float] = []
    divergence: Divergence | None = None
    for i in range(compared):
        c, b = candidate[i], baseline[i]
        if c.token != b.token:
            divergence = _divergence(i, c, b, tie_threshold)
            break
        if c.logprob is not None and b.logprob is not None:
            diffs.append(abs(c.logprob - b.logprob))
    agreed = divergence.position if divergence else compared
    ended_early = None
    if divergence is None and len(candidate) != len(baseline):
        # One answer ended (its end-of-sequence, a stop, an abort reported as one) where the other
        # went on: a divergence whose near-tie nobody can show, so the positions past the shorter
        # answer disagree. Compared up to the shorter only, a candidate that stopped after 2 of the
        # baseline's 8 tokens agreed 1.00 and passed (outside probe).
        ended_early = "candidate" if len(candidate) < len(baseline) else "baseline"
        compared = max(len(candidate), len(baseline))
    elif divergence is not None and not divergence.near_tie:
        # Every position from a divergence on disagrees, up to the end of the longer answer: counted
        # up to the shorter, a wrong token before a stop (3/4 = 0.75) passed where the stop alone,
        # one token sooner, failed (3/8).
        compared = max(len(candidate), len(baseline))
    if (divergence is None and ended_early is None) or (divergence is not None and divergence.near_tie):
        agreement = 1.0
    else:
        agreement = agreed / compared if compared else 1.0
    return LogprobAgreement(
        compared=compared, agreed_prefix=agreed, token_agreement=agreement, ended_early=ended_early,
        mean_logprob_divergence=sum(diffs) / len(diffs) if diffs else None,
        max_logprob_divergence=max(diffs) if diffs else None, divergence=divergence,
    )


def _divergence(position: int, c: TokenLogprob, b: TokenLogprob, tie_threshold: float) -> Divergence:
    gap = None
    if c.token in b.top and b.logprob is not None:
        gap = b.logprob - b.top[c.token]
    return Divergence(position, c.token, b.token, gap, near_tie=gap is not None and gap <= tie_threshold)


def judge(agreement: LogprobAgreement, min_token_agreement: float, max_logprob_divergence: float) -> str | None:
    """The problem with this agreement under the thresholds, or None when it is within them."""
    if agreement.compared == 0:
        return "no tokens to compare"
    if agreement.token_agreement < min_token_agreement:
        return f"token agreement {agreement.token_agreement:.2f} < {min_token_agreement:g}: {agreement.describe()}"
    mean = agreement.mean_logprob_divergence
    if mean is not None and mean > max_logprob_divergence:
        return f"mean logprob divergence {mean:.3f} > {max_logprob_divergence:g} nats: {agreement.describe()}"
    return None


def text_contradiction(
    candidate_text: str,
    baseline_text: str,
    candidate: list[TokenLogprob],
    baseline: list[TokenLogprob],
    agreement: LogprobAgreement,
) -> str | None:
    """Why the texts contradict the token comparison, or None (called when the texts differ).

    - Every token agrees and both have as many: the texts must be equal.
    - Otherwise the agreed tokens, joined, are a prefix of the baseline's text (when they are: an
      engine that shows a split UTF-8 character as `bytes:...` makes them not), so they must be a
      prefix of the candidate's too.
    """
    if candidate_text == baseline_text:
        return None
    if agreement.divergence is None and len(candidate) == len(baseline):
        return f"all {len(candidate)} tokens agree with the baseline's but the text differs"
    agreed = "".join(t.token for t in baseline[: agreement.agreed_prefix])
    if agreed and baseline_text.startswith(agreed) and not candidate_text.startswith(agreed):
        return f"the text differs from the baseline's within the first {agreement.agreed_prefix} tokens, where the tokens agree"
    return None
