"""A child object the API server refuses (422) stops the rollout with the API server's own message
on the model (Degraded, ObjectRefused), not an invisible retry loop; a fixed spec recovers.

The webhook and the models refuse what they know the API server refuses (node selector and
toleration syntax, images, resources, replicas: test_webhook.py); this is for the rest. kmock
validates nothing, so the emulator here refuses Deployments that carry a marker node label, the
way kube-apiserver answers an invalid object: 422, reason Invalid.
"""

from __future__ import annotations

from typing import Any

import pytest
from kmock._internal import k8s as kmock_k8s
from kmock_api import ApiServer
from operator_harness import DEPLOYMENTS, apply_model, condition, objects_of, patch_model, status_of, tiny_model, until

REFUSED_LABEL = "example.com/refused-by-the-api-server"


class RefusingApiServer(ApiServer):
    async def _handle(self, request: Any) -> Any:
        data = request.data if isinstance(request.data, dict) else {}
        pod = ((data.get("spec") or {}).get("template") or {}).get("spec") or {}
        if request.resource is not None and request.resource.plural == "deployments" and REFUSED_LABEL in (pod.get("nodeSelector") or {}):
            name = (data.get("metadata") or {}).get("name")
            return await self._render_error(kmock_k8s.KubernetesError(
                422, "Invalid", f'Deployment.apps "{name}" is invalid: spec.template.spec.nodeSelector: Invalid value: "{REFUSED_LABEL}"'))  # fmt: skip
        return await super()._handle(request)


pytestmark = [pytest.mark.kmock(cls=RefusingApiServer)]


async def test_a_refused_child_object_is_reported_on_the_model_until_the_spec_changes(cluster: Any) -> None:
    body = tiny_model()
    body["spec"]["roles"]["decode"]["nodeSelector"] = {REFUSED_LABEL: "yes"}
    await apply_model(body)
    status = await until(lambda: status_of(cluster).get("phase") == "Degraded" and status_of(cluster), "Degraded")
    degraded = condition(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ObjectRefused"
    assert "the API server refused an object of this spec" in degraded["message"] and "spec.template.spec.nodeSelector" in degraded["message"]
    assert condition(status, "Progressing")["status"] == "False"
    await patch_model("tiny", {"spec": {"roles": {"decode": {"nodeSelector": None}}}})
    await until(lambda: len(objects_of(cluster, DEPLOYMENTS)) == 3, "every Deployment created once the spec is fixed")
    await until(lambda: condition(status_of(cluster), "Degraded")["reason"] != "ObjectRefused", "the refusal no longer reported")
