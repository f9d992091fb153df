"""spec.canary fields an outside probe found unbounded: each was admitted and then hung the operator
(a long-request fraction of 1e300 built a word list on its event loop until memory ran out) or
failed a healthy revision's canary (a fraction of 5, 2^62 long-request tokens, a seed past 64 bits,
minRatio 1e6, a golden prompt's maxTokens beyond the context), and the capacity probe judged by 2
the pools the planner had passed at minKVRatio 1.5, rolling back a spec it approved.

Each is now refused when written, by field: by the webhook (pydantic's bounds and
`spec_checks.canary_problems`) and, for clusters without it, by the CRD's schema and rules.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_admission import admit
from test_canary_fakes import Behaviour, RunningServer
from test_spec_refusals import denial, tiny_model
from test_webhook import set_path

from kvguard.commands.canary import _load_spec
from kvguard.operator.api import InferenceModelSpec
from kvguard.operator.canary import ProbeName, ProbeStatus, run_suite
from kvguard.operator.canary.isolation import long_request_words
from kvguard.operator.canary.prompts import MAX_FILLER_WORDS, TokenEstimate, filler_words
from kvguard.operator.crdgen import inference_model_crd
from kvguard.operator.webhook import INVALID

CRD = inference_model_crd()

# The sample's contextLength is 1024 and its minKVRatio the default 2.
REFUSED = [
    ("spec.canary.isolation.longRequestFractions", [1.0e300],
     "spec.canary.isolation.longRequestFractions[0]: Input should be less than or equal to 1"),
    ("spec.canary.isolation.longRequestFractions", [0.3, 5.0],
     "spec.canary.isolation.longRequestFractions[1]: Input should be less than or equal to 1"),
    ("spec.canary.isolation.longRequestFractions", [-3.0],
     "spec.canary.isolation.longRequestFractions[0]: Input should be greater than 0"),
    ("spec.canary.isolation.longRequestFractions", [0.0],
     "spec.canary.isolation.longRequestFractions[0]: Input should be greater than 0"),
    ("spec.canary.isolation.longRequestMaxTokens", 4611686018427387904,
     "spec.canary.isolation.longRequestMaxTokens: 4,611,686,018,427,387,904 leaves no room"),
    ("spec.canary.isolation.longRequestMaxTokens", 1009,
     "spec.canary.isolation.longRequestMaxTokens: 1,009 leaves no room for a long request's prompt in contextLength "
     "1,024: at most contextLength - 16 (1,008)"),
    ("spec.canary.seed", 18446744073709551616, "spec.canary.seed: Input should be less than or equal to 9223372036854775807"),
    ("spec.canary.seed", -(2**63) - 1, "spec.canary.seed: Input should be greater than or equal to -9223372036854775808"),
    ("spec.canary.capacity.minRatio", 1e6, "spec.canary.capacity.minRatio: must be at most 100"),
    ("spec.canary.capacity.minRatio", 0.5,
     "spec.canary.capacity.minRatio: must be at least 1: a pool below one context length cannot hold"),
    ("spec.canary.capacity.minRatio", 3.0,
     "spec.canary.capacity.minRatio: 3 is above spec.minKVRatio 2: the planner sizes pools to 2x contextLength, so the "
     "canary would fail (and roll back) every revision it passed"),
    ("spec.canary.golden.prompts", [{"prompt": "x", "maxTokens": 10**9}],
     "spec.canary.golden.prompts[0].maxTokens: 1,000,000,000 must be below contextLength 1,024"),
    ("spec.canary.golden.prompts", [{"prompt": "x"}, {"prompt": "y", "maxTokens": 2000}],
     "spec.canary.golden.prompts[1].maxTokens: 2,000 must be below contextLength 1,024 (the prompt needs room)"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value", "says"), REFUSED, ids=[f"{p.split('.')[-1]}={v!r}"[:50] for p, v, _ in REFUSED])
def test_the_webhook_refuses_canary_fields_that_cannot_work_by_field(path: str, value: Any, says: str) -> None:
    exc = denial(set_path(tiny_model(), path, value))
    assert exc is not None and exc.code == INVALID
    assert says in str(exc), exc


EDGES = [
    ("spec.canary.isolation.longRequestFractions", [1.0, 0.01], [1.000001],  # (0, 1]: the whole admissible length
     "spec.canary.isolation.longRequestFractions[0]: Input should be less than or equal to 1"),
    ("spec.canary.isolation.longRequestMaxTokens", 1008, 1009,  # contextLength - 16: A's shortest prompt still fits
     "spec.canary.isolation.longRequestMaxTokens: 1,009 leaves no room"),
    ("spec.canary.seed", 2**63 - 1, 2**63, "spec.canary.seed: Input should be less than or equal to"),
    ("spec.canary.seed", -(2**63), -(2**63) - 1, "spec.canary.seed: Input should be greater than or equal to"),
    ("spec.canary.capacity.minRatio", 2.0, 2.01, "spec.canary.capacity.minRatio: 2.01 is above spec.minKVRatio 2"),
    ("spec.canary.capacity.minRatio", 1.0, 0.99, "spec.canary.capacity.minRatio: must be at least 1"),
    ("spec.canary.golden.prompts", [{"prompt": "x", "maxTokens": 1023}], [{"prompt": "x", "maxTokens": 1024}],
     "spec.canary.golden.prompts[0].maxTokens: 1,024 must be below contextLength 1,024"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "edge", "past", "says"), EDGES, ids=[f"{e[0].split('.')[-1]}={e[1]!r}"[:50] for e in EDGES])
def test_each_bound_admits_its_edge_and_refuses_one_step_past_it(path: str, edge: Any, past: Any, says: str) -> None:
    assert denial(set_path(tiny_model(), path, edge)) is None
    exc = denial(set_path(tiny_model(), path, past))
    assert exc is not None and exc.code == INVALID and says in str(exc), exc


# --- the CRD says the same where the webhook is off ---------------------------------------------------


def crd_rejections(body: dict[str, Any]) -> list[str]:
    _, rejections = admit(copy.deepcopy(body), CRD)
    return [f"{r.path}: {r.message}" for r in rejections]


SCHEMA_REFUSED = [
    ("spec.canary.isolation.longRequestFractions", [0.3, 5.0], "spec.canary.isolation.longRequestFractions.1: 5.0 is greater than the maximum of 1.0"),
    ("spec.canary.isolation.longRequestFractions", [-3.0], "spec.canary.isolation.longRequestFractions.0: -3.0 is less than or equal to the minimum of 0.0"),
    ("spec.canary.seed", 18446744073709551616, "spec.canary.seed: 18446744073709551616 is greater than the maximum of 9223372036854775807"),
    ("spec.canary.capacity.minRatio", 1e6, "spec.canary.capacity.minRatio: 1000000.0 is greater than the maximum of 100.0"),
    ("spec.canary.capacity.minRatio", 0.5, "spec.canary.capacity.minRatio: 0.5 is less than the minimum of 1.0"),
    # The rule that spans fields (the path is the spec: the message names the field).
    ("spec.canary.isolation.longRequestMaxTokens", 4611686018427387904,
     "spec: spec.canary.isolation.longRequestMaxTokens: must be below contextLength"),
    ("spec.canary.isolation.longRequestMaxTokens", 1024, "spec: spec.canary.isolation.longRequestMaxTokens: must be below contextLength"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "value", "says"), SCHEMA_REFUSED, ids=[f"{p.split('.')[-1]}={v!r}"[:50] for p, v, _ in SCHEMA_REFUSED])
def test_the_crd_refuses_them_too(path: str, value: Any, says: str) -> None:
    rejections = crd_rejections(set_path(tiny_model(), path, value))
    assert any(r.startswith(says) for r in rejections), rejections


def test_a_disabled_isolation_probes_leftover_long_request_is_admitted_by_both() -> None:
    """The CRD refused longRequestMaxTokens 5000 at contextLength 1024 with isolation disabled,
    which the webhook admits: the probe does not run (an outside probe's differential fuzz)."""
    body = set_path(set_path(tiny_model(), "spec.canary.isolation.longRequestMaxTokens", 5000), "spec.canary.isolation.enabled", False)
    assert crd_rejections(body) == [] and denial(body) is None
    assert crd_rejections(set_path(body, "spec.canary.isolation.enabled", True)) != []


def test_the_crd_leaves_min_ratio_unset_and_stores_a_model_below_the_default_ratio() -> None:
    """A default of 2 in the schema would be written into every stored model (as an older CRD did),
    which the webhook's minRatio <= minKVRatio check would refuse for minKVRatio 1.5 (allowed: at
    least 1). The check is the webhook's only: the CRD has no rule that could lock such a model out."""
    body = set_path(tiny_model(), "spec.minKVRatio", 1.5)
    stored, rejections = admit(copy.deepcopy(body), CRD)
    assert rejections == []
    assert "minRatio" not in stored["spec"]["canary"]["capacity"]
    assert crd_rejections(set_path(body, "spec.canary.capacity.minRatio", 1.5)) == []


# --- the canary judges pools by the model's own minKVRatio ------------------------------------------


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with RunningServer(request.param) as running:
        yield running


def model_at(ratio: float, pool_tokens: int) -> dict[str, Any]:
    body = set_path(tiny_model(), "spec.minKVRatio", ratio)
    return set_path(body, "spec.kvPoolTokens", pool_tokens)


def test_the_canary_of_a_model_takes_its_min_kv_ratio() -> None:
    assert InferenceModelSpec.model_validate(model_at(1.5, 1536)["spec"]).canary.capacity.required_ratio() == 1.5
    assert InferenceModelSpec.model_validate(model_at(3.0, 4096)["spec"]).canary.capacity.required_ratio() == 3.0
    explicit = set_path(model_at(3.0, 4096), "spec.canary.capacity.minRatio", 2.5)
    assert InferenceModelSpec.model_validate(explicit["spec"]).canary.capacity.required_ratio() == 2.5
    # Dumped and read again (kvguard apply --local keeps specs so), it is the same spec.
    spec = InferenceModelSpec.model_validate(model_at(1.5, 1536)["spec"])
    assert InferenceModelSpec.model_validate(spec.model_dump(by_alias=True)) == spec


@pytest.mark.parametrize("server", [Behaviour(pool_tokens=768)], indirect=True)  # the fake's context is 512: 1.5x
async def test_a_pool_the_planner_passed_at_min_kv_ratio_1_5_passes_the_canary(server: RunningServer) -> None:
    body = model_at(1.5, 1536)  # 1.5 x contextLength 1024: the plan passes
    assert denial(body) is None
    canary = InferenceModelSpec.model_validate(body["spec"]).canary.only([ProbeName.CAPACITY])
    report = await run_suite(server.url, canary, metrics_urls=[server.metrics_url])
    result = report.probe(ProbeName.CAPACITY)
    assert result is not None and result.status == ProbeStatus.PASS, report.to_json()
    assert "768 tokens" not in result.reason and ">= 1.5 x context length" in result.reason


def test_kvguard_canary_with_a_model_manifest_takes_its_min_kv_ratio(tmp_path: Path) -> None:
    manifest = tmp_path / "model.yaml"
    manifest.write_text(yaml.safe_dump(model_at(1.5, 1536)))
    assert _load_spec(manifest, None).capacity.required_ratio() == 1.5
    manifest.write_text(yaml.safe_dump({"capacity": {"enabled": True}}))  # a bare CanarySpec: S7's default
    assert _load_spec(manifest, None).capacity.required_ratio() == 2.0


# --- nothing the spec says makes the long requests' prompts unbounded ---------------------------------


@pytest.mark.parametrize("fraction", [1.0e300, 5.0, float("inf"), float("nan"), -3.0])
def test_a_long_request_is_never_sized_beyond_the_admissible_length(fraction: float) -> None:
    """A spec built around its checks (model_copy does not validate) still sizes A within the
    budget: the word list is built on the operator's loop, where no timeout stops it."""
    estimate = TokenEstimate(None)  # worst case: a token per byte, 5 bytes a filler word
    assert long_request_words(estimate, 1000, fraction) == long_request_words(estimate, 1000, 1.0) == 200
    assert long_request_words(estimate, 1000, 0.5) == 100


def test_filler_words_refuses_more_than_the_longest_context_holds() -> None:
    with pytest.raises(ValueError, match="filler words asked for; at most"):
        filler_words(MAX_FILLER_WORDS + 1, seed=0)
    assert len(filler_words(3, seed=0)) == 3


def test_a_model_stored_with_the_older_crds_default_stays_editable_and_is_judged_by_its_own_ratio() -> None:
    """Outside review: the older CRD wrote minRatio 2 into every stored model; at minKVRatio 1.5
    every later spec edit was refused (a field the user never wrote), and its canary still judged
    pools by 2. Unchanged, it is admitted; the operator runs its canary at 1.5."""
    from kvguard.operator.webhook import check_admission

    stored = set_path(set_path(tiny_model(), "spec.minKVRatio", 1.5), "spec.canary.capacity.minRatio", 2.0)
    edited = set_path(stored, "spec.contextLength", 512)
    check_admission(edited, stored, "UPDATE", [])  # no AdmissionDenied
    assert InferenceModelSpec.model_validate(edited["spec"]).canary_to_run().capacity.required_ratio() == 1.5
    raised = set_path(stored, "spec.canary.capacity.minRatio", 3.0)  # written now: judged
    assert "spec.canary.capacity.minRatio: 3 is above spec.minKVRatio 1.5" in str(denial(raised) or "")


@pytest.mark.parametrize("context", [5, 16, 17])
def test_a_context_too_short_for_the_isolation_probe_is_admitted_only_without_it(context: int) -> None:
    """Its long request needs 16 prompt tokens and its own: at contextLength <= 17 the probe fails a
    healthy engine (a review: a looser `< contextLength` admitted 500 of 512, which failed), so
    the refusal says to turn it off, and off it is admitted. The CRD keeps the looser rule, which
    every stored model passes. At 16 or less no longRequestMaxTokens fits, so the refusal names
    contextLength, not the default the user never wrote (a new user's report)."""
    body = set_path(tiny_model(), "spec.contextLength", context)
    refusal = str(denial(body) or "")
    assert "or disable spec.canary.isolation" in refusal
    named = "spec.contextLength: " if context <= 16 else "spec.canary.isolation.longRequestMaxTokens: "
    assert named in refusal and ("longRequestMaxTokens" in refusal) == (context > 16), refusal
    assert crd_rejections(body) == []
    assert denial(set_path(body, "spec.canary.isolation", {"enabled": False})) is None


def test_the_canary_cli_runs_a_manifests_canary_as_the_operator_does() -> None:
    """A review: a manifest read back from a cluster holds the older CRD's minRatio 2; the CLI
    judged by it where the operator judges by minKVRatio."""
    from kvguard.commands.canary import _model_canary

    read_back = {"minKVRatio": 1.5, "canary": {"capacity": {"enabled": True, "minRatio": 2.0}}}
    assert _model_canary(read_back)["capacity"] == {"enabled": True, "minRatio": 1.5}
    assert _model_canary({"minKVRatio": 3.0, "canary": {"capacity": {"minRatio": 2.5}}})["capacity"]["minRatio"] == 2.5
    # No minKVRatio: the model's default (2) caps a written minRatio too, and fills a missing one.
    assert _model_canary({"canary": {"capacity": {"minRatio": 3.0}}})["capacity"]["minRatio"] == 2.0
    assert _model_canary({"canary": {}})["capacity"] == {"minRatio": 2.0}


@pytest.mark.parametrize(("stored", "run"), [(2, 30), (29, 30), (30, 30), (64, 64)])
def test_a_rollouts_gate_repeats_the_determinism_request_at_least_30_times(stored: int, run: int) -> None:
    """A review: the older CRD stored its default of 2 repeats into every model, and 2 let a build
    that corrupted 1 transfer chunk in 10 ship (an outside probe). The stored number cannot tell a
    choice from that default: the gate runs at least 30, more where written."""
    spec = set_path(tiny_model(), "spec.canary.determinism.repetitions", stored)["spec"]
    assert InferenceModelSpec.model_validate(spec).canary_to_run().determinism.repetitions == run
    from kvguard.commands.canary import _gate_repetitions  # kvguard canary -f on the manifest, alike

    assert _gate_repetitions(spec["canary"])["determinism"]["repetitions"] == run
    assert InferenceModelSpec.model_validate(tiny_model()["spec"]).canary_to_run().determinism.repetitions == 30
