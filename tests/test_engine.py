"""The engine end to end: batching, sampling, stop rules, aborts, S1 tags, the disaggregated path,
the asyncio loop and the metrics contract."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_device import TEST_DEVICE
from prometheus_client.parser import text_string_to_metric_families

from kvguard.workers.async_engine import AsyncEngine
from kvguard.workers.config import EngineConfig
from kvguard.workers.engine import Engine
from kvguard.workers.model import AttentionBatch
from kvguard.workers.request import (
    ContextLengthExceeded,
    KVNotWritten,
    RequestAborted,
    RequestState,
    SamplingParams,
    TagViolation,
)

PROMPTS = ["The quick brown fox", "Hello", "A much longer prompt that spans a few pages of the pool",
           "abc", "secret nonce 12345"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine(model_dir: Path, **kw) -> Engine:
    return Engine(EngineConfig(model_dir, device=TEST_DEVICE, **{"kv_pool_tokens": 1024, "page_size": 8,
                                                           "context_length": 256, **kw}))


@pytest.fixture
def eng(tiny_model_dir: Path) -> Engine:
    return engine(tiny_model_dir)


def ids(e: Engine, text: str) -> list[int]:
    assert e.tokenizer is not None
    return e.tokenizer.encode(text)


def run(e: Engine) -> None:
    while e.has_work():
        e.step()


def test_batch_invariant_greedy(eng: Engine) -> None:
    solo = [eng.generate([ids(eng, p)], GREEDY)[0].output_ids for p in PROMPTS]
    batched = [r.output_ids for r in eng.generate([ids(eng, p) for p in PROMPTS], GREEDY)]
    assert batched == solo
    assert len({tuple(s) for s in solo}) == len(solo)  # outputs depend on the prompt
    # Joining a batch that is already decoding does not change anything either.
    first = eng.add_request("late-0", ids(eng, PROMPTS[0]), GREEDY)
    eng.step(), eng.step(), eng.step()
    second = eng.add_request("late-1", ids(eng, PROMPTS[1]), GREEDY)
    run(eng)
    assert [first.output_ids, second.output_ids] == solo[:2]


def test_admitted_prompt_runs_in_the_same_pass_as_decoding_requests(eng: Engine) -> None:
    """Continuous batching without a pause: the step that prefills a new request also decodes the
    running ones, and both give what they give alone."""
    solo = [eng.generate([ids(eng, p)], GREEDY)[0].output_ids for p in PROMPTS[:2]]
    first = eng.add_request("run-0", ids(eng, PROMPTS[0]), GREEDY)
    eng.step(), eng.step()
    second = eng.add_request("run-1", ids(eng, PROMPTS[1]), GREEDY)
    assert {o.request_id for o in eng.step()} == {"run-0", "run-1"}
    run(eng)
    assert [first.output_ids, second.output_ids] == solo


def test_decode_rows_grouped_by_length_give_the_same_tokens(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir, page_size=4)
    prompts = [ids(e, p * n) for p, n in zip(PROMPTS, (1, 6, 2, 9, 1))]
    solo = [e.generate([p], GREEDY)[0].output_ids for p in prompts]
    e._group_overhead_pages = 0  # every distinct length its own attention group
    assert [r.output_ids for r in e.generate(prompts, GREEDY)] == solo


def test_seeded_sampling_is_reproducible_per_request(eng: Engine) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=11, ignore_eos=True)
    solo = eng.generate([ids(eng, "sample me")], params)[0].output_ids
    mixed = eng.generate([ids(eng, "other"), ids(eng, "sample me")],
                         [SamplingParams(max_tokens=20, temperature=1.0, seed=3), params])
    assert mixed[1].output_ids == solo
    other_seed = eng.generate([ids(eng, "sample me")], SamplingParams(
        max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=12, ignore_eos=True))[0].output_ids
    assert other_seed != solo
    top1 = eng.generate([ids(eng, "sample me")], SamplingParams(max_tokens=20, temperature=1.0, top_k=1, seed=5,
                                                                 ignore_eos=True))[0].output_ids
    assert top1 == eng.generate([ids(eng, "sample me")], GREEDY)[0].output_ids[:20]


def test_extreme_but_valid_sampling_numbers_sample_without_failing_the_batch(eng: Engine) -> None:
    """A temperature of 1e-239 or a repetition penalty of 1e-300 pass validation; dividing by them
    overflowed to inf, the distribution became NaN and the step failed every request in the batch.
    Below SAMPLING_EPS temperature is greedy; an overflowed logit is clamped to the largest float."""
    neighbour = SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)
    tiny_temperature = SamplingParams(max_tokens=8, temperature=3.5e-239, ignore_eos=True)
    tiny_penalty = SamplingParams(max_tokens=8, temperature=1.0, repetition_penalty=1e-300, seed=2, ignore_eos=True)
    prompts = [ids(eng, p) for p in PROMPTS[:3]]
    done = eng.generate(prompts, [neighbour, tiny_temperature, tiny_penalty])
    assert [len(r.output_ids) for r in done] == [8, 8, 8]
    assert done[1].output_ids == eng.generate([prompts[1]], GREEDY)[0].output_ids[:8]


def poison_forward(e: Engine, monkeypatch: pytest.MonkeyPatch, poisoned: Callable[[list[int]], bool]) -> list[int]:
    """Make the model's forward pass raise whenever `poisoned(its input ids)`, as a bug tripped by
    one tenant's input would. Returns the batch size of every pass tried."""
    real, sizes = e.model.forward, []

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, kv: torch.Tensor) -> torch.Tensor:
        sizes.append(len(batch.cu_seqlens or [0]) - 1 + (0 if batch.seq_lens is None else len(batch.seq_lens)))
        if poisoned(input_ids.tolist()):
            raise RuntimeError("injected: this input trips a bug")
        return real(input_ids, positions, batch, kv)

    monkeypatch.setattr(e.model, "forward", forward)
    return sizes


