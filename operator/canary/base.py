"""What every probe shares: the run context (clients, target facts, metrics) and the probe shape."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import aiohttp

from kvguard.operator.canary.client import Completion, EngineClient
from kvguard.operator.canary.engine_logs import EngineLog
from kvguard.operator.canary.metrics import WorkerSnapshot, fetch_all
from kvguard.operator.canary.prompts import FALLBACK_PROMPT_TOKENS, TokenEstimate, admissible_prompt_tokens, make_nonce
from kvguard.operator.canary.report import Evidence, NonceLeak, OutputMismatch, ProbeStatus, TargetInfo, one_line
from kvguard.operator.canary.spec import ApiKind, CanarySpec, ProbeName

SAME_ANSWER_MIN_PROMPTS = 4
"""How many different prompts answered alone must all get one text, each running to its token
budget, to fail the run, however short the text: two honest prompts may share a short answer
(outside probe: "The capital of France is" and "... of Italy is" both gave 'd' at maxTokens 1);
four different ones (golden, determinism, B, the tenants' filler) all filled with one text is a
server that does not read its prompt (NaN logits decode to '!' every step)."""


class ProbeSkipped(Exception):
    """Raised by a probe that cannot judge this target (e.g. no metrics); the message is the reason."""


@dataclass
class Outcome:
    status: ProbeStatus
    reason: str
    evidence: list[Evidence] = field(default_factory=list)


def passed(reason: str, evidence: Sequence[Evidence] = ()) -> Outcome:
    return Outcome(ProbeStatus.PASS, reason, list(evidence))


def failed(reason: str, evidence: Sequence[Evidence] = ()) -> Outcome:
    return Outcome(ProbeStatus.FAIL, reason, list(evidence))


def empty_answer(result: Completion) -> str:
    """Why an answer without text cannot be judged (for a skip reason). Identical empty outputs
    cannot show a stale-KV read and no text can carry a nonce, so passing on them would claim what
    was not seen; failing would blame a server whose greedy output decodes to nothing (special
    tokens only), so the probes that judge text skip instead."""
    usage = f", usage says {result.completion_tokens} completion token(s)" if result.completion_tokens else ""
    return (
        f"{result.label}: the answer carries no text (finish_reason {result.finish_reason}{usage}, "
        f"max_tokens={result.max_tokens}): empty outputs prove nothing"
    )


@dataclass(frozen=True)
class Heard:
    """One answer received while secret nonces were out: its text, the nonces its own prompt
    carried, and every nonce out at the time that the whole response carried. The whole response
    (the JSON body, or every line of the stream) is searched, not only the text the probes
    compare: a nonce can leak into any field a client reads -- reasoning content, tool-call
    arguments, logprob tokens, a choice the text's reader never picks (outside probe: each passed
    while only the text was searched). It is searched once, when heard, and not kept: the suite
    kept every response whole, and a candidate's 16 MB answers took the operator to 5.4 GB
    (outside probe). A nonce handed out later cannot be in an answer heard before it."""

    label: str
    text: str
    owned: frozenset[str]
    found: tuple[tuple[str, str], ...] = ()  # (nonce, what a report shows of the answer for it)

    @classmethod
    def of(cls, label: str, text: str, raw: str, owned: frozenset[str], nonces: Iterable[str]) -> Heard:
        found = tuple((nonce, _showing(nonce, text, raw)) for nonce in nonces if nonce in text or nonce in raw)
        return cls(label, text, owned, found)

    def carries(self, nonce: str) -> bool:
        return any(nonce == seen for seen, _ in self.found)

    def showing(self, nonce: str) -> str:
        return next((shown for seen, shown in self.found if seen == nonce), self.text)


def _showing(nonce: str, text: str, raw: str) -> str:
    """What a report shows of an answer carrying `nonce`: its text, or the part of the response
    around the nonce when the nonce is outside the text."""
    if nonce in text:
        return text
    at = raw.index(nonce)
    return f"(outside the answer's text, in the response) ...{raw[max(0, at - 120):at + len(nonce) + 120]}..."


@dataclass
class RunContext:
    """State shared by the probes of one suite run."""

    spec: CanarySpec
    session: aiohttp.ClientSession
    target: EngineClient
    baseline: EngineClient | None
    metrics_urls: list[str]
    info: TargetInfo
    estimate: TokenEstimate = field(default_factory=TokenEstimate)
    start_snapshots: list[WorkerSnapshot] = field(default_factory=list)
    # Counter totals just before and after the abort probe (see SafetyCountersSpec).
    abort_window: tuple[dict[str, float], dict[str, float]] | None = None
    # Engine logs, each marked when the suite started (SGLang's KV canary, `engine_logs`).
    engine_logs: list[EngineLog] = field(default_factory=list)
    _solo: dict[tuple[str, str, int, bool], Completion] = field(default_factory=dict)
    # Every nonce handed out (nonce -> the request it belongs to), and every answer heard since the
    # first one: any answer carrying a nonce its prompt did not is a cross-request leak (S1).
    nonce_owners: dict[str, str] = field(default_factory=dict)
    heard: list[Heard] = field(default_factory=list)

    def issue_nonce(self, length: int, owner: str) -> str:
        nonce = make_nonce(length)
        self.nonce_owners[nonce] = owner
        return nonce

    def observe(self, prompt: str, result: Completion) -> None:
        """EngineClient observer: keep answers while nonces are out (none can leak before)."""
        if self.nonce_owners and (result.text or result.body):
            owned = frozenset(n for n in self.nonce_owners if n in prompt)
            self.heard.append(Heard.of(result.label, result.text, result.body, owned, self.nonce_owners))

    def foreign_nonces(self, since: int = 0, reported: set[tuple[str, str]] | None = None) -> list[NonceLeak]:
        """Leaks in the answers heard from index `since` on, minus (nonce, request) pairs already reported."""
        leaks = []
        for heard in self.heard[since:]:
            for nonce, owner in self.nonce_owners.items():
                if nonce not in heard.owned and heard.carries(nonce) and (nonce, heard.label) not in (reported or set()):
                    leaks.append(NonceLeak(nonce=nonce, owner=owner, found_in=heard.label, output=heard.showing(nonce)))
        return leaks

    @property
    def metrics_reachable(self) -> bool:
        return any(s.reachable for s in self.start_snapshots)

    async def snapshots(self) -> list[WorkerSnapshot]:
        return await fetch_all(self.session, self.metrics_urls, self.spec.request_timeout_seconds)

    def admissible_tokens(self, reserve_tokens: int) -> int:
        return admissible_prompt_tokens(self.info.context_length, self.info.min_pool_tokens, reserve_tokens)

    def sizing_basis(self) -> str:
        """What long prompts were sized from, for the reasons and notes of the probes."""
        info = self.info
        context, pool = info.context_length, info.min_pool_tokens
        if context is None and pool is None:
            return f"context length unknown: sized from a {FALLBACK_PROMPT_TOKENS:,}-token fallback (pass --context-length)"
        parts = []
        if context is not None:
            parts.append(f"context {context:,} ({info.context_length_source})")
        if pool is not None:
            parts.append(f"smallest KV pool {pool:,}")
        return "sized from " + " and ".join(parts)

    async def solo(
        self, prompt: str, *, api: ApiKind | None = None, max_tokens: int | None = None, stream: bool = False
    ) -> Completion:
        """The reference output of `prompt` run alone (cached: first successful answer wins)."""
        api = api or self.spec.api
        max_tokens = max_tokens or self.spec.max_tokens
        key = (prompt, api, max_tokens, stream)
        if key not in self._solo:
            streamed = ", streamed" if stream else ""
            result = await self.target.complete(
                prompt, api=api, max_tokens=max_tokens, stream=stream, label=f"{api}{streamed}: reference (alone)"
            )
            if not result.ok:
                return result
            self._solo[key] = result
        return self._solo[key]

    def solo_heard(self, prompt: str, api: ApiKind, max_tokens: int, stream: bool = False) -> Completion | None:
        """The answer alone `solo` cached for these, without sending anything; None when none was."""
        return self._solo.get((prompt, api, max_tokens, stream))

    def answers_to_other_prompts(self, prompt: str) -> list[str]:
        """The text of every answer heard so far to a prompt other than `prompt`: the answers alone
        to other prompts, and every answer heard since nonces went out whose prompt does not carry
        `prompt`'s nonces (none when `prompt` carries none: its answers cannot be told apart)."""
        mine = {nonce for nonce in self.nonce_owners if nonce in prompt}
        heard = [h.text for h in self.heard if mine and not h.owned & mine]
        return [c.text for (other, *_), c in self._solo.items() if other != prompt] + heard

    def remember_solo(self, prompt: str, api: ApiKind, max_tokens: int, result: Completion) -> None:
        if result.ok:
            self._solo.setdefault((prompt, api, max_tokens, False), result)

    def one_answer_alone(self) -> tuple[str, int, list[Completion]] | None:
        """The one text every prompt heard alone got, with those answers, when at least
        SAME_ANSWER_MIN_PROMPTS different prompts (golden, determinism, B, the tenants) all got the
        same non-empty text, whatever its length, and every one ran to its token budget
        (`finish_reason` "length"): a server that ignores its prompt (NaN logits decode to '!' every
        step). An answer that ended by itself may honestly be every prompt's: a guard model says
        "safe" to each harmless prompt (outside audit), so one such answer clears the rule. Only
        answers asked for at least two tokens count: one greedy token may honestly be several
        prompts' next word. (text, how many prompts, their answers), or None."""
        answers = [c for (_prompt, _api, max_tokens, _stream), c in self._solo.items() if max_tokens >= 2]
        prompts = {key[0] for key in self._solo if key[2] >= 2}
        texts = {c.text for c in answers}
        if len(prompts) < SAME_ANSWER_MIN_PROMPTS or len(texts) != 1 or not answers[0].text:
            return None
        if any(c.finish_reason != "length" for c in answers):
            return None
        return answers[0].text, len(prompts), answers

    def one_answer_failure(self) -> Outcome | None:
        """A failure when every prompt heard alone got one text (`one_answer_alone`), else None."""
        found = self.one_answer_alone()
        if found is None:
            return None
        text, prompts, answers = found
        evidence: list[Evidence] = [OutputMismatch(request=a.label, expected_from="an answer to its own prompt",
                                                   expected="(any other text)", actual=a.text) for a in answers[:4]]  # fmt: skip
        return failed(f"all {prompts} different prompts answered alone got the same answer {one_line(text, 60)!r}: the "
                      "server does not answer its prompt (a fixed text, an error in a 200, NaN logits)", evidence)  # fmt: skip


class Probe(abc.ABC):
    """One check. `run` returns an Outcome or raises ProbeSkipped; it never raises for a server's
    misbehaviour (that is a failure with evidence)."""

    name: ClassVar[ProbeName]

    @abc.abstractmethod
    async def run(self, ctx: RunContext) -> Outcome: ...
