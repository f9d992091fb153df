"""Spec checks that were the webhook's alone, now in the CRD's schema or rules too: a cluster whose
webhook is down (failurePolicy Ignore), not installed, or skipped (`kubectl apply --validate`, a
dry run) refuses them at the same field. Each is refused by the webhook (pydantic) and by the CRD
(schema, then CEL, as kube-apiserver evaluates them: crd_admission.py), and its edge is accepted by
both.

None of them can lock out a model an API server stored before: each bound or rule is one pydantic
already enforced (reconcile reports such a stored model InvalidSpec and halts its rollout, so it
serves no revision the rule stops), or one that no reference that ever ran breaks (an image name
over 255 characters: InvalidImageName). Where the API server ratchets (1.30 and later), an update
that leaves such a field as it is passes anyway.
"""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_admission import Rejection, admit, evaluate_rule
from pydantic import ValidationError
from pydantic.alias_generators import to_camel
from test_spec_refusals import denial, tiny_model
from test_webhook import set_path

from kvguard.operator.api import IMAGE_NAME_RULE, IMAGE_REFERENCE, MAX_IMAGE_NAME, InferenceModel, _image_name
from kvguard.operator.canary.prompts import BYTES_PER_WORD, MAX_FILLER_WORDS
from kvguard.operator.canary.spec import MAX_PROMPT_BYTES, ProbeName
from kvguard.operator.crdgen import inference_model_crd
from kvguard.operator.webhook import INVALID

ROOT = Path(__file__).resolve().parent.parent
CRD = inference_model_crd()
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def sglang_model() -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-sglang-h100.yaml").read_text())
    body["metadata"] = {"name": "llama", "namespace": "models", "uid": "uid-llama", "generation": 1}
    return body


def crd_rejections(body: dict[str, Any]) -> list[Rejection]:
    _, rejections = admit(copy.deepcopy(body), CRD)
    return rejections


LONG_NAME = "registry:5000/" + "a" * 242 + ":tag"  # a repository name of 256 characters
EDGE_NAME = "registry:5000/" + "a" * 241 + ":tag"  # 255
ALL_OFF = {to_camel(p.value): {"enabled": False} for p in ProbeName}
ONE_ON = {**ALL_OFF, "abort": {"enabled": True}}
QUERY = {"query": "up", "max": 1}
ANALYSIS = {"prometheusURL": "http://prometheus:9090"}

