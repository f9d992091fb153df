"""The sampler's logit processing and logprobs in the engine: logit_bias, min_tokens, penalties,
raw logprobs, and their agreement between one engine and a prefill + decode pair (issue 13)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_engine import PROMPTS, engine, ids, run

from kvguard.workers.engine import Engine
from kvguard.workers.protocol import TokenLogprob
from kvguard.workers.request import InvalidRequest, RequestState, SamplingParams
from kvguard.workers.sampling import LOGPROB_FLOOR
from kvguard.workers.tiny import EOS_ID


@pytest.fixture(scope="module")
def eng(tiny_model_dir: Path) -> Engine:
    return engine(tiny_model_dir)


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 24, "temperature": 0, "ignore_eos": True, **kw})  # type: ignore[arg-type]


def out(e: Engine, prompt: str, params: SamplingParams) -> list[int]:
    return e.generate([ids(e, prompt)], params)[0].output_ids


def test_defaults_are_openais() -> None:
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.max_tokens, params.frequency_penalty, params.presence_penalty) == (
        1.0, 1.0, None, 0.0, 0.0)
    assert not params.greedy and not params.penalized


def test_logit_bias_forces_and_bans_tokens(eng: Engine) -> None:
    assert out(eng, PROMPTS[0], greedy(logit_bias=((65, 100.0),))) == [65] * 24
    plain = out(eng, PROMPTS[0], greedy())
    banned = out(eng, PROMPTS[0], greedy(logit_bias=((plain[0], -100.0),)))
    assert banned[0] != plain[0] and plain[0] not in banned


def test_min_tokens_holds_back_eos(eng: Engine) -> None:
    eos_first = SamplingParams(max_tokens=24, temperature=0, logit_bias=((EOS_ID, 100.0),))
    [early] = eng.generate([ids(eng, "hi")], eos_first)
    assert early.output_ids == [EOS_ID] and early.finish_reason == "stop"
    [held] = eng.generate([ids(eng, "hi")], eos_first.model_copy(update={"min_tokens": 5}))
    assert held.finish_reason == "stop" and len(held.output_ids) == 6
    assert EOS_ID not in held.output_ids[:5] and held.output_ids[5] == EOS_ID


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}])
def test_penalties_change_only_tokens_already_seen(eng: Engine, penalty: dict[str, float]) -> None:
    """Exact for greedy decoding: the penalized run can only leave the plain one at a token the
    penalty applies to -- one already generated (or, for repetition_penalty, in the prompt)."""
    for prompt in PROMPTS[:3]:
        plain, penalized = out(eng, prompt, greedy()), out(eng, prompt, greedy(**penalty))
        assert len(set(penalized)) >= len(set(plain))
        diverge = next((i for i, (a, b) in enumerate(zip(plain, penalized)) if a != b), None)
        assert diverge is not None, "the penalty changed nothing"
        seen = set(plain[:diverge]) | (set(ids(eng, prompt)) if "repetition_penalty" in penalty else set())
        assert plain[diverge] in seen


def test_token_ids_out_of_vocab_are_refused(eng: Engine) -> None:
    with pytest.raises(InvalidRequest) as bias:
        eng.add_request("b", ids(eng, "x"), greedy(logit_bias=((10_000, 1.0),)))
    assert bias.value.param == "logit_bias"
    with pytest.raises(InvalidRequest) as stop:
        eng.add_request("s", ids(eng, "x"), greedy(stop_token_ids=(10_000,)))
    assert stop.value.param == "stop_token_ids"


def _logprobs(e: Engine, prompt: str, params: SamplingParams) -> list[TokenLogprob]:
    request = e.add_request(f"lp-{prompt}-{params.seed}", ids(e, prompt), params)
    records: list[TokenLogprob] = []
    while e.has_work():
        records += [r for o in e.step() if o.request_id == request.request_id for r in o.logprobs or ()]
    return records


def test_logprobs_are_the_models_raw_distribution(eng: Engine) -> None:
    records = _logprobs(eng, PROMPTS[1], greedy(logprobs=5))
    assert len(records) == 24
    for record in records:
        assert len(record.top) == 5 and record.logprob is not None
        assert record.top[0] == (record.token_id, record.logprob)  # greedy picks the most likely token
        values = [lp for _, lp in record.top]
        assert values == sorted(values, reverse=True) and all(LOGPROB_FLOOR <= v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
    # Raw: temperature and bias change what is picked, not the reported distribution.
    biased = _logprobs(eng, PROMPTS[1], greedy(logprobs=2, logit_bias=((65, 100.0),)))
    assert biased[0].token_id == 65 and biased[0].top == records[0].top[:2]
    assert biased[0].logprob == pytest.approx(dict(records[0].top).get(65, biased[0].logprob))


def test_logprobs_zero_reports_the_picked_token_only(eng: Engine) -> None:
    [record, *_] = _logprobs(eng, "hi", greedy(max_tokens=2, logprobs=0))
    assert record.top == () and record.logprob is not None and record.logprob <= 0


def _disaggregated_outputs(prefill: Engine, decode: Engine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[TokenLogprob]]:
    """The P/D path with the first token's record handed over as the router hands it (prefill result)."""
    decode.add_decode_request(rid, prompt, params)
    [pre] = decode.step()
    prefill.add_prefill_request(rid, prompt, params)
    [first] = prefill.step()
    assert first.state == RequestState.TRANSFERRING and first.logprobs is not None
    decode.mark_receiving(rid)
    n = len(first.lease.page_ids)
    payload = prefill.pool.export_pages(first.lease).cpu().numpy().tobytes()
    lease = pre.lease
    decode.pool.import_pages(lease, lease.page_ids[:n], lease.generations[:n], decode.pool.pages_from_bytes(payload),
                             decode.pool.valid_tokens(lease, lease.page_ids[:n], len(prompt)))
    prefill.release(rid)
    decode.start_decode(rid, first.token_ids[0], first_logprob=first.logprobs[0])
    outputs = []
    while decode.has_work():
        outputs += [o for o in decode.step() if o.request_id == rid]
    return [t for o in outputs for t in o.token_ids], [r for o in outputs for r in o.logprobs or ()]


def test_seeded_penalized_sampling_and_logprobs_agree_across_prefill_and_decode(tiny_model_dir: Path) -> None:
    """Penalties read the request's own output, which decode holds from the first token on; the
    draw for token i depends only on (seed, i): one engine and a P/D pair give the same tokens."""
    colocated, prefill, decode = (engine(tiny_model_dir) for _ in range(3))
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=2**64 - 1, ignore_eos=True,
                            frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3,
                            logit_bias=((66, 3.0),), logprobs=3)
    prompt = ids(colocated, PROMPTS[0])
    [expected] = colocated.generate([prompt], params)
    expected_records = _logprobs(colocated, PROMPTS[0], params)
    tokens, records = _disaggregated_outputs(prefill, decode, "pd", prompt, params)
    assert tokens == expected.output_ids
    assert [r.token_id for r in records] == tokens
    for got, want in zip(records, expected_records):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_penalty_state_is_updated_per_token_not_rebuilt(eng: Engine) -> None:
    """Bounded work: the counts grow by the new tokens each step (never a pass over the history)."""
    request = eng.add_request("counts", ids(eng, "abc"), greedy(max_tokens=10, frequency_penalty=1.0))
    run(eng)
    state = request.logits_state
    assert state is not None and state.counted == 9  # the 10th token was never sampled from
    assert torch.equal(state.counts.nonzero().flatten().sort().values,
                       torch.tensor(sorted(set(request.output_ids[:9]))))
