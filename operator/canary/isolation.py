"""Isolation probe (S1, S5): what one request leaves behind must never reach another.

Sequential part: B alone; then, per size, a long request A whose prompt carries a fresh secret
nonce on every page, followed by B again. B must answer, give exactly its solo text, and never
contain the nonce. Sizes vary so freed pages are reused at different offsets. A leaking engine
shows up either as a different B (it read A's stale KV) or as an error on B (page tags caught the
stale read: still a failure, since a correct engine has nothing to catch). After the last size, A #1
is sent once more (its own prompt and nonce) and must give exactly its first answer: a leak that only
long prompts show (one served the previous long prompt's KV) changes no B.

Concurrent part: N tenants whose prompts share their first half and carry distinct nonces in the
second, each first alone (its solo answer), then all at once (taking turns over the paths below,
then again all on the main path, where a mix-up within one endpoint shows), then as one request with a prompt
list and two choices per prompt (one batch by construction, and each prompt's KV forked for its
second choice, as vLLM and SGLang do for `n`; both of prompt i's choices must be tenant i's answer). No output may contain
another's nonce, and no tenant may get another's answer: a server that hands tenant 1 the text
generated for tenant 2 leaks without ever echoing a nonce. Last, each tenant's prompt is asked alone
once more on the main path and must give its first answer alone: every check above compares with
that answer, which a request whose KV wrapped the pool may itself have read from stale slots. An answer is attributed to the solo
answer it is most alike; one that is another tenant's fails. One that merely differs from its own
solo answer is noted, not failed: batched kernels may break a near tie differently from a batch of
one (vLLM on GPUs does). With a random-weights model outputs are gibberish: the checks are about
equality and absence of nonces, never about meaning.

Every B runs on each path an answer can take: spec.api and the other endpoint when the server
serves it (a chat template may be missing: then it is noted, not failed), each plain and streamed;
tenants take turns over those paths, then run all at once on each of them (two chats, two chat
streams in flight together), and their concurrent usage must count their own prompts (each
tenant's prompt has its own length). Tenant 1's prompt is also asked alone with `n` = 2 on each
path, plain and streamed: both choices must be its answer alone. The tenants then run at once once more, sampling
with the server's defaults (no temperature, no seed), judged by their nonces alone. Finally every
answer the suite heard since the first nonce went out, from any probe, is searched for a nonce its
own prompt did not carry: the whole response, not only its text (reasoning content, tool calls,
logprob tokens and every choice carry text a client reads). A B alone with no text skips
the probe: empty outputs are trivially identical and carry no nonce, so they prove nothing.
"""

from __future__ import annotations

import asyncio
import difflib
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvguard.operator.canary.base import Outcome, Probe, ProbeSkipped, RunContext, empty_answer, failed, passed
from kvguard.operator.canary.client import Completion
from kvguard.operator.canary.prompts import CALIBRATION_WORDS, TokenEstimate, filler_text
from kvguard.operator.canary.report import Evidence, NonceLeak, Note, OutputMismatch, clip, one_line
from kvguard.operator.canary.spec import LONG_PROMPT_MIN_TOKENS, ApiKind, ProbeName

CHOICES_PER_PROMPT = 2
"""`n` of the tenants' prompt list: a second choice makes the server fork each prompt's KV."""


def long_request_words(estimate: TokenEstimate, budget: int, fraction: float) -> int:
    """Filler words of a long request A: `fraction` of the admissible prompt length `budget`, at
    least 16 tokens. The spec keeps fractions in (0, 1]; one outside (a spec built around its
    checks) is read as 1 here, so that nothing it says sizes A beyond the admissible length: the
    prompt is built synchronously on the operator's loop, and 1e300 built a word list without end
    (outside probe)."""
    share = fraction if 0.0 < fraction <= 1.0 else 1.0  # NaN too: every comparison with it is false
    return estimate.words_at_most(max(LONG_PROMPT_MIN_TOKENS, int(budget * share)))


@dataclass(frozen=True)
class Channel:
    """One way an answer reaches a client, with B's solo answer on it. A leak may show on only one:
    a stream path or the chat endpoint can share less code with the plain completion than expected."""

    api: ApiKind
    stream: bool
    reference: Completion
    main: bool = False

    def describe(self) -> str:
        return f"{self.api}{', streamed' if self.stream else ''}"

    def label(self, base: str) -> str:
        """Request labels on the main channel stay as they were; others name their path."""
        return base if self.main else f"{base} ({self.describe()})"