def test_a_pass_that_fails_on_one_request_ends_that_request_alone(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [ids(eng, p) for p in PROMPTS]
    solo = [eng.generate([p], GREEDY)[0].output_ids for p in prompts]
    used = {t for seq in prompts + solo for t in seq}
    poison = next(t for t in ids(eng, "~}|{zyxwvu") if t not in used)  # in no prompt, no greedy output
    bad = prompts[1] + [poison]
    sizes = poison_forward(eng, monkeypatch, lambda tokens: poison in tokens)
    requests = eng.generate(prompts[:2] + [bad] + prompts[2:], GREEDY)
    # Six prompts in one pass; halves of it until the bad one runs alone: [p0 p1 bad] [p0] [p1 bad]
    # [p1] [bad], then [p2 p3 p4]. Every later pass runs the five healthy requests together.
    assert sizes[:7] == [6, 3, 1, 2, 1, 1, 3] and set(sizes[7:]) <= {5, 4, 3, 2, 1}
    failed = requests.pop(2)
    assert failed.state is RequestState.ABORTED and failed.error is not None
    assert (failed.error.code, failed.error.status) == ("engine_error", 500)
    # Everyone else finished, with exactly what each gets alone (nothing lost, nothing doubled).
    assert [r.state for r in requests] == [RequestState.FINISHED] * 5
    assert [r.output_ids for r in requests] == solo
    assert eng.pool.used_pages == 0
    eng.check_integrity()
    families = {f.name: f for f in text_string_to_metric_families(eng.metrics.exposition().decode())}
    failed_count = [s.value for s in families["kvguard_requests"].samples if s.labels.get("outcome") == "failed"]
    assert failed_count == [1.0]


def test_a_pass_that_always_fails_ends_each_request_and_the_engine_serves_on(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    poison_forward(eng, monkeypatch, lambda tokens: True)  # e.g. a device that has gone away
    requests = eng.generate([ids(eng, p) for p in PROMPTS], GREEDY)
    assert {(r.state, r.error.code if r.error else None) for r in requests} == {(RequestState.ABORTED, "engine_error")}
    assert eng.pool.used_pages == 0
    monkeypatch.undo()
    assert eng.generate([ids(eng, PROMPTS[0])], GREEDY)[0].state is RequestState.FINISHED


def test_a_request_whose_token_bookkeeping_fails_ends_alone(eng: Engine) -> None:
    class BrokenDetokenizer:
        def push(self, token: int) -> str:
            raise ValueError("injected: this token trips the detokenizer")

    live = [eng.add_request(f"r{i}", ids(eng, p), GREEDY) for i, p in enumerate(PROMPTS)]
    eng.step()  # every prompt's first token
    live[1].detokenizer = BrokenDetokenizer()  # type: ignore[assignment]
    run(eng)
    assert live[1].state is RequestState.ABORTED and live[1].error is not None
    assert live[1].error.code == "engine_error"
    assert [r.state for i, r in enumerate(live) if i != 1] == [RequestState.FINISHED] * 4
    assert eng.pool.used_pages == 0


def test_stop_string_and_stop_token_and_length(eng: Engine) -> None:
    full = eng.generate([ids(eng, PROMPTS[0])], GREEDY)[0]
    text = full.output_text
    stop = text[5:8]
    cut = text.find(stop)
    stopped = eng.generate([ids(eng, PROMPTS[0])], SamplingParams(max_tokens=24, temperature=0, stop=(stop,), ignore_eos=True))[0]
    assert stopped.finish_reason == "stop" and stopped.output_text == text[:cut]
    token = full.output_ids[3]
    by_token = eng.generate([ids(eng, PROMPTS[0])], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(token,)))[0]
    assert by_token.finish_reason == "stop" and by_token.output_ids == full.output_ids[: full.output_ids.index(token) + 1]
    # The stop token is generated and counted, but its own text is not output (vLLM's meaning;
    # outside probe: '%h%D' for a stop on 'D').
    assert eng.tokenizer is not None
    assert by_token.output_text == eng.tokenizer.decode(by_token.output_ids[:-1])
    assert full.finish_reason == "length" and len(full.output_ids) == 24


def test_streamed_text_never_contains_the_stop_string(eng: Engine) -> None:
    full = eng.generate([ids(eng, PROMPTS[2])], GREEDY)[0].output_text
    stop = full[10:14]
    request = eng.add_request("s", ids(eng, PROMPTS[2]), SamplingParams(max_tokens=24, temperature=0, stop=(stop,), ignore_eos=True))
    streamed = ""
    while eng.has_work():
        streamed += "".join(o.text for o in eng.step() if o.request_id == "s")
    assert streamed == full[: full.find(stop)] == request.output_text


def test_abort_in_every_state_frees_everything(eng: Engine) -> None:
    small = engine(eng.config.model_dir, kv_pool_tokens=64, page_size=8)
    running = small.add_request("running", ids(small, "hello"), GREEDY)
    waiting = small.add_request("waiting", ids(small, "hello there"), GREEDY)  # does not fit yet
    small.step(), small.step()
    assert running.state == RequestState.DECODING and waiting.state == RequestState.ADMITTED
    assert small.abort("waiting", "client") and small.abort("running", "client")
    assert not small.abort("running")
    outputs = small.step()
    assert {o.request_id for o in outputs} == {"running", "waiting"}
    assert all(isinstance(o.error, RequestAborted) and o.state == RequestState.ABORTED for o in outputs)
    assert small.pool.used_pages == 0 and not small.requests
    small.check_integrity()


def test_running_and_waiting_gauges_are_true_whenever_scraped(eng: Engine) -> None:
    """They were set once per step, so a worker that stopped stepping (all aborted, or the head of
    the queue waiting for pages) reported requests it no longer held."""
    small = engine(eng.config.model_dir, kv_pool_tokens=64, page_size=8)

    def gauges() -> tuple[float | None, float | None]:
        read = small.metrics.registry.get_sample_value
        return read("kvguard_running_requests"), read("kvguard_waiting_requests")

    small.add_request("running", ids(small, "hello"), GREEDY)
    small.add_request("waiting", ids(small, "hello there"), GREEDY)  # does not fit while "running" holds pages
    assert gauges() == (0.0, 2.0)  # queued before any step
    small.step()
    assert gauges() == (1.0, 1.0)
    small.abort("waiting", "client"), small.abort("running", "client")
    small.step()
    assert gauges() == (0.0, 0.0) and not small.has_work()  # no further step will come to reset them


def test_s1_stale_lease_fails_only_its_request(tiny_model_dir: Path) -> None:
    """A page freed and reallocated to another request while its first owner still runs (the
    2026 bug class): caught at read time, that request fails, the others finish unchanged."""
    e = engine(tiny_model_dir, kv_pool_tokens=256, page_size=8)
    prompts = [ids(e, p) for p in PROMPTS[:3]]
    victim_prompt = ids(e, PROMPTS[4])
    solo = [e.generate([p], GREEDY)[0].output_ids for p in prompts + [victim_prompt]]
    reqs = [e.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    e.step(), e.step(), e.step()
    assert all(r.state == RequestState.DECODING for r in reqs)
    e.pool.free(reqs[1].lease)  # the bug: r1's pages go back while r1 still decodes
    intruder = e.add_request("intruder", victim_prompt, GREEDY)  # and are handed to a new request
    e.step()  # the intruder is admitted and prefilled into r1's pages
    assert set(intruder.lease.page_ids) & set(reqs[1].lease.page_ids)
    run(e)
    assert reqs[1].state == RequestState.ABORTED and isinstance(reqs[1].error, TagViolation)
    assert [reqs[0].output_ids, reqs[2].output_ids, intruder.output_ids] == [solo[0], solo[2], solo[3]]
    assert e.metrics.tag_violations._value.get() == 1
    assert e.pool.used_pages == 0
    e.check_integrity()


def test_without_tags_the_same_bug_reads_another_requests_kv(tiny_model_dir: Path) -> None:
    """The control for the test above: with tags off the stale request silently reads the
    intruder's KV and keeps going with corrupted output (what the tags exist to prevent)."""
    e = engine(tiny_model_dir, kv_pool_tokens=128, page_size=8, tags=False)
    prompt = ids(e, PROMPTS[1])
    solo = e.generate([prompt], GREEDY)[0].output_ids
    victim = e.add_request("victim", prompt, GREEDY)
    e.step(), e.step()
    e.pool.free(victim.lease)
    e.add_request("intruder", ids(e, PROMPTS[4] * 3), GREEDY)
    run(e)
    assert victim.state == RequestState.FINISHED and victim.output_ids != solo


def test_a_tenants_non_finite_kv_does_not_reach_the_next_owner_of_its_pages(tiny_model_dir: Path) -> None:
    """Decode attention reads whole pages and weighs the slots past a request's length by 0, and
    0 x NaN is NaN. Non-finite K/V a tenant left in its pages (an fp16 overflow, say), or in the
    scratch page that takes stale writes, must not turn another request's output into NaN noise:
    pages are zeroed when handed out, and padding reads the all-zero pad page."""
    e = engine(tiny_model_dir, kv_pool_tokens=256, page_size=8)
    prompts = [ids(e, PROMPTS[2]), ids(e, PROMPTS[3])]  # different lengths: the short row is padded
    solo = [e.generate([p], GREEDY)[0].output_ids for p in prompts]
    e.pool.kv[:, :, : e.pool.num_pages + 1] = float("nan")  # every page the last tenants used, and scratch
    batched = e.generate(prompts, GREEDY)
    assert [r.output_ids for r in batched] == solo
    assert not e.pool.kv[:, :, e.pool.pad_page].any()


def test_without_tags_reused_pages_keep_the_previous_owners_bytes(tiny_model_dir: Path) -> None:
    """The incident's engine (`no_tags`) scrubbed nothing; the fault keeps that, or the canary
    could not show the leak it exists to show. Pages never handed out are still zeroed."""
    e = engine(tiny_model_dir, kv_pool_tokens=64, page_size=8, tags=False)
    first = e.pool.allocate("first", 16)
    assert first is not None and not e.pool.kv[:, :, list(first.page_ids)].any()
    e.pool.kv[:, :, list(first.page_ids)] = 7.0
    e.pool.free(first)
    again = e.pool.allocate("again", 16)
    assert again is not None and set(again.page_ids) == set(first.page_ids)
    assert bool((e.pool.kv[:, :, list(again.page_ids)] == 7.0).all())


def _disaggregated(prefill: Engine, decode: Engine, rid: str, prompt: list[int], params: SamplingParams,
                   import_pages: bool = True) -> None:
    d_req = decode.add_decode_request(rid, prompt, params)
    [pre] = decode.step()
    assert pre.state == RequestState.PREALLOCATED and pre.lease is d_req.lease
    prefill.add_prefill_request(rid, prompt, params)
    [out] = prefill.step()
    assert out.state == RequestState.TRANSFERRING and len(out.token_ids) == 1
    if import_pages:
        decode.mark_receiving(rid)
        payload = prefill.pool.export_pages(out.lease).cpu().numpy().tobytes()  # what crosses the wire
        dl = pre.lease
        result = decode.pool.import_pages(dl, dl.page_ids[: len(out.lease.page_ids)],
                                          dl.generations[: len(out.lease.page_ids)],
                                          decode.pool.pages_from_bytes(payload),
                                          decode.pool.valid_tokens(dl, dl.page_ids[: len(out.lease.page_ids)], len(prompt)))
        assert result.applied
    prefill.release(rid)
    assert prefill.pool.used_pages == 0
    decode.start_decode(rid, out.token_ids[0])


def test_disaggregated_prefill_decode_equals_colocated(tiny_model_dir: Path) -> None:
    colocated = engine(tiny_model_dir)
    # Different pool sizes (so different page ids) on each side; page_size must match for page-wise transfer.
    prefill = engine(tiny_model_dir, page_size=8, kv_pool_tokens=256)
    decode = engine(tiny_model_dir, page_size=8, kv_pool_tokens=512)
    decode.generate([ids(decode, "dirty the pool first")], GREEDY)  # stale KV left in freed pages
    for i, text in enumerate(PROMPTS):
        prompt = ids(colocated, text)
        expected = colocated.generate([prompt], GREEDY)[0]
        _disaggregated(prefill, decode, f"d{i}", prompt, GREEDY)
        outputs = []
        while decode.has_work():
            outputs += [o for o in decode.step() if o.request_id == f"d{i}"]
        assert [t for o in outputs for t in o.token_ids] == expected.output_ids
        assert "".join(o.text for o in outputs) == expected.output_text
        assert outputs[-1].state == RequestState.FINISHED and decode.pool.used_pages == 0


def test_s3_decode_refuses_to_start_on_unwritten_pages(tiny_model_dir: Path) -> None:
    prefill, decode = engine(tiny_model_dir), engine(tiny_model_dir)
    decode.generate([ids(decode, PROMPTS[2])], GREEDY)  # pages hold an earlier request's KV
    with pytest.raises(KVNotWritten):
        _disaggregated(prefill, decode, "x", ids(decode, PROMPTS[2]), GREEDY, import_pages=False)
    [out] = decode.step()
    assert out.state == RequestState.ABORTED and isinstance(out.error, KVNotWritten)
    assert decode.pool.used_pages == 0 and prefill.pool.used_pages == 0


def test_s1_unsafe_start_is_still_caught_at_read_time(tiny_model_dir: Path) -> None:
    """The incident's engine (`unsafe_reject_path`): decode skips the S3 check and starts on
    pages nobody wrote. The read-time tag check still fails that request, and only it."""
    decode = engine(tiny_model_dir)
    decode.generate([ids(decode, PROMPTS[2])], GREEDY)
    other = decode.add_request("other", ids(decode, PROMPTS[0]), GREEDY)
    decode.step()
    d_req = decode.add_decode_request("unsafe", ids(decode, PROMPTS[2]), GREEDY)
    decode.step()
    decode.start_decode("unsafe", 65, require_written=False)
    run(decode)
    assert isinstance(d_req.error, TagViolation) and other.state == RequestState.FINISHED
    assert decode.pool.used_pages == 0


async def test_async_engine_streams_aborts_and_rejects(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir)
    expected = [e.generate([ids(e, p)], GREEDY)[0].output_ids for p in PROMPTS[:3]]
    loop = AsyncEngine(e)
    try:
        streams = [await loop.generate(f"a{i}", ids(e, p), GREEDY) for i, p in enumerate(PROMPTS[:3])]
        endless = await loop.generate("endless", ids(e, "x"), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))

        async def collect(stream) -> list[int]:
            return [t async for o in stream for t in o.token_ids]

        got = await asyncio.gather(*(collect(s) for s in streams))
        assert got == expected
        first = await endless.next_output()
        assert first.token_ids
        assert await loop.abort("endless")
        last = [o async for o in endless][-1]
        assert last.state == RequestState.ABORTED
        with pytest.raises(ContextLengthExceeded):
            await loop.generate("too-long", ids(e, "y" * 300), GREEDY)
        lease, stream = await loop.preallocate("dec", ids(e, "hi"), GREEDY)
        assert lease is not None and await loop.call(lambda: e.pool.is_current(lease))
        await loop.abort("dec", "prefill_error")
        assert [o.state async for o in stream] == [RequestState.ABORTED]
        assert await loop.call(lambda: e.pool.used_pages) == 0
    finally:
        await loop.stop()
    assert loop.integrity_error is None


async def test_a_paced_engine_sleeps_after_every_step_and_still_stops_at_once(tiny_model_dir: Path) -> None:
    """FAULT delay_step_ms: a generation of N tokens takes at least N x the delay (tests that need
    one to outlast a timeout get it on any machine), the tokens are the unpaced ones, and stopping
    does not wait the delay out."""
    e = engine(tiny_model_dir)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = e.generate([ids(e, "paced")], params)[0].output_ids
    loop = AsyncEngine(e, step_delay_s=0.05)
    try:
        started = time.monotonic()
        stream = await loop.generate("paced", ids(e, "paced"), params)
        assert [t async for o in stream for t in o.token_ids] == expected
        assert time.monotonic() - started >= 19 * 0.05  # every step after the first is behind a delay
    finally:
        await loop.stop()
    stalled = AsyncEngine(e, step_delay_s=600.0)  # a stop, and an abort, must not wait this out
    try:
        stream = await stalled.generate("long", ids(e, "x"), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        assert (await stream.next_output()).token_ids  # the first step ran; the pause follows it
        assert await asyncio.wait_for(stalled.abort("long"), timeout=60)
    finally:
        await asyncio.wait_for(stalled.stop(), timeout=60)
    assert loop.integrity_error is None and stalled.integrity_error is None


def test_idle_integrity_check_runs_only_after_the_pool_changed(eng: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle engine thread checks integrity once per interval, but a check of a pool nothing
    touched since it last held finds nothing new (and cost ~50 ms per second on a default pool)."""
    checks: list[int] = []  # the pool's change count at each check
    real_check = eng.check_integrity

    def counted_check() -> None:
        checks.append(eng.pool.changes)
        real_check()

    def broken_pool() -> None:
        raise AssertionError("broken")

    monkeypatch.setattr(eng, "check_integrity", counted_check)
    loop = AsyncEngine(eng)  # not started: its idle check is called directly, as `_run` does
    loop._check_integrity(), loop._check_integrity()
    assert len(checks) == 1
    eng.generate([ids(eng, "hello")], GREEDY)  # allocates, writes, frees
    loop._check_integrity(), loop._check_integrity()
    assert len(checks) == 2 and checks[1] > checks[0]
    monkeypatch.setattr(eng.pool, "check_integrity", broken_pool)
    eng.pool.changes += 1
    loop._check_integrity(), loop._check_integrity()  # a failed check is not taken as holding: retried
    assert len(checks) == 4 and str(loop.integrity_error) == "broken"


def test_metrics_contract(eng: Engine) -> None:
    eng.generate([ids(eng, "hello")], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    with pytest.raises(ContextLengthExceeded):
        eng.add_request("long", list(range(300)), GREEDY)
    families = {f.name: f for f in text_string_to_metric_families(eng.metrics.exposition().decode())}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert value[("kvguard_kv_pool_capacity_tokens", ())] == 1024
    assert value[("kvguard_kv_pool_used_tokens", ())] == 0
    assert value[("kvguard_context_length_tokens", ())] == 256
    assert value[("kvguard_tag_violations_total", ())] == 0
    assert value[("kvguard_rejected_requests_total", (("reason", "context_length_exceeded"),))] == 1
    assert value[("kvguard_requests_total", (("outcome", "finished"),))] == 1
    assert value[("kvguard_requests_total", (("outcome", "rejected"),))] == 1
    assert value[("kvguard_prompt_tokens_total", ())] == len(ids(eng, "hello"))
    assert value[("kvguard_generation_tokens_total", ())] == 5
    assert value[("kvguard_time_to_first_token_seconds_count", ())] == 1
    assert value[("kvguard_inter_token_latency_seconds_count", ())] == 4
    # One pass prefilled the prompt (and sampled the first token), four decoded one request each.
    assert value[("kvguard_step_requests_count", (("phase", "prefill"),))] == 1
    assert value[("kvguard_step_requests_sum", (("phase", "prefill"),))] == 1
    assert value[("kvguard_step_requests_count", (("phase", "decode"),))] == 4
    assert value[("kvguard_step_requests_sum", (("phase", "decode"),))] == 4


def test_seeded_sampling_disaggregated_equals_colocated(tiny_model_dir: Path) -> None:
    colocated, prefill, decode = engine(tiny_model_dir), engine(tiny_model_dir), engine(tiny_model_dir)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True)
    prompt = ids(colocated, PROMPTS[0])
    expected = colocated.generate([prompt], params)[0].output_ids
    _disaggregated(prefill, decode, "s", prompt, params)
    outputs = []
    while decode.has_work():
        outputs += decode.step()
    assert [t for o in outputs for t in o.token_ids] == expected


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the configured CPU budget; a GPU sizes from its own memory")
def test_pool_size_from_memory_budget(tiny_model_dir: Path) -> None:
    budget = 64 * 1024**2
    e = engine(tiny_model_dir, kv_pool_tokens=None, cpu_memory_bytes=budget, kv_memory_fraction=0.5)
    weights = sum(p.numel() * p.element_size() for p in e.model.parameters())
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32
    expected_pages = int((budget - weights - budget * 0.5) // (per_token * 8))
    assert e.pool.num_pages == expected_pages
    assert e.metrics.pool_capacity_tokens._value.get() == expected_pages * 8


GiB = 1024**3


def test_engines_sharing_one_gpu_each_size_their_pool_from_their_share(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvguard serve` puts prefill and decode on one GPU. SGLang's rule alone (keep total x (1 -
    fraction) free) gives the first engine up the whole fraction and leaves the second nothing:
    on an H200 the second failed to start. With device_share 0.5 each gets the same pool, in
    either order; alone (share 1) the rule is SGLang's, as before. Memory figures stand in for
    torch.cuda.mem_get_info: the development machine has no GPU (scripts/device_check.sh runs
    it on one)."""
    from kvguard.workers import engine as engine_module
    from kvguard.workers.model import ModelArgs

    args = ModelArgs.from_dir(tiny_model_dir)
    page_bytes = args.kv_bytes_per_token(torch.float32) * 16
    total, weights, cuda = 140 * GiB, 1 * GiB, torch.device("cuda")

    def pages(free: float, share: float) -> int:
        monkeypatch.setattr(engine_module.dev, "memory_info", lambda _device, _cpu: (int(free), total))
        config = EngineConfig(tiny_model_dir, kv_memory_fraction=0.85, device_share=share)
        return engine_module.plan_pool_pages(config, args, torch.float32, cuda, weights)

    alone = pages(total - weights, 1.0)
    assert alone == int((total - weights - total * 0.15) // page_bytes)  # SGLang's rule, unchanged
    with pytest.raises(ValueError, match="no memory left"):
        pages(total - weights - alone * page_bytes - weights, 1.0)  # the second engine, before shares
    first = pages(total - weights, 0.5)
    second = pages(total - weights - first * page_bytes - weights, 0.5)
    assert first == second == int((total * 0.85 / 2 - weights) // page_bytes)
    assert 2 * (first * page_bytes + weights) <= total * 0.85


def test_config_and_device_errors_are_clear(tiny_model_dir: Path, tmp_path: Path) -> None:
    from kvguard.workers.device import resolve_device

    with pytest.raises(ValueError, match="config.json"):
        EngineConfig(tmp_path)
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(tiny_model_dir, page_size=0)
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        EngineConfig(tiny_model_dir, kv_memory_fraction=1.5)
    with pytest.raises(ValueError, match="exceeds the model's maximum"):
        engine(tiny_model_dir, context_length=10_000)
    assert resolve_device("auto").type in ("cpu", "cuda")
    with pytest.raises(ValueError, match="unknown device|unsupported device"):
        resolve_device("tpu")


def test_a_failed_prefill_step_leaves_the_sender_nothing_to_export(tiny_model_dir: Path) -> None:
    """S1 on prefill: a failed engine step (AsyncEngine._step) aborts a request whose KV the sender
    is still exporting and frees its pages; the next request is computed into them. Decode's tags
    cannot tell (its pages are written for the right lease), so the export must refuse the old lease
    rather than send the new request's KV under the old one's name (formal/README.md: not modelled)."""
    from kvguard.workers.kv_pool import StaleLeaseError

    e = engine(tiny_model_dir, kv_pool_tokens=16, page_size=8, max_running_requests=4)
    e.add_prefill_request("a", list(range(1, 9)), GREEDY)
    while e.requests["a"].state is not RequestState.TRANSFERRING:
        e.step()
    lease = e.requests["a"].lease
    for request_id in list(e.requests):  # what AsyncEngine._step does when a step raises
        e.abort(request_id, "engine_error")
    e.add_prefill_request("b", list(range(20, 28)), GREEDY)
    while e.requests["b"].state is not RequestState.TRANSFERRING:
        e.step()
    assert set(e.requests["b"].lease.page_ids) & set(lease.page_ids)  # b's KV is in a's pages
    with pytest.raises(StaleLeaseError):
        e.pool.export_pages(lease, lease.page_ids)


def test_generate_raises_rather_than_returning_a_request_that_cannot_finish(tiny_model_dir: Path) -> None:
    """An outside probe: a decode request awaiting its KV held the pool; `generate` returned the new
    request unfinished (ADMITTED, no tokens) as if it had run."""
    e = engine(tiny_model_dir, kv_pool_tokens=64)
    e.add_decode_request("held", [1] * 20, SamplingParams(max_tokens=20, temperature=0))  # 5 of 8 pages
    e.step()
    with pytest.raises(RuntimeError, match="cannot finish"):
        e.generate([[2] * 20], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    # A review: the request generate gave up on stayed queued, and ran for nobody once the pool freed.
    assert list(e.requests) == ["held"] and not e.scheduler.waiting
    e.abort("held")
    e.step()  # hands out the aborted outputs
    assert not e.has_work() and not e.requests
