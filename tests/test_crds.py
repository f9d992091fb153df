"""The CRDs in crds/ are generated from the pydantic models, structural, and accept the examples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from crd_admission import admit

from kvguard.cli import main
from kvguard.operator.crdgen import all_files, inference_model_crd, inference_policy_crd

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def openapi(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_files_match_the_models() -> None:
    for folder in ("crds", "manifests/crds"):
        for name, text in all_files().items():
            assert (ROOT / folder / name).read_text() == text, f"{folder}/{name} drifted: run `kvguard crds -o {folder}`"
    assert main(["crds", "--check", str(ROOT / "crds")]) == 0


def structural_problems(node: Any, path: str = "") -> list[str]:
    """The structural-schema rules the API server enforces that matter for generated schemas."""
    problems: list[str] = []
    if not isinstance(node, dict):
        return problems
    if "$ref" in node:
        problems.append(f"{path}: $ref")
    if node.get("additionalProperties") is False or ("properties" in node and "additionalProperties" in node):
        problems.append(f"{path}: additionalProperties with properties / false")
    special = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
    if "type" not in node and not special:
        problems.append(f"{path}: no type")
    for junctor in ("anyOf", "allOf", "oneOf"):
        for i, sub in enumerate(node.get(junctor, [])):
            if "type" in sub and not node.get("x-kubernetes-int-or-string"):
                problems.append(f"{path}.{junctor}[{i}]: type inside a junctor")
    for name, sub in node.get("properties", {}).items():
        problems += structural_problems(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += structural_problems(node[key], f"{path}.{key}")
    return problems


@pytest.mark.parametrize("build", [inference_model_crd, inference_policy_crd])
def test_schemas_are_structural(build: Any) -> None:
    assert structural_problems(openapi(build())) == []


def test_inference_model_crd_shape() -> None:
    crd = inference_model_crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["infm"] and crd["spec"]["scope"] == "Namespaced"
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Phase", "Revision", "KV Ratio", "Canary", "Step", "Weight", "Age"]
    spec = openapi(crd)["properties"]["spec"]
    assert spec["properties"]["engine"]["properties"]["kind"]["enum"] == ["kvguard", "sglang", "vllm"]
    assert spec["properties"]["minKVRatio"] == {**spec["properties"]["minKVRatio"], "minimum": 1.0, "default": 2.0}
    assert spec["properties"]["contextLength"]["exclusiveMinimum"] is True
    assert "canary" in spec["properties"] and "kvTransfer" in spec["properties"]
    assert {"rule", "message"} <= set(spec["x-kubernetes-validations"][0])
    assert inference_policy_crd()["spec"]["scope"] == "Cluster"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(path: Path) -> None:
    errors = jsonschema.Draft4Validator(openapi(inference_model_crd())).iter_errors(yaml.safe_load(path.read_text()))
    assert [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors] == []


def test_schema_rejects_bad_values_with_the_field_named() -> None:
    body = yaml.safe_load(EXAMPLES[0].read_text())
    body["spec"]["engine"]["kind"] = "tgi"
    body["spec"]["contextLength"] = 0
    errors = {".".join(map(str, e.path)) for e in jsonschema.Draft4Validator(openapi(inference_model_crd())).iter_errors(body)}
    assert {"spec.engine.kind", "spec.contextLength"} <= errors


IMAGES = {"lmsysorg/sglang:v0.5.22": True, "ghcr.io/org/img:1.0@sha256:" + "b" * 64: True, "localhost:5000/a/b_c__d:x": True,
          "[::1]:5000/img": True, "Registry.Example.COM/app": True, "Foo/Bar:latest": False, "foo@sha256:abc": False,
          "foo::1": False, "img:": False, "a//b": False, "registry:5000/" + "a" * 241 + ":tag": True,
          "registry:5000/" + "a" * 242 + ":tag": False}  # fmt: skip


@pytest.mark.parametrize(("image", "valid"), IMAGES.items())
def test_the_schema_and_the_model_read_an_image_reference_alike(image: str, valid: bool) -> None:
    """The API server (the CRD's pattern) and the webhook (the model) admit the same references."""
    from pydantic import ValidationError

    from kvguard.operator.api import InferenceModel

    body = yaml.safe_load(EXAMPLES[0].read_text())
    body["spec"]["engine"]["image"] = image
    _, rejections = admit(body, inference_model_crd())  # the schema's pattern, then the name's CEL rule (255 characters)
    assert ("spec.engine.image" not in {r.path for r in rejections}) is valid
    try:
        InferenceModel.model_validate(body)
    except ValidationError as exc:
        assert not valid and "is not an image reference" in str(exc)
    else:
        assert valid


def test_crds_validate_as_kubernetes_objects() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for text in all_files().values():
        # raises ValidationError naming the field; returns the schema version it checked against
        assert kubernetes_validate.validate(yaml.safe_load(text), "1.30", strict=True).startswith("1.30")


def test_an_output_folder_that_cannot_be_created_is_bad_input_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crds", "-o", "/etc/passwd/x"]) == 2
    assert capsys.readouterr().err == "kvguard crds: -o /etc/passwd/x: cannot create the folder: Not a directory; nothing was written\n"


def test_an_output_path_that_is_a_file_is_bad_input_saying_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Outside probe: `crds -o /etc/passwd` was exit 1 with "File exists: /etc/passwd"."""
    existing = tmp_path / "a-file"
    existing.write_text("mine")
    assert main(["crds", "-o", str(existing)]) == 2
    assert capsys.readouterr().err == f"kvguard crds: -o {existing} is not a folder; nothing was written\n"
    assert existing.read_text() == "mine"


def test_an_output_file_that_cannot_be_written_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Writing a file into the folder fails (here: a folder stands where a CRD file goes): the
    general one-line OSError of the command line, exit 1."""
    (tmp_path / next(iter(all_files()))).mkdir()
    assert main(["crds", "-o", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("kvguard crds: Is a directory: ")


def test_stdout_on_a_full_disk_is_one_line_not_a_traceback() -> None:
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-P", "-m", "kvguard", "plan", "-f", str(ROOT / "examples" / "tiny-cpu.yaml")],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and done.stderr == "kvguard plan: No space left on device\n"


def test_check_names_a_missing_folder_and_missing_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crds", "--check", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"kvguard crds: --check {tmp_path / 'nope'}: no such folder\n"
    assert main(["crds", "--check", str(tmp_path)]) == 1
    assert f"{tmp_path / 'kvguard.io_inferencemodels.yaml'}: missing; run `kvguard crds -o {tmp_path}`" in capsys.readouterr().err



def test_an_int_or_string_keeps_its_integer_bound_in_the_form_the_api_server_reads() -> None:
    """JSON Schema's `exclusiveMinimum: 0` is a number; the API server's is a flag beside `minimum`
    (the review of the byte quantities' bounds: copied as a number, the CRD would be refused)."""
    from typing import Annotated

    from pydantic import BaseModel, WithJsonSchema

    from kvguard.operator.crdgen import structural_schema

    class Sized(BaseModel):
        size: Annotated[int, WithJsonSchema({"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"type": "string"}],
                                             "x-kubernetes-int-or-string": True})]  # fmt: skip

    node = structural_schema(Sized)["properties"]["size"]
    assert node == {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
                    "minimum": 0, "exclusiveMinimum": True}  # fmt: skip
