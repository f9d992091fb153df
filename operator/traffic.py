"""The objects that split user traffic between the stable and the candidate revision (pure).

spec.rollout.trafficRouter decides what carries the split:

- `service`: the model's Service selects one revision's routers (`render.render_model_service`);
  all traffic moves at once, so only one step of 100% is allowed (api.check_steps).
- `gatewayAPI`: an HTTPRoute named after the model, attached to spec.rollout.gateway.parentRefs,
  whose one rule sends the OpenAI API (`/v1`) to the stable and candidate routers' Services with
  the step's weights.
- `inferencePool`: one InferencePool (Gateway API Inference Extension, inference.networking.k8s.io/v1)
  per revision, selecting that revision's router pods, and the same HTTPRoute weighting the pools.

S8: the split always names the stable revision while it serves. A candidate taken back to weight
0 (a failed analysis) is at weight 0 in the route for as long as it is the candidate; once it is
retired the route names the stable revision alone (an outside probe saw the two writes).
The model Service keeps selecting the stable routers in every mode: in-cluster clients that use
`<model>.<namespace>.svc` are not split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvguard.operator.api import InferenceModelSpec, KVPlan, RolloutSpec, TrafficRouter
from kvguard.operator.render import HTTP_PORT, Manifest, Owner, object_name, owned_metadata, selector

GATEWAY_GROUP = "gateway.networking.k8s.io"
HTTP_ROUTE_API = f"{GATEWAY_GROUP}/v1"
INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_API = f"{INFERENCE_GROUP}/v1"
API_PATH_PREFIX = "/v1"
"""The route matches only the OpenAI API; the routers' other paths (metrics, health) stay internal."""


@dataclass(frozen=True)
class Share:
    """One revision's share of user traffic."""

    revision: str
    weight: int
    """Percent (0..100); the weights of a split add up to 100."""


def traffic_split(stable: str | None, candidate: str | None, weight: int) -> tuple[Share, ...]:
    """The backends of the route: the stable revision gets 100 - weight and the candidate weight.

    No stable revision (a first rollout): the candidate gets everything it is given, the rest
    nothing -- there is nowhere else to send it. No candidate, or the candidate is the stable one:
    one backend at 100.
    """
    if not 0 <= weight <= 100:
        raise ValueError(f"weight must be 0..100, got {weight}")
    if candidate is None or candidate == stable:
        return (Share(stable, 100),) if stable else ()
    if stable is None:
        return (Share(candidate, 100),)
    return (Share(stable, 100 - weight), Share(candidate, weight))


def route_name(model: str) -> str:
    return model


def inference_pool_name(model: str, revision: str) -> str:
    return f"{model}-{revision}"


def _backend_ref(owner: Owner, router: TrafficRouter, backend: Share) -> dict[str, Any]:
    if router is TrafficRouter.INFERENCE_POOL:
        return {"group": INFERENCE_GROUP, "kind": "InferencePool",
                "name": inference_pool_name(owner.name, backend.revision), "weight": backend.weight}  # fmt: skip
    return {"group": "", "kind": "Service", "name": object_name(owner.name, backend.revision, "router"),
            "port": HTTP_PORT, "weight": backend.weight}  # fmt: skip


def render_http_route(owner: Owner, rollout: RolloutSpec, backends: tuple[Share, ...]) -> Manifest:
    """The model's HTTPRoute: `/v1` on the given hostnames, split between `backends` by weight."""
    if rollout.gateway is None or rollout.traffic_router is TrafficRouter.SERVICE:
        raise ValueError("an HTTPRoute needs trafficRouter gatewayAPI or inferencePool and spec.rollout.gateway")
    parents = []
    for ref in rollout.gateway.parent_refs:
        parent: dict[str, Any] = {"group": GATEWAY_GROUP, "kind": "Gateway", "name": ref.name}
        if ref.namespace:
            parent["namespace"] = ref.namespace
        if ref.section_name:
            parent["sectionName"] = ref.section_name
        if ref.port:
            parent["port"] = ref.port
        parents.append(parent)
    spec: dict[str, Any] = {
        "parentRefs": parents,
        "rules": [{
            "matches": [{"path": {"type": "PathPrefix", "value": API_PATH_PREFIX}}],
            "backendRefs": [_backend_ref(owner, rollout.traffic_router, b) for b in backends],
        }],
    }  # fmt: skip
    if rollout.gateway.hostnames:
        spec["hostnames"] = list(rollout.gateway.hostnames)
    return {"apiVersion": HTTP_ROUTE_API, "kind": "HTTPRoute", "metadata": owned_metadata(owner, route_name(owner.name), None), "spec": spec}


