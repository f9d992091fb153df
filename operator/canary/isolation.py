"""Isolation probe (S1, S5): what one request leaves behind must never reach another.

Sequential part: B alone; then, per size, a long request A whose prompt carries a fresh secret
nonce on every page, followed by B again. B must answer, give exactly its solo text, and never
contain the nonce. Sizes vary so freed pages are reused at different offsets. A leaking engine
shows up either as a different B (it read A's stale KV) or as an error on B (page tags caught the
stale read: still a failure, since a correct engine has nothing to catch).

Concurrent part: N tenants with distinct nonces at once; no output may contain another's nonce.
With a random-weights model outputs are gibberish: the checks are about equality and absence of
nonces, never about meaning.
"""

from __future__ import annotations

import asyncio

from kvguard.operator.canary.base import Outcome, Probe, RunContext, failed, passed
from kvguard.operator.canary.client import Completion
from kvguard.operator.canary.prompts import filler_text, make_nonce
from kvguard.operator.canary.report import Evidence, NonceLeak, Note, OutputMismatch
from kvguard.operator.canary.spec import ProbeName


class IsolationProbe(Probe):
    name = ProbeName.ISOLATION

    async def run(self, ctx: RunContext) -> Outcome:
        spec = ctx.spec.isolation
        reference = await ctx.solo(spec.probe_prompt)
        if not reference.ok:
            return failed(f"B alone failed: {reference.describe_failure()}", [reference.evidence()])
        problems: list[str] = []
        evidence: list[Evidence] = []
        sizes: list[int] = []
        for round_index, fraction in enumerate(spec.long_request_fractions):
            words = await self._long_round(ctx, round_index, fraction, reference, problems, evidence)
            sizes.append(words)
            if problems and ctx.spec.stop_on_failure:
                break
        if spec.tenants and not (problems and ctx.spec.stop_on_failure):
            await self._tenants(ctx, reference, problems, evidence)
        if problems:
            return failed(f"{problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), evidence)
        tokens = "/".join(ctx.estimate.tokens_for(w) for w in sizes)
        tenants = f" and {spec.tenants} concurrent tenants" if spec.tenants else ""
        reason = (
            f"B ({len(reference.text)} chars) identical to B alone after {len(sizes)} long request(s) A of "
            f"{'/'.join(map(str, sizes))} words ({tokens} tokens; {ctx.sizing_basis()}){tenants}; no nonce crossed requests"
        )
        return passed(reason, [Note(message=f"long requests of {sizes} filler words; {ctx.sizing_basis()}")])

    async def _long_round(
        self,
        ctx: RunContext,
        round_index: int,
        fraction: float,
        reference: Completion,
        problems: list[str],
        evidence: list[Evidence],
    ) -> int:
        spec = ctx.spec.isolation
        budget = ctx.admissible_tokens(spec.long_request_max_tokens)
        words = ctx.estimate.words_at_most(max(16, int(budget * fraction)))
        nonce = make_nonce(spec.nonce_length)
        label_a = f"A #{round_index + 1} ({words} words, nonce {nonce})"
        prompt_a = filler_text(words, ctx.spec.seed + 1000 + round_index, nonce, spec.nonce_every_words)
        a = await ctx.target.complete(
            prompt_a, api=ctx.spec.api, max_tokens=spec.long_request_max_tokens, label=label_a
        )
        if not a.ok:
            problems.append(f"long request {label_a} failed: {a.error}")
            evidence.append(a.evidence())
        check_b(await self._b(ctx, f"B after A #{round_index + 1}"), reference, {nonce: label_a}, problems, evidence)
        return words

    async def _b(self, ctx: RunContext, label: str) -> Completion:
        return await ctx.target.complete(
            ctx.spec.isolation.probe_prompt, api=ctx.spec.api, max_tokens=ctx.spec.max_tokens, label=label
        )

    async def _tenants(
        self, ctx: RunContext, reference: Completion, problems: list[str], evidence: list[Evidence]
    ) -> None:
        spec = ctx.spec.isolation
        nonces = [make_nonce(spec.nonce_length) for _ in range(spec.tenants)]
        # At most tenantPromptWords, and never more than one request may hold: a healthy server with
        # a short context refuses longer ones (a 400 is not isolation failing).
        words = min(spec.tenant_prompt_words, ctx.estimate.words_at_most(ctx.admissible_tokens(ctx.spec.max_tokens)))
        prompts = [
            filler_text(max(1, words), ctx.spec.seed + 2000 + i, nonce, max(1, spec.nonce_every_words // 3))
            for i, nonce in enumerate(nonces)
        ]
        results = await asyncio.gather(
            *(
                ctx.target.complete(p, api=ctx.spec.api, max_tokens=ctx.spec.max_tokens, label=f"tenant {i + 1}")
                for i, p in enumerate(prompts)
            )
        )
        for i, result in enumerate(results):
            if not result.ok:
                problems.append(f"concurrent {result.describe_failure()}")
                evidence.append(result.evidence())
                continue
            for j, nonce in enumerate(nonces):
                if j != i and nonce in result.text:
                    problems.append(f"tenant {i + 1}'s output contains tenant {j + 1}'s nonce")
                    evidence.append(NonceLeak(nonce=nonce, owner=f"tenant {j + 1}", found_in=result.label, output=result.text))
        owners = {nonce: f"tenant {i + 1}" for i, nonce in enumerate(nonces)}
        check_b(await self._b(ctx, "B after the tenants"), reference, owners, problems, evidence)


def check_b(
    b: Completion,
    reference: Completion,
    nonce_owners: dict[str, str],
    problems: list[str],
    evidence: list[Evidence],
) -> None:
    """B must answer, equal its solo output, and carry no other request's nonce."""
    if not b.ok:
        problems.append(f"{b.label} failed (a stale-KV read caught by page tags looks like this): {b.error}")
        evidence.append(b.evidence())
        return
    for nonce, owner in nonce_owners.items():
        if nonce in b.text:
            problems.append(f"{b.label}: output contains the secret nonce of {owner}")
            evidence.append(NonceLeak(nonce=nonce, owner=owner, found_in=b.label, output=b.text))
    if b.text != reference.text:
        problems.append(f"{b.label}: output differs from B alone (B read state another request left)")
        evidence.append(
            OutputMismatch(request=b.label, expected_from="B alone", expected=reference.text, actual=b.text)
        )