class IsolationProbe(Probe):
    name = ProbeName.ISOLATION

    async def run(self, ctx: RunContext) -> Outcome:
        spec = ctx.spec.isolation
        reference = await ctx.solo(spec.probe_prompt)
        if not reference.ok:
            return failed(f"B alone failed: {reference.describe_failure()}", [reference.evidence()])
        if not reference.text:
            raise ProbeSkipped(empty_answer(reference))
        mark = len(ctx.heard)
        problems: list[str] = []
        evidence: list[Evidence] = []
        channels = await self._channels(ctx, Channel(ctx.spec.api, False, reference, main=True), evidence)
        sizes: list[int] = []
        longs: list[tuple[int, Completion]] = []
        asked: list[tuple[str, Completion]] = []
        for round_index, fraction in enumerate(spec.long_request_fractions):
            if problems and ctx.spec.stop_on_failure:
                break
            words, prompt_a, a = await self._long_round(ctx, round_index, fraction, channels, problems, evidence)
            sizes.append(words)
            longs.append((words, a))
            asked.append((prompt_a, a))
        check_prompts_counted(longs, problems, evidence, ctx.estimate)
        for prompt_a, a in asked:  # each long request again, after all of them
            if problems and ctx.spec.stop_on_failure:
                break
            await self._long_again(ctx, prompt_a, a, problems, evidence)
        if spec.tenants and not (problems and ctx.spec.stop_on_failure):
            await self._tenants(ctx, channels, problems, evidence)
        report_leaks(ctx, mark, problems, evidence)
        if not problems and (everywhere := ctx.one_answer_failure()) is not None:
            # Every B equals B alone and every tenant its answer alone when all answers are one
            # text ('!!!!!!!!' from NaN logits): equality proves nothing then (outside probe).
            return everywhere
        if problems:
            return failed(f"{problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), evidence)
        tokens = "/".join(ctx.estimate.tokens_for(w) for w in sizes)
        tenants = f" and {spec.tenants} concurrent tenants sharing a prefix, none given another's answer" if spec.tenants else ""
        paths = "; ".join(c.describe() for c in channels)
        reason = (
            f"B ({len(reference.text)} chars) identical to B alone after {len(sizes)} long request(s) A of "
            f"{'/'.join(map(str, sizes))} words ({tokens} tokens; {ctx.sizing_basis()}){tenants}, on {paths}; "
            "no nonce crossed requests in any answer"
        )
        notes = [e for e in evidence if isinstance(e, Note)]
        return passed(reason, [Note(message=f"long requests of {sizes} filler words; {ctx.sizing_basis()}"), *notes])

    async def _channels(self, ctx: RunContext, main: Channel, evidence: list[Evidence]) -> list[Channel]:
        """The main channel, its streamed twin and the other endpoint, plain and streamed, each with
        B's solo answer (streamed chat, what chat UIs use, was checked nowhere: outside probe)."""
        channels = [main]
        other: ApiKind = "chat" if main.api == "completions" else "completions"
        for api, stream in ((main.api, True), (other, False), (other, True)):
            reference = await ctx.solo(ctx.spec.isolation.probe_prompt, api=api, stream=stream)
            channel = Channel(api, stream, reference)
            if reference.ok and reference.text:
                channels.append(channel)
                continue
            # Not a failure: a base model has no chat template (vLLM: 400), some servers do not
            # stream; determinism judges streaming. Said in the evidence, and left out of the reason.
            why = empty_answer(reference) if reference.ok else reference.describe_failure()
            evidence.append(Note(message=f"{channel.describe()} not checked: {why}"))
        return channels

    async def _long_round(
        self,
        ctx: RunContext,
        round_index: int,
        fraction: float,
        channels: list[Channel],
        problems: list[str],
        evidence: list[Evidence],
    ) -> tuple[int, str, Completion]:
        """One long request A carrying a fresh nonce, then B on every path: (A's words, prompt, answer)."""
        spec = ctx.spec.isolation
        words = long_request_words(ctx.estimate, ctx.admissible_tokens(spec.long_request_max_tokens), fraction)
        nonce = ctx.issue_nonce(spec.nonce_length, f"A #{round_index + 1}")
        label_a = f"A #{round_index + 1} ({words} words, nonce {nonce})"
        prompt_a = filler_text(words, ctx.spec.seed + 1000 + round_index, nonce, spec.nonce_every_words)
        a = await ctx.target.complete(
            prompt_a, api=ctx.spec.api, max_tokens=spec.long_request_max_tokens, label=label_a
        )
        if not a.ok:
            problems.append(f"long request {label_a} failed: {a.error}")
            evidence.append(a.evidence())
        await self._b_everywhere(ctx, channels, f"B after A #{round_index + 1}", {nonce: label_a}, problems, evidence)
        return words, prompt_a, a

    async def _long_again(
        self, ctx: RunContext, prompt_a: str, first: Completion, problems: list[str], evidence: list[Evidence]
    ) -> None:
        """A long request once more after every long request: greedy, a batch of one, the same
        server, so the same answer, as B's after A. B is short: a leak that only hits long prompts
        (a long prompt served the previous long prompt's KV) changed no B and passed (outside probe);
        and one that only hit prompts over ~0.6 of the context changed only A #2, when A #1 alone was
        asked again (another). Its nonce is its own, so the nonce checks see no foreign one in it."""
        if not first.ok:
            return  # already failed, in its round
        def ask(label: str) -> Awaitable[Completion]:
            return ctx.target.complete(prompt_a, api=ctx.spec.api, max_tokens=ctx.spec.isolation.long_request_max_tokens, label=label)

        await check_repeat(ask, first, f"{first.label}, again after the others", lambda again: f"long request {again.label} failed: {again.error}",
                           "its first answer", "a long request's answer depended on what ran before it (it read KV another long "
                           "request left)", problems, evidence, others=ctx.answers_to_other_prompts(prompt_a))  # fmt: skip

    async def _b_everywhere(
        self,
        ctx: RunContext,
        channels: list[Channel],
        label: str,
        owners: dict[str, str],
        problems: list[str],
        evidence: list[Evidence],
    ) -> None:
        for channel in channels:
            b = await ctx.target.complete(
                ctx.spec.isolation.probe_prompt, api=channel.api, max_tokens=ctx.spec.max_tokens,
                stream=channel.stream, label=channel.label(label),
            )
            check_b(b, channel.reference, owners, problems, evidence)

    async def _tenants(
        self, ctx: RunContext, channels: list[Channel], problems: list[str], evidence: list[Evidence]
    ) -> None:
        spec = ctx.spec.isolation
        nonces = [ctx.issue_nonce(spec.nonce_length, f"tenant {i + 1}") for i in range(spec.tenants)]
        # At most tenantPromptWords, and never more than one request may hold: a healthy server with
        # a short context refuses longer ones (a 400 is not isolation failing).
        every = max(1, spec.nonce_every_words // 3)
        words = tenant_prompt_words(ctx.estimate, ctx.admissible_tokens(ctx.spec.max_tokens), spec.tenant_prompt_words,
                                    spec.nonce_length, every)  # fmt: skip
        # The first half is the same for every tenant: a prefix cache (vLLM's blocks, SGLang's radix
        # tree) serves it to all of them, so a cache that hands one tenant's pages past the shared
        # part to another shows here. Each tenant's own half carries its nonce.
        # Each tenant's own half one word shorter than the one before: prompts of one length made
        # usage swapped between tenants invisible (outside probe).
        own = max(1, words - words // 2)
        shared = filler_text(words // 2, ctx.spec.seed + 1999) + " " if words // 2 else ""
        prompts = [
            shared + filler_text(max(1, own - i), ctx.spec.seed + 2000 + i, nonce, every)
            for i, nonce in enumerate(nonces)
        ]
        # Tenants take turns over the channels, so concurrent streams and chats are covered too;
        # then all of them at once on each channel, where a mix-up within one endpoint (rows of one
        # batch, responses of one connection pool) shows (outside probes: never exercised, then
        # only on the main channel, so two chats were never in flight together).
        await self._concurrently(ctx, prompts, nonces, [channels[i % len(channels)] for i in range(len(prompts))], problems, evidence)
        if len(channels) > 1:  # (with one channel, the turns above were all on it)
            for channel in channels:
                await self._concurrently(ctx, prompts, nonces, [channel] * len(prompts), problems, evidence)
        await self._prompt_list(ctx, prompts, nonces, problems, evidence)
        for channel in channels:  # streamed too: the choices' chunks interleave in one stream
            await self._choices_of_one(ctx, channel, prompts[0], nonces, problems, evidence)
        await self._alone_again(ctx, prompts, problems, evidence)
        owners = {nonce: f"tenant {i + 1}" for i, nonce in enumerate(nonces)}
        await self._b_everywhere(ctx, channels, "B after the tenants", owners, problems, evidence)
        await self._sampled(ctx, prompts, channels, problems, evidence)

    async def _concurrently(
        self, ctx: RunContext, prompts: list[str], nonces: list[str], paths: list[Channel], problems: list[str],
        evidence: list[Evidence],
    ) -> None:  # fmt: skip
        """Each tenant alone on its path, then all at once: each must get its own answer."""
        solos = [await ctx.solo(p, api=c.api, stream=c.stream) for p, c in zip(prompts, paths)]
        await self._same_answers_alone(ctx, prompts, [(c.api, c.stream) for c in paths], solos, problems, evidence)
        results = await asyncio.gather(*(self._tenant(ctx, c, i, p) for i, (p, c) in enumerate(zip(prompts, paths))))
        for i, result in enumerate(results):
            if not result.ok:
                problems.append(f"concurrent {result.describe_failure()}")
                evidence.append(result.evidence())
                continue
            check_tenant_answer(i, result, nonces, [s.text if s.ok else None for s in solos], problems, evidence)
            check_own_usage(result, solos[i], problems, evidence)
        check_answers_not_emptied(results, solos, problems)

    async def _sampled(
        self, ctx: RunContext, prompts: list[str], channels: list[Channel], problems: list[str], evidence: list[Evidence]
    ) -> None:
        """The tenants at once again, taking turns over the paths, sampling as most production
        traffic does (the server's default temperature, no seed): engines sample on other code than
        greedy decoding (per-request generators, seeds, penalties), and a leak there showed on no
        greedy request (outside probe). Sampled text has no reference to equal, so only the nonce
        sweep judges these answers (`report_leaks`); one that fails where greedy ones were answered
        fails, one the server refuses is noted."""
        turns = [channels[i % len(channels)] for i in range(len(prompts))]
        results = await asyncio.gather(*(
            ctx.target.complete(p, api=c.api, max_tokens=ctx.spec.max_tokens, stream=c.stream, sampled=True,
                                label=c.label(f"tenant {i + 1}, sampled"))
            for i, (p, c) in enumerate(zip(prompts, turns))
        ))  # fmt: skip
        for result in results:
            if result.ok:
                continue
            if result.status is not None and 400 <= result.status < 500:
                evidence.append(Note(message=f"{result.label} not checked: {result.describe_failure()}"))
            else:
                problems.append(f"{result.describe_failure()}, although its greedy twin was answered")
                evidence.append(result.evidence())

    async def _alone_again(self, ctx: RunContext, prompts: list[str], problems: list[str], evidence: list[Evidence]) -> None:
        """Each tenant's prompt alone once more on the main path, past the cache of answers alone:
        it must equal its first answer alone there. Every concurrent and batched answer was
        compared with that first one, so a leak in it (a request whose KV wrapped the pool and read
        a stale slot) made the later checks compare against the leak (outside probe)."""
        for i, prompt in enumerate(prompts):
            first = ctx.solo_heard(prompt, ctx.spec.api, ctx.spec.max_tokens)
            if first is None:
                continue  # it was not answered alone: reported where it happened
            def ask(label: str, prompt: str = prompt) -> Awaitable[Completion]:
                return ctx.target.complete(prompt, api=ctx.spec.api, max_tokens=ctx.spec.max_tokens, label=label)

            await check_repeat(ask, first, f"tenant {i + 1} alone again", lambda again: f"{again.describe_failure()}, although "
                               "it was answered alone before", f"tenant {i + 1} alone, first time", "one of them read state "
                               "another request left", problems, evidence, called="its first answer alone",
                               others=ctx.answers_to_other_prompts(prompt))  # fmt: skip

    async def _same_answers_alone(
        self, ctx: RunContext, prompts: list[str], paths: list[tuple[ApiKind, bool]], solos: list[Completion],
        problems: list[str], evidence: list[Evidence],
    ) -> None:  # fmt: skip
        """Two tenants whose prompts differ (they share only their first half) but whose answers
        alone are the same: a prefix cache that hands one's KV to the other (a hash collision,
        vLLM's CVE-2025-25183) contaminates the "alone" answers themselves, so the concurrent
        checks compare against the leak (outside probe). The baseline tells it from a model that
        answers both alike: it fails when the baseline's answers differ, and is noted without one."""
        same = [(i, j) for i in range(len(solos)) for j in range(i + 1, len(solos))
                if solos[i].ok and solos[j].ok and solos[i].text and solos[i].text == solos[j].text]  # fmt: skip
        if not same:
            return
        # A baseline with other numerics answers differently anyway. One that serves another model is
        # not given at all (the operator drops it: backends.base._start_canary). `compareBaseline`
        # is golden's alone: off, this check still judges by the baseline, as a leak must not pass
        # because a user (or an older operator's fingerprint) turned golden's comparison off.
        if ctx.baseline is None or ctx.spec.golden.baseline_match != "exact":
            why = "a baseline" if ctx.baseline is None else "a baseline with the same numerics (baselineMatch exact)"
            pairs = ", ".join(f"{i + 1} and {j + 1}" for i, j in same)
            if any(f"tenants {pairs} got the same answer alone" in getattr(e, "message", "") for e in evidence):
                return  # said once (the answers alone are cached: each round sees the same ones)
            # " not checked": the table prints it under a passing row (kvguard.commands.canary.LEFT_OUT).
            evidence.append(Note(message=f"tenants {pairs} got the same answer alone to different prompts; a prefix-cache "
                                         f"collision not checked: without {why} this cannot tell one from the model's own "
                                         "answer"))  # fmt: skip
            return
        for i, j in same:
            collision = f"tenants {i + 1} and {j + 1} got the same answer alone to different prompts"
            if any(p.startswith(collision) for p in problems):
                continue  # failed once already (a later round may see the same cached answers alone)
            refs = [await ctx.baseline.complete(prompts[k], api=paths[k][0], max_tokens=ctx.spec.max_tokens,
                                                stream=paths[k][1], label=f"tenant {k + 1} on baseline") for k in (i, j)]  # fmt: skip
            if all(r.ok for r in refs) and refs[0].text != refs[1].text:
                problems.append(f"{collision}, which the baseline answers differently: one was served the other's KV "
                                "(a prefix-cache collision)")  # fmt: skip
                evidence.append(OutputMismatch(request=f"tenant {j + 1} alone", expected_from=f"tenant {j + 1} on baseline "
                                               f"(tenant {i + 1}'s: {one_line(refs[0].text, 60)!r})",
                                               expected=refs[1].text, actual=solos[j].text))  # fmt: skip

    async def _prompt_list(
        self, ctx: RunContext, prompts: list[str], nonces: list[str], problems: list[str], evidence: list[Evidence]
    ) -> None:
        """The tenants' prompts again, as one completions request with a prompt list and `n` =
        CHOICES_PER_PROMPT: the server batches them by construction and forks each prompt's KV for
        its further choices; every choice of prompt i must be tenant i's answer alone (greedy: the
        choices of one prompt are the same answer). A server that refuses `n` > 1 is checked with
        one choice each and noted; one that takes no lists (or no completions) is noted, not failed;
        one that answers the batch with a server error (twice) fails."""
        if len(prompts) < 2:
            return
        solos = [await ctx.solo(p, api="completions") for p in prompts]
        if not all(s.ok for s in solos):
            evidence.append(Note(message="prompt list not checked: the completions endpoint did not answer each prompt alone"))
            return
        # These answers alone are what the choices are compared with: a prefix cache that gave one
        # tenant's to another (on this endpoint only) would turn every right choice into a mere
        # difference (outside probe: a false pass), so they are checked as the channels' are.
        await self._same_answers_alone(ctx, prompts, [("completions", False)] * len(prompts), solos, problems, evidence)
        n = CHOICES_PER_PROMPT
        batch, texts = await ctx.target.complete_list(prompts, max_tokens=ctx.spec.max_tokens, label="prompt list", n=n)
        if not batch.ok and batch.status is not None and batch.status >= 500:  # once more: a blip is not a verdict
            batch, texts = await ctx.target.complete_list(prompts, max_tokens=ctx.spec.max_tokens, label="prompt list", n=n)
        if not batch.ok and batch.status is not None and batch.status >= 500:
            # Each prompt alone was answered: a server error on the batch is its batched, forked path
            # failing (ours answers 500 kv_tag_violation when a read is caught on a stale page, S1).
            problems.append(f"{batch.describe_failure()} (n: {n}), twice, although each prompt alone was answered: "
                            "the server fails them batched, each prompt's KV forked")  # fmt: skip
            evidence.append(batch.evidence())
            return
        if batch.clipped:  # more text than its tokens make: not its tokens' text, a failure as on every other path
            problems.append(f"prompt list: {batch.error}")
            evidence.append(batch.evidence())
            return
        if not batch.ok and batch.status is not None and 400 <= batch.status < 500:
            evidence.append(Note(message=f"n: {n} not checked: {batch.describe_failure()}"))
            n = 1
            batch, texts = await ctx.target.complete_list(prompts, max_tokens=ctx.spec.max_tokens, label="prompt list")
        if not batch.ok:
            evidence.append(Note(message=f"prompt list not checked: {batch.describe_failure()}"))
            return
        alone: list[str | None] = [s.text for s in solos]
        if extra := sorted(set(texts) - set(range(len(prompts) * n))):
            # A client reads every choice it is sent: one no prompt of the request asked for is
            # another request's answer (outside probe: only the expected indices were read).
            problems.append(f"prompt list: choice index(es) {extra} beyond the {len(prompts)} prompts x n: {n} asked for: "
                            "an answer this request does not own")  # fmt: skip
            evidence.append(batch.evidence())
        for k in range(len(prompts) * n):
            i = k // n
            answer = Completion(label=f"prompt list, choice {k} (tenant {i + 1}'s prompt)", status=200, text=texts.get(k, ""),
                                finish_reason=batch.choice_finishes.get(k))  # fmt: skip
            if k not in texts:
                problems.append(f"{answer.label}: missing from the {len(texts)} choice(s) returned")
                evidence.append(batch.evidence())
                continue
            check_tenant_answer(i, answer, nonces, alone, problems, evidence)

    async def _choices_of_one(
        self, ctx: RunContext, channel: Channel, prompt: str, nonces: list[str], problems: list[str],
        evidence: list[Evidence],
    ) -> None:
        """Tenant 1's prompt alone with `n` = CHOICES_PER_PROMPT on `channel`: greedy, its choices
        must be one answer, its answer alone there (`check_choice`). `n` was sent only with a
        prompt list, so a server that gave a single prompt's second choice another request's
        answer passed (outside probe); and never streamed, where a server routes each choice's
        chunks by index. A server that refuses `n` > 1, or ignores it, is noted."""
        solo = await ctx.solo(prompt, api=channel.api)
        if not solo.ok or not solo.text:
            return  # its own failure is reported by the rounds above
        n = CHOICES_PER_PROMPT
        label = f"tenant 1, n: {n} ({channel.describe()})"
        answer, texts = await ctx.target.complete_list(prompt, max_tokens=ctx.spec.max_tokens, label=label, n=n,
                                                       api=channel.api, stream=channel.stream)  # fmt: skip
        if not answer.ok:
            if answer.status is not None and 400 <= answer.status < 500:
                evidence.append(Note(message=f"{label} not checked: {answer.describe_failure()}"))
            else:
                problems.append(f"{answer.describe_failure()}, although the prompt alone with one choice was answered")
                evidence.append(answer.evidence())
            return
        if len(texts) < n:  # n ignored (some servers answer one choice): no isolation question, but say so
            evidence.append(Note(message=f"{label}: {len(texts)} choice(s) returned for n: {n}; each is checked"))
        others = ctx.answers_to_other_prompts(prompt)
        for k, text in sorted(texts.items()):
            choice = Completion(label=f"{label}, choice {k}", status=200, text=text, finish_reason=answer.choice_finishes.get(k))
            check_no_other_nonce(0, choice, nonces, problems, evidence)
            check_choice(choice, solo.text, others, problems, evidence)  # (check_own_answer's note, said for a choice)
        if len(set(texts.values())) > 1 and not any(p.startswith(label) for p in problems):
            # Rows of one batch with the same input compute alike: greedy choices of one request
            # that differ mean one of them carries another request's output, whoever's it is.
            problems.append(f"{label}: its greedy choices differ ({', '.join(repr(one_line(t, 40)) for t in texts.values())}): "
                            "one of them carries another request's output")  # fmt: skip
            evidence.append(answer.evidence())

    async def _tenant(self, ctx: RunContext, channel: Channel, index: int, prompt: str) -> Completion:
        return await ctx.target.complete(
            prompt, api=channel.api, max_tokens=ctx.spec.max_tokens, stream=channel.stream,
            label=channel.label(f"tenant {index + 1}"),
        )


def report_leaks(ctx: RunContext, since: int, problems: list[str], evidence: list[Evidence]) -> None:
    """Fail on any answer heard since `since` (any probe, any path) that carries another request's
    nonce and was not already reported by a probe's own check."""
    reported = {(e.nonce, e.found_in) for e in evidence if isinstance(e, NonceLeak)}
    for leak in ctx.foreign_nonces(since, reported):
        problems.append(f"{leak.found_in}: output contains the secret nonce of {leak.owner}")
        evidence.append(leak)


async def check_repeat(
    ask: Callable[[str], Awaitable[Completion]], first: Completion, label: str, failure: Callable[[Completion], str],
    expected_from: str, why: str, problems: list[str], evidence: list[Evidence], called: str | None = None,
    others: Sequence[str] = (),
) -> None:  # fmt: skip
    """A request asked again (`ask(label)`) must be answered, with its first answer: greedy, a
    batch of one, the same server. `failure` words the problem when it is not answered, `why` what
    a difference means, `called` how the message names the first answer (default: `expected_from`).

    A different answer is asked for a third time. If the third repeats the second, the difference
    is the server's numerics, not state another request left: a prefix cache (vLLM's, SGLang's)
    serves the repeat from the first one's KV, and its kernels may break a near tie differently from
    the cold prefill (an outside audit; B is too short to hit such a cache). That is noted, unless
    either answer goes on, where the two part, as an answer to another prompt in `others` does:
    then one of them was another request's (a leaked answer alone is repeated correctly later). A third answer that
    differs again fails, as a leak that moves with the pool's state does."""
    again = await ask(label)
    if not again.ok:
        problems.append(failure(again))
        evidence.append(again.evidence())
        return
    if again.text == first.text:
        return
    third = await ask(f"{label}, a third time")
    kept = len(os.path.commonprefix([first.text, again.text]))
    crossed = any(_another_answer(text, kept, other) for other in others for text in (first.text, again.text))
    if third.ok and third.text == again.text and not crossed:
        evidence.append(Note(message=f"{label}: differs from {called or expected_from} after {kept} characters and repeats "
                                     "itself when asked once more (a prefix-cache hit may break a near tie differently from a "
                                     "cold prefill)"))  # fmt: skip
        return
    problems.append(f"{again.label}: output differs from {called or expected_from}: {why}")
    evidence.append(OutputMismatch(request=again.label, expected_from=expected_from, expected=first.text, actual=again.text))


def _another_answer(text: str, kept: int, other: str) -> bool:
    """`text`, past its first `kept` characters, goes on as `other` does at the same place, over
    CROSSED_MIN_CHARS and more than one word (not a run of one generic piece)."""
    matched = os.path.commonprefix([text[kept:], other[kept:]])
    return len(matched) >= CROSSED_MIN_CHARS and len(set(matched.split())) >= 2


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


LIKENESS_CHARS = 1000
"""How much of two answers `likeness` compares: difflib's ratio is quadratic in their length, and
a candidate's 10 KB answers held the operator's event loop 27 s in one comparison (outside
probe). The canary's answers are a few dozen tokens; whose an answer is shows in its opening, and
an answer crossed later shows in its end (`check_own_answer` judges both)."""


def likeness(a: str, b: str) -> float:
    """How alike two answers are, 0-1 (difflib's ratio: matching characters over both lengths), over
    their first LIKENESS_CHARS characters; a value of 0.5 or less is an upper bound, from their
    lengths alone (enough for `whose_answer`, which picks only above 0.5)."""
    matcher = difflib.SequenceMatcher(None, a[:LIKENESS_CHARS], b[:LIKENESS_CHARS], autojunk=False)
    if matcher.real_quick_ratio() <= 0.5:  # from the lengths alone: too unlike to be `whose_answer`'s pick
        return matcher.real_quick_ratio()
    return matcher.ratio()


def whose_answer(text: str, solos: list[str | None]) -> int | None:
    """The index of the solo answer `text` is most like (more than half alike, and strictly the
    most); None when none is, or two tie. Likeness, not a shared prefix: rows crossed after the
    first token (which prefill computed) keep the own first token and then read as another's."""
    scores = [likeness(text, s) if s else 0.0 for s in solos]
    best = max(scores, default=0.0)
    if best <= 0.5 or scores.count(best) > 1:
        return None
    return scores.index(best)


def check_tenant_answer(
    index: int, result: Completion, nonces: list[str], solos: list[str | None], problems: list[str], evidence: list[Evidence]
) -> None:
    """Tenant `index`'s answer carries no other tenant's nonce and is its own (`check_own_answer`)."""
    check_no_other_nonce(index, result, nonces, problems, evidence)
    check_own_answer(index, result, solos, problems, evidence)


def check_no_other_nonce(index: int, result: Completion, nonces: list[str], problems: list[str], evidence: list[Evidence]) -> None:
    for j, nonce in enumerate(nonces):
        if j != index and nonce in result.text:
            problems.append(f"{result.label}: output contains tenant {j + 1}'s nonce")
            evidence.append(NonceLeak(nonce=nonce, owner=f"tenant {j + 1}", found_in=result.label, output=result.text))


def check_choice(choice: Completion, alone: str, others: Sequence[str], problems: list[str], evidence: list[Evidence]) -> None:
    """A choice of a greedy request with `n` > 1 must be the prompt's answer alone. One that
    leaves it and goes on as an answer heard for another prompt fails (outputs crossed); one that
    merely differs is noted (a batch of `n` rows may break a near tie differently from one)."""
    if choice.text == alone or any(p.startswith(choice.label) for p in problems):
        return
    if lost_answer(choice, alone, problems):
        evidence.append(OutputMismatch(request=choice.label, expected_from="the prompt alone", expected=alone, actual=""))
        return
    kept = len(os.path.commonprefix([choice.text, alone]))
    if any(_another_answer(choice.text, kept, other) for other in others):
        problems.append(f"{choice.label}: after {kept} characters of the prompt's answer alone it goes on with an answer "
                        "to another prompt (outputs crossed between requests)")  # fmt: skip
        evidence.append(OutputMismatch(request=choice.label, expected_from="the prompt alone", expected=alone, actual=choice.text))
        return
    evidence.append(Note(message=f"{choice.label}: differs from the prompt's answer alone after {kept} characters, and is "
                                 "no other prompt's answer heard (a batch of n may break a near tie differently)"))  # fmt: skip


PROMPT_GROWTH_MIN = 0.8
"""How much of the growth in usage.prompt_tokens that two long requests' word counts predict must
be reported: filler text tokenizes about linearly, so the difference of two counts is the template's
tokens apart and stays within a few percent of the prediction on any tokenizer."""
PROMPT_GROWTH_MIN_WORDS = 200
"""Long requests closer than this in words are not compared: over fewer words, a byte-level
tokenizer's count varies with the words drawn (and a nonce's share) by more than the margin."""


def check_prompts_counted(
    longs: Sequence[tuple[int, Completion]], problems: list[str], evidence: list[Evidence], estimate: TokenEstimate,
) -> None:  # fmt: skip
    """The longest long request's usage.prompt_tokens must have grown from the shortest's as their
    words predict. A server that advertises more context than it serves and cuts a longer prompt to
    what it holds, answering 200, reports a count that stops growing at its real limit; every
    answer is then its own, so nothing else here sees it (an outside probe: a server that said 4096
    tokens and kept 2048 passed every probe).

    Tokens per word are the growth from the calibration prompt (CALIBRATION_WORDS words, the same
    endpoint) to the shorter one, where that was measured: the shorter one's count alone holds the
    chat template and BOS too, and divided by its words it overstated the growth of an honest
    server whose template (a default system prompt, one a gateway adds) is more than a quarter of
    the shorter prompt's tokens -- a false fail (a review)."""
    counted = sorted(((w, a) for w, a in longs if a.ok and a.prompt_tokens), key=lambda pair: pair[0])
    if len(counted) < 2 or counted[-1][0] - counted[0][0] < PROMPT_GROWTH_MIN_WORDS:
        return
    (short_words, short), (long_words, long) = counted[0], counted[-1]
    assert short.prompt_tokens is not None and long.prompt_tokens is not None
    per_word = short.prompt_tokens / short_words
    if estimate.tokens_per_word and short_words > CALIBRATION_WORDS:
        calibrated = round(estimate.tokens_per_word * CALIBRATION_WORDS)
        per_word = min(per_word, (short.prompt_tokens - calibrated) / (short_words - CALIBRATION_WORDS))
    predicted = (long_words - short_words) * per_word
    if long.prompt_tokens - short.prompt_tokens >= PROMPT_GROWTH_MIN * predicted:
        return
    expected = short.prompt_tokens + round(predicted)
    problems.append(f"{long.label}: usage.prompt_tokens is {long.prompt_tokens}, about {expected} expected from "
                    f"{short.prompt_tokens} for {short_words} words: the server cut the prompt (it serves less context "
                    "than it advertises, and answered 200)")  # fmt: skip
    evidence.append(long.evidence())


def check_own_usage(result: Completion, alone: Completion, problems: list[str], evidence: list[Evidence]) -> None:
    """A concurrent answer's prompt_tokens must be its prompt's: the count alone, where both are
    reported. Another tenant's count means usage (billing) was taken from another request."""
    if result.prompt_tokens is None or alone.prompt_tokens is None or result.prompt_tokens == alone.prompt_tokens:
        return
    problems.append(f"{result.label}: usage.prompt_tokens is {result.prompt_tokens}, but {alone.prompt_tokens} for the "
                    "same prompt alone (usage counted from another request)")  # fmt: skip
    evidence.append(result.evidence())


def check_own_answer(
    index: int, result: Completion, solos: list[str | None], problems: list[str], evidence: list[Evidence]
) -> None:
    """Tenant `index`'s concurrent answer must be its own: another tenant's answer fails (outputs
    crossed between requests); a different one that is still closest to its own is noted."""
    own = solos[index]
    if own is None or result.text == own:
        return  # (no solo answer: the nonce checks are all there is for this tenant)
    if lost_answer(result, own, problems):
        evidence.append(OutputMismatch(request=result.label, expected_from=f"tenant {index + 1} alone", expected=own, actual=""))
        return
    owner = whose_answer(result.text, solos)
    if owner in (None, index) and len(result.text) > LIKENESS_CHARS:
        # `likeness` reads the opening only: an answer crossed later shows in its end (rows that
        # crossed go on with the other's tokens to its last one).
        owner = whose_answer(result.text[-LIKENESS_CHARS:], [s[-LIKENESS_CHARS:] if s else None for s in solos])
    if owner is not None and owner != index and solos[owner] != own:
        problems.append(f"{result.label}: the answer is tenant {owner + 1}'s, not its own (outputs crossed between requests)")
        evidence.append(OutputMismatch(request=result.label, expected_from=f"tenant {index + 1} alone",
                                       expected=own, actual=result.text))  # fmt: skip
        return
    kept = len(os.path.commonprefix([result.text, own]))
    if (other := crossed_after(result.text, kept, own, solos)) is not None:
        problems.append(f"{result.label}: after {kept} characters of its own answer it goes on with tenant {other + 1}'s "
                        "(outputs crossed between requests)")  # fmt: skip
        evidence.append(OutputMismatch(request=result.label, expected_from=f"tenant {index + 1} alone",
                                       expected=own, actual=result.text))  # fmt: skip
        return
    evidence.append(Note(message=f"{result.label}: differs from its answer alone after {kept} "
                                 "characters, and is no other tenant's (batched kernels may break a near tie differently)"))  # fmt: skip


def tenant_prompt_words(estimate: TokenEstimate, budget_tokens: int, limit: int, nonce_length: int, nonce_every: int) -> int:
    """The most filler words, at most `limit`, for a tenant prompt (half shared, half its own with
    a nonce every `nonce_every` words) whose tokens stay within `budget_tokens`. A nonce stands in
    for a filler word but may cost a token per character (a byte-level tokenizer), which the
    per-word estimate does not count (outside probe: at context 256 the prompts came out over it,
    and a healthy revision was rolled back)."""
    for words in range(min(limit, estimate.words_at_most(budget_tokens)), 1, -1):
        nonces = math.ceil((words - words // 2) / nonce_every)
        if estimate.words_at_most(budget_tokens - nonces * (nonce_length + 1)) >= words:
            return words
    return 1


def lost_answer(result: Completion, alone: str, problems: list[str]) -> bool:
    """An answer with no text that ran to max_tokens, where the prompt alone had text: its tokens
    were made and their text lost, not a near tie (outside probe: a proxy that emptied answers
    under concurrency, usage still 8 tokens and finish "length", passed as 12 near-tie notes).
    Adds the problem and says whether it did."""
    if result.text or not alone or result.finish_reason != "length":
        return False
    tokens = f", usage {result.completion_tokens} completion tokens" if result.completion_tokens is not None else ""
    problems.append(f"{result.label}: answered no text (finish_reason length{tokens}) where the same prompt alone answered "
                    f"{clip(alone, 40)!r}: the answer was lost")  # fmt: skip
    return True


def check_answers_not_emptied(results: Sequence[Completion], solos: Sequence[Completion], problems: list[str]) -> None:
    """Two or more answers of one concurrent round with no text, each where its prompt alone had
    text: one may be a near tie broken towards the end of the sequence at once, several prompts
    all doing so at the same moment is answers lost (outside probe: a proxy that emptied answers
    under load, finish "stop" and usage 1 token, passed as near-tie notes). One that ran to
    max_tokens fails alone (`lost_answer`)."""
    emptied = [r.label for r, alone in zip(results, solos, strict=True)
               if r.ok and not r.text and r.finish_reason != "length" and alone.ok and alone.text]  # fmt: skip
    if len(emptied) >= 2:
        problems.append(f"{len(emptied)} answers of one concurrent round had no text where their prompts alone had text "
                        f"({', '.join(emptied)}): answers lost, not near ties")  # fmt: skip


CROSSED_MIN_CHARS = 8
"""How much of another tenant's answer, at the same place, a diverged answer must carry to be read
as crossed: a near tie broken differently goes on with the model's own other continuation."""


def crossed_after(text: str, kept: int, own: str, solos: list[str | None]) -> int | None:
    """The tenant whose answer `text` goes on with, at the same characters, where it left its own
    answer after `kept` characters (outside probe: an answer crossed half-way matched neither well
    enough for `whose_answer`, and passed as a near tie); None when none does."""
    rest = text[kept:]
    if len(rest) < CROSSED_MIN_CHARS:
        return None
    for j, other in enumerate(solos):
        # Only another answer that had already left `own` before this point tells them apart: two
        # answers alike up to here (a model's generic reply) may break a near tie either way.
        if other is None or other == own or len(os.path.commonprefix([own, other])) >= kept:
            continue
        if _another_answer(text, kept, other):
            return j
    return None