def render_inference_pool(owner: Owner, rollout: RolloutSpec, revision: str) -> Manifest:
    """The revision's InferencePool: its router pods on the HTTP port, with the EPP if one is named."""
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector(owner.name, revision, "router")},
        "targetPorts": [{"number": HTTP_PORT}],
    }
    picker = rollout.inference_pool.endpoint_picker_ref if rollout.inference_pool else None
    if picker is not None:
        spec["endpointPickerRef"] = {"kind": "Service", "name": picker.name, "port": {"number": picker.port},
                                     "failureMode": picker.failure_mode}  # fmt: skip
    metadata = owned_metadata(owner, inference_pool_name(owner.name, revision), revision)
    return {"apiVersion": INFERENCE_POOL_API, "kind": "InferencePool", "metadata": metadata, "spec": spec}


def render_traffic(spec: InferenceModelSpec, owner: Owner, backends: tuple[Share, ...]) -> list[Manifest]:
    """Every object that carries the split, besides the model Service: nothing for `service`, the
    HTTPRoute for `gatewayAPI`, and one InferencePool per backend plus the HTTPRoute for
    `inferencePool` (pools first: the route names them)."""
    router = spec.rollout.traffic_router
    if router is TrafficRouter.SERVICE or not backends:
        return []
    pools = [render_inference_pool(owner, spec.rollout, b.revision) for b in backends] if router is TrafficRouter.INFERENCE_POOL else []
    return [*pools, render_http_route(owner, spec.rollout, backends)]


def route_weights(route: Manifest) -> dict[str, int]:
    """backendRef name -> weight of a rendered or live HTTPRoute (what tests and `kvguard status` read)."""
    refs = route.get("spec", {}).get("rules", [{}])[0].get("backendRefs", [])
    return {ref["name"]: int(ref.get("weight", 1)) for ref in refs}


@dataclass(frozen=True)
class DesiredObjects:
    """Every object the operator creates for a spec (what `kvguard render` prints)."""

    revision: str
    """The spec's revision (the candidate)."""
    objects: tuple[Manifest, ...]
    secret_refs: tuple[tuple[str, str], ...]
    """(kind, name prefix) of the per-revision transfer Secrets (kvguard's engine only): created
    with a fresh random key each, under the prefix plus a random suffix, so they are named but never
    rendered (S3); the rendered Deployments name them by the prefix."""
    plan: KVPlan
    """The planner's verdict the objects were rendered with: a blocked one is never deployed (S7)."""


def desired_objects(
    spec: InferenceModelSpec, owner: Owner, *, faults: str = "", stable: str | None = None, weight: int | None = None
) -> DesiredObjects:
    """The spec's revision (full scale), the model Service and the traffic objects.

    `stable`: the revision serving now (default: the spec's own, as after its rollout); the split
    then gives the candidate `weight` percent (default: the first step's). Raises PlanInputError,
    RenderError or ValueError on a spec the operator would refuse.
    """
    from kvguard.operator.engine_support import engine_problems
    from kvguard.operator.pd_parity import parity_problem
    from kvguard.operator.planner import plan, plan_to_render
    from kvguard.operator.render import reads_transfer_key, render_model_service, render_revision, transfer_secret_prefix
    from kvguard.operator.revision import revision_of

    # What reconcile refuses before it renders anything (InvalidSpec, PDParityMismatch).
    if problems := engine_problems(spec):
        raise ValueError("; ".join(problems))
    kv_plan = plan(spec)
    # A blocked plan is rendered for its field checks only (a pool of 0 renders nothing): the
    # caller deploys nothing for it and says it is blocked, as `kvguard plan` does.
    rendered_with = plan_to_render(spec, kv_plan)
    if (mismatch := parity_problem(spec, rendered_with)) is not None:
        raise ValueError(mismatch)
    revision = revision_of(spec, faults)
    serving = stable or revision
    share = spec.rollout.steps[0].weight if weight is None else weight
    backends = traffic_split(serving, revision, share)
    workloads = render_revision(spec, rendered_with, owner, revision, "full", faults)
    objects = [*workloads, render_model_service(owner, serving), *render_traffic(spec, owner, backends)]
    secrets = (("Secret", transfer_secret_prefix(owner.name, revision)),) if reads_transfer_key(workloads) else ()
    return DesiredObjects(revision, tuple(objects), secrets, kv_plan)