# (base, path, refused value, edge value, what the webhook says, where the CRD refuses it, what it says)
CASES: dict[str, tuple[Any, str, Any, Any, str, str, str]] = {
    "maxPromptBytes": (tiny_model, "spec.canary.overLength.maxPromptBytes", MAX_PROMPT_BYTES + 1, MAX_PROMPT_BYTES,
                       "spec.canary.overLength.maxPromptBytes: Input should be less than or equal to 335544320",
                       "spec.canary.overLength.maxPromptBytes", "335544321 is greater than the maximum of 335544320"),
    "image name": (tiny_model, "spec.engine.image", LONG_NAME, EDGE_NAME,
                   "spec.engine.image: 'registry:5000/aaaa", "spec.engine.image", IMAGE_NAME_RULE["message"]),
    "router image name": (tiny_model, "spec.engine.routerImage", LONG_NAME, EDGE_NAME, "spec.engine.routerImage",
                          "spec.engine.routerImage", IMAGE_NAME_RULE["message"]),
    "role image name": (sglang_model, "spec.roles.decode.image", "r.io/" + "b" * 251 + "@sha256:" + "c" * 64,
                        "r.io/" + "b" * 250 + "@sha256:" + "c" * 64, "spec.roles.decode.image",
                        "spec.roles.decode.image", IMAGE_NAME_RULE["message"]),
    "contextLength": (tiny_model, "spec.contextLength", 16_777_217, 16_777_216,
                      "spec.contextLength: must be at most 16,777,216 tokens",
                      "spec.contextLength", "16777217 is greater than the maximum of 16777216"),
    "canary.contextLength": (tiny_model, "spec.canary.contextLength", 16_777_217, 16_777_216,
                             "spec.canary.contextLength: must be at most 16,777,216 tokens",
                             "spec.canary.contextLength", "16777217 is greater than the maximum of 16777216"),
    "requestTimeoutSeconds": (tiny_model, "spec.canary.requestTimeoutSeconds", 86400.5, 86400.0,
                              "spec.canary.requestTimeoutSeconds: must be at most 86400 seconds",
                              "spec.canary.requestTimeoutSeconds", "86400.5 is greater than the maximum of 86400.0"),
    "suiteTimeoutSeconds": (tiny_model, "spec.canary.suiteTimeoutSeconds", 10**6, 86400,
                            "spec.canary.suiteTimeoutSeconds: must be at most 86400 seconds",
                            "spec.canary.suiteTimeoutSeconds", "1000000 is greater than the maximum of 86400.0"),
    "poolRecoveryTimeoutSeconds": (tiny_model, "spec.canary.abort.poolRecoveryTimeoutSeconds", 86401, 86400,
                                   "spec.canary.abort.poolRecoveryTimeoutSeconds: must be at most 86400 seconds",
                                   "spec.canary.abort.poolRecoveryTimeoutSeconds", "86401 is greater than the maximum of 86400.0"),
    "prefillDisconnectAfterSeconds above": (
        tiny_model, "spec.canary.abort.prefillDisconnectAfterSeconds", [0.01, 86401], [0.0, 86400],
        "spec.canary.abort.prefillDisconnectAfterSeconds: each delay must be between 0 and 86400 seconds",
        "spec.canary.abort.prefillDisconnectAfterSeconds.1", "86401 is greater than the maximum of 86400.0"),
    "prefillDisconnectAfterSeconds below": (
        tiny_model, "spec.canary.abort.prefillDisconnectAfterSeconds", [-0.5], [0],
        "spec.canary.abort.prefillDisconnectAfterSeconds: each delay must be between 0 and 86400 seconds",
        "spec.canary.abort.prefillDisconnectAfterSeconds.0", "-0.5 is less than the minimum of 0.0"),
    "every probe off": (tiny_model, "spec.canary", ALL_OFF, ONE_ON, "spec.canary: every probe is disabled",
                        "spec.canary", "every probe is disabled; enable at least one"),
    "kvTransfer.port": (tiny_model, "spec.kvTransfer.port", 8001, 8002,
                        "spec.kvTransfer: port: 8001 is decode's metrics port already",
                        "spec.kvTransfer", "port: 8000 is decode's API port and 8001 is decode's metrics port already"),
    "gpuCount below the split": (sglang_model, "spec.roles.decode", {"tensorParallel": 4, "gpuCount": 1},
                                 {"tensorParallel": 4, "pipelineParallel": 2, "gpuCount": 8},
                                 "spec.roles.decode: gpuCount 1 is below tensorParallel x pipelineParallel (4)",
                                 "spec.roles.decode", "gpuCount is below tensorParallel x pipelineParallel"),
    "pods per Deployment": (sglang_model, "spec.roles.decode", {"replicas": 2_000_000, "dataParallel": 3000},
                            {"replicas": 32767, "dataParallel": 65536},  # 2,147,418,112 pods: within int32
                            "spec.roles.decode: replicas x dataParallel (6000000000) is more pods",
                            "spec.roles.decode", "replicas x dataParallel is more pods than a Deployment holds (2147483647)"),
    "query names repeated": (tiny_model, "spec.rollout.analysis",
                             {**ANALYSIS, "queries": [{"name": "q", **QUERY}, {"name": "q", **QUERY}]},
                             {**ANALYSIS, "queries": [{"name": "q", **QUERY}, {"name": "q2", **QUERY}]},
                             "spec.rollout.analysis: query names must be unique and not one of safety, "
                             "errorRatio, ttft, itl: q", "spec.rollout.analysis",
                             "query names must be unique and not one of safety, errorRatio, ttft, itl"),
    "query named as a built-in check": (tiny_model, "spec.rollout.analysis", {**ANALYSIS, "queries": [{"name": "ttft", **QUERY}]},
                                        {**ANALYSIS, "queries": [{"name": "ttft2", **QUERY}]},
                                        "query names must be unique and not one of safety, errorRatio, ttft, itl: ttft",
                                        "spec.rollout.analysis", "query names must be unique"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_refused_by_the_webhook_and_the_crd_at_the_same_field_and_its_edge_accepted_by_both(name: str) -> None:
    base, path, bad, edge, says, where, crd_says = CASES[name]
    exc = denial(set_path(base(), path, copy.deepcopy(bad)))
    assert exc is not None and exc.code == INVALID and says in str(exc), exc
    rejections = crd_rejections(set_path(base(), path, copy.deepcopy(bad)))
    assert [r for r in rejections if r.path == where and crd_says in r.message], rejections
    body = set_path(base(), path, copy.deepcopy(edge))
    InferenceModel.model_validate(body)  # what the webhook, reconcile and the CLI parse
    assert crd_rejections(body) == []


def test_max_prompt_bytes_is_the_longest_prompt_the_canary_can_build() -> None:
    """The bound is the filler cap in bytes: at the bound every case maxPromptBytes lets through can
    still be built; above it one could reach `filler_words`, which refuses it (a probe error)."""
    assert MAX_PROMPT_BYTES == MAX_FILLER_WORDS * BYTES_PER_WORD == 320 * 1024**2
    assert SCHEMA["properties"]["spec"]["properties"]["canary"]["properties"]["overLength"]["properties"][
        "maxPromptBytes"]["maximum"] == MAX_PROMPT_BYTES  # fmt: skip


def test_kvguard_canary_spec_refuses_it_by_field() -> None:
    """The CLI reads a canary spec with the same model: the same field-level message."""
    from kvguard.operator.canary.spec import CanarySpec

    with pytest.raises(ValidationError) as caught:
        CanarySpec.model_validate({"overLength": {"maxPromptBytes": 2**40}})
    assert [e["loc"] for e in caught.value.errors()] == [("overLength", "maxPromptBytes")]
    assert CanarySpec.model_validate({"overLength": {"maxPromptBytes": MAX_PROMPT_BYTES}}).over_length.max_prompt_bytes == MAX_PROMPT_BYTES


def _references(seed: int) -> list[str]:
    """References the pattern admits with names around 255 characters: with and without a registry
    (and its port, or an IPv6 one), several path components, a tag, a digest, both."""
    rng = random.Random(seed)
    out = []
    for _ in range(400):
        host = rng.choice(["", "r.io/", "registry:5000/", "[::1]:5000/", "localhost/", "a-b.c:1/"])
        target = rng.randint(240, 270) - len(host)
        parts, size = [], 0
        while size < target:
            part = "".join(rng.choices("abcxyz0", k=max(1, min(rng.randint(1, 60), target - size - 1))))
            parts.append(part)
            size += len(part) + 1
        tag = rng.choice(["", ":v1", ":" + "T" * 128, ":latest_1.2-x"])
        digest = rng.choice(["", "@sha256:" + "d" * 64, "@sha512:" + "e" * 128])
        out.append(host + "/".join(parts) + tag + digest)
    return [r for r in out if re.fullmatch(IMAGE_REFERENCE, r)]


IMAGE_PATHS = [("engine", "image"), ("engine", "routerImage"), ("roles", "prefill", "image"), ("roles", "decode", "image")]


def test_the_crds_name_rule_agrees_with_the_webhooks_count_on_every_reference_near_the_bound() -> None:
    rules = []
    for fields in IMAGE_PATHS:  # every image field of the CRD carries the rule
        node = SCHEMA["properties"]["spec"]
        for field in fields:
            node = node["properties"][field]
        rules += [r["rule"] for r in node.get("x-kubernetes-validations", [])]
    assert rules == [IMAGE_NAME_RULE["rule"]] * len(IMAGE_PATHS)
    references = _references(7)
    assert len(references) > 300
    lengths = {len(_image_name(r)) for r in references}
    assert {MAX_IMAGE_NAME, MAX_IMAGE_NAME + 1} <= lengths  # the bound itself is tried, from both sides
    for reference in references:
        assert evaluate_rule(IMAGE_NAME_RULE["rule"], reference) is (len(_image_name(reference)) <= MAX_IMAGE_NAME), reference


@pytest.mark.parametrize(("rule_at", "node", "new_rule"), [
    ("spec.roles.decode", {}, "replicas x dataParallel"), ("spec.roles.prefill", {"gpuCount": 2}, "gpuCount is below"),
    ("spec.kvTransfer", {}, "port: 8000"), ("spec.canary", {}, "every probe is disabled"),
    ("spec.canary", {"golden": {}}, "every probe is disabled"), ("spec.rollout.analysis", {}, "query names must be unique"),
    ("spec.rollout.analysis", {"queries": []}, "query names must be unique"),
])  # fmt: skip
def test_the_new_rules_hold_on_objects_stored_without_the_defaults(rule_at: str, node: dict[str, Any], new_rule: str) -> None:
    """A rule must not fail with "no such key" on what an older CRD stored (fields left out)."""
    schema = SCHEMA
    for part in rule_at.split("."):
        schema = schema["properties"][part]
    rules = schema.get("x-kubernetes-validations", [])
    assert any(new_rule in r["message"] for r in rules), rules
    assert all(evaluate_rule(r["rule"], node) is True for r in rules), rules
