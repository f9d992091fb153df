"""The validating admission webhooks for InferenceModels and InferencePolicies (kopf), and the
InferencePolicy index.

Registered by importing this module (`kvguard.operator.handlers` does). On CREATE and UPDATE of an
InferenceModel the API server sends an AdmissionReview here; the model is rejected, with a
message naming the field and the rule, when its spec is invalid for the planner or the renderer,
or when an applicable InferencePolicy says no (`kvguard.operator.policy`, S7). An UPDATE that
leaves the spec unchanged (labels, annotations, finalizers: kopf's own bookkeeping included) and
an object being deleted are always admitted (a model that became non-compliant after a policy
change is reported by reconcile, not locked or killed); only a `kvguard.io/pause` value that an
update writes must be "true" or "false" (`rollout.annotation_problems`), as on CREATE.

On CREATE and UPDATE of an InferencePolicy a policy whose spec does not parse, or one with a rule
that cannot be read or met (an unknown engine kind or unreadable version in minEngineVersions, an
unknown probe in requiredCanaryProbes, a required engine flag no model of that engine can carry, a
namespace name or selector entry that matches nothing: `policy.rule_problems`), is refused, naming
the field. Admitted, such a rule would fail closed on every model it covers, a blocking finding on
each, at the next reconcile, or silently apply to fewer namespaces than written: the author should
hear it when writing the policy.

TLS (docs/webhook.md): kopf's `WebhookServer` serves HTTPS with the certificate in
KVGUARD_WEBHOOK_CERT_DIR (`tls.crt`, `tls.key`, optional `ca.crt`: a mounted Secret written by
cert-manager or by hand) and reloads it when the files change. Without that variable the webhook
is off: the handler stays registered (kopf requires a server for it, so a server that never
listens is installed) and policy is still enforced by reconcile. Environment:
- KVGUARD_WEBHOOK_CERT_DIR: the certificate directory; unset = webhook off. With a
  `client-ca.crt` there, a client must present a certificate it signed (the API server's, given
  in its AdmissionConfiguration): nothing else in the cluster can post reviews.
- KVGUARD_WEBHOOK_ADDR / KVGUARD_WEBHOOK_PORT: where to listen (0.0.0.0:9443).
- KVGUARD_WEBHOOK_MANAGED: a ValidatingWebhookConfiguration name for kopf to create and keep
  pointed at this server (url-based, with ca.crt as caBundle); needs KVGUARD_WEBHOOK_HOST (the
  Service DNS name) and RBAC on validatingwebhookconfigurations. Unset: the configuration is
  static (manifests/webhook/).

Policies are read from the API server on every admission request rather than from the index:
kopf starts the admission server before its indexes are populated, so an index could admit a
non-compliant model in the first seconds after a restart. The index (`inference_policies`) is
for reconcile handlers, which kopf runs only once every index is complete.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf
from pydantic import ValidationError

from kvguard.operator.api import (
    API_GROUP,
    API_VERSION,
    InferenceModelSpec,
    InferencePolicy,
    InferencePolicySpec,
    model_name_problem,
)
from kvguard.operator.kube import Kube, KubeError
from kvguard.operator.policy import describe_violations, evaluate, rule_problems
from kvguard.operator.reconcile import field_errors
from kvguard.operator.rollout import PAUSE_ANNOTATION, ROLLBACK_ANNOTATION, annotation_problems
from kvguard.operator.spec_checks import SpecInvalid, check_spec_fields, resplit_problem

log = logging.getLogger(__name__)

MODELS = (API_GROUP, API_VERSION, "inferencemodels")
POLICIES = (API_GROUP, API_VERSION, "inferencepolicies")
WEBHOOK_ID = "validate-inferencemodel"
"""kopf's handler id, which is also the URL path the webhook configuration must call
(`/validate-inferencemodel`): kopf routes a request to the handler named by its path."""
POLICY_WEBHOOK_ID = "validate-inferencepolicy"
"""The InferencePolicy handler's id and path (`/validate-inferencepolicy`)."""
DEFAULT_PORT = 9443
INVALID = 422  # the spec cannot be planned or rendered
FORBIDDEN = 403  # a policy forbids it


class AdmissionDenied(Exception):
    """Why an InferenceModel is not admitted, with the HTTP code for the AdmissionReview status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# --- the decision (no kopf, no I/O) --------------------------------------------------------------


def spec_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> bool:
    return old is None or new is None or old.get("spec") != new.get("spec")


def _control_annotations_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether an update writes the pause or rollback-to annotation (checked then only: an
    unrelated update of a model admitted before this check existed is not refused for it)."""
    def control(body: Mapping[str, Any] | None) -> tuple[object, object]:
        annotations = _object_at(_object_at(body, "metadata"), "annotations")
        return annotations.get(PAUSE_ANNOTATION), annotations.get(ROLLBACK_ANNOTATION)

    return control(old) != control(new)


def _object_at(body: Mapping[str, Any] | None, key: str) -> Mapping[str, Any]:
    """`body[key]` where it is an object, else an empty one (a missing or null field; the
    metadata's shape is checked by `_metadata_problem` before anything reads it)."""
    value = (body or {}).get(key)
    return value if isinstance(value, Mapping) else {}


def _metadata_problem(body: Mapping[str, Any]) -> str | None:
    """A `metadata` or `metadata.annotations` that is not an object (the API server's own
    decoding refuses one first; this function may also be given a body straight from a file),
    which raised AttributeError here (outside probe)."""
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, Mapping):
        return f"metadata: must be an object, got {type(meta).__name__}"
    annotations = (meta or {}).get("annotations")
    if annotations is not None and not isinstance(annotations, Mapping):
        return f"metadata.annotations: must be an object of strings, got {type(annotations).__name__}"
    return None


def check_admission(body: Mapping[str, Any], old: Mapping[str, Any] | None, operation: str | None,
                    policies: Sequence[InferencePolicy]) -> None:
    """Raise AdmissionDenied when the InferenceModel `body` must not be admitted."""
    if operation not in ("CREATE", "UPDATE"):
        return
    if (problem := _metadata_problem(body)) is not None:
        raise AdmissionDenied(problem, INVALID)
    meta = _object_at(body, "metadata")
    if operation == "CREATE" or _control_annotations_changed(old, body):
        if problems := annotation_problems(meta.get("annotations")):
            raise AdmissionDenied("; ".join(problems), INVALID)
    if operation == "UPDATE" and not spec_changed(old, body):
        # metadata-only: never lock an existing model out of its own bookkeeping (a finalizer
        # removed while it is deleted included); a spec change is checked, deleting or not.
        return
    name = meta.get("name")
    if name and (bad_name := model_name_problem(str(name))) is not None:
        raise AdmissionDenied(bad_name, INVALID)  # (the CRD's CEL rule says it too, where the webhook is off)
    namespace = meta.get("namespace")
    if namespace is not None and not (isinstance(namespace, str) and _NAMESPACE.fullmatch(namespace)):
        raise AdmissionDenied(f"metadata.namespace: {str(namespace)[:80]!r} must be a DNS-1123 label "
                              "(at most 63 lowercase letters, digits and '-')", INVALID)  # fmt: skip
    if (size := len(json.dumps(body.get("spec"), default=str))) > MAX_SPEC_BYTES:
        raise AdmissionDenied(f"spec: {size:,} bytes of JSON; at most {MAX_SPEC_BYTES:,}, so that an update's review, which "
                              "carries the model twice, fits the webhook's 1 MiB (its finalizer could not be removed)", INVALID)  # fmt: skip
    spec = parse_spec(body.get("spec"))
    before = _admitted_spec(old) if operation == "UPDATE" else None
    if before is not None and (problem := resplit_problem(before, spec)):
        raise AdmissionDenied(problem, INVALID)
    check_plannable(spec, name=str(name or "model"), namespace=str(meta.get("namespace") or ""), before=before)
    verdict = evaluate(spec, str(meta.get("namespace") or ""), policies)
    if not verdict.compliant:
        raise AdmissionDenied(describe_violations(verdict.violations), FORBIDDEN)


_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _admitted_spec(old: Mapping[str, Any] | None) -> InferenceModelSpec | None:
    """The spec the update replaces, where it still parses (one admitted before a field was
    tightened may not: then there is nothing to compare against)."""
    try:
        return InferenceModelSpec.model_validate(_object_at(old, "spec"))
    except ValidationError:
        return None


def parse_spec(raw: Any) -> InferenceModelSpec:
    try:
        return InferenceModelSpec.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        raise AdmissionDenied(field_errors(exc), INVALID) from None


def check_plannable(spec: InferenceModelSpec, *, name: str, namespace: str, before: InferenceModelSpec | None = None) -> None:
    """The planner's and the renderer's field-level errors (a blocked plan is not one: reconcile
    reports it as KVPoolSufficient=False), decided in one place for admission and `kvguard plan`
    (`spec_checks.check_spec_fields`). The plan itself is skipped when the architecture is in a
    ConfigMap admission cannot read (reconcile plans it); every check that needs no architecture
    runs whatever the plan -- the renderer's and the prefill/decode parity check on the flag-check
    plan where there is no passing one, and without a source on a stand-in one (outside probe: they
    ran only for a sourced, passing, inline spec)."""
    try:
        check_spec_fields(spec, name=name, namespace=namespace, before=before)
    except SpecInvalid as exc:
        raise AdmissionDenied(str(exc), INVALID) from None


def check_policy_admission(body: Mapping[str, Any], old: Mapping[str, Any] | None, operation: str | None) -> None:
    """Raise AdmissionDenied when the InferencePolicy `body` must not be admitted: its spec does
    not parse, or a rule cannot be read. Metadata-only updates and deletions are admitted, as for
    models: a policy written before this check never gets stuck."""
    if operation not in ("CREATE", "UPDATE"):
        return
    if operation == "UPDATE" and not spec_changed(old, body):
        return
    try:
        spec = InferencePolicySpec.model_validate(body.get("spec") if body.get("spec") is not None else {})
    except ValidationError as exc:
        raise AdmissionDenied(field_errors(exc), INVALID) from None
    if problems := rule_problems(spec):
        raise AdmissionDenied("; ".join(problems), INVALID)


def parse_policies(raw: Iterable[Mapping[str, Any]]) -> list[InferencePolicy]:
    """InferencePolicy objects as stored; one the models reject (schema skew) is logged and skipped."""
    policies = []
    for obj in raw:
        try:
            policies.append(InferencePolicy.model_validate({k: v for k, v in obj.items() if k != "status"}))
        except ValidationError as exc:
            name = (obj.get("metadata") or {}).get("name")
            log.warning("InferencePolicy %s is unreadable and not enforced: %s", name, exc)
    return policies


# --- kopf glue -----------------------------------------------------------------------------------

_KUBE: list[Kube] = []


async def current_policies() -> list[InferencePolicy]:
    if not _KUBE:
        _KUBE.append(Kube(user_agent="kvguard-operator/webhook"))  # the operator's identity in audit logs (and tests/rbac.py)
    return parse_policies(await _KUBE[0].alist("InferencePolicy", None))


async def validate_inference_model(body: kopf.Body, old: kopf.Body | None = None, operation: str | None = None, **_: Any) -> None:
    """kopf admission handler: raising kopf.AdmissionError denies the request with its message."""
    try:
        policies = await current_policies()
    except KubeError as exc:
        raise kopf.AdmissionError(f"cannot read InferencePolicies to check this model ({exc}); retry", code=503) from exc
    try:
        check_admission(body, old, operation, policies)
    except AdmissionDenied as exc:
        raise kopf.AdmissionError(str(exc), code=exc.code) from None


async def validate_inference_policy(body: kopf.Body, old: kopf.Body | None = None, operation: str | None = None, **_: Any) -> None:
    """kopf admission handler for InferencePolicies (no API reads: the policy alone is judged)."""
    try:
        check_policy_admission(body, old, operation)
    except AdmissionDenied as exc:
        raise kopf.AdmissionError(str(exc), code=exc.code) from None


def inference_policies(body: kopf.Body, **_: Any) -> dict[None, InferencePolicy]:
    """All InferencePolicies, under the single key None (`policies_from_index`)."""
    parsed = parse_policies([body])  # one object: at most one policy (kopf groups values by key)
    return {None: parsed[0]} if parsed else {}


def policies_from_index(index: Mapping[Any, Iterable[InferencePolicy]]) -> list[InferencePolicy]:
    """The policies of the `inference_policies` index a kopf handler receives as a kwarg."""
    return sorted((p for key in index for p in index[key]), key=lambda p: p.metadata.name)


async def webhook_off(fn: Any) -> AsyncIterator[Any]:
    """A 'server' that never listens: kopf refuses to start with admission handlers and no server."""
    await asyncio.Event().wait()
    yield {}  # pragma: no cover  (unreachable; makes this an async generator)


MAX_SPEC_BYTES = 400 * 1024
"""The largest spec admitted: an UPDATE's review carries the object twice and kopf's server reads
at most 1 MiB, so a model of 256 arguments of 4 KiB each was admitted and then every update of it
got a 413 -- with failurePolicy Fail, its finalizer could never be removed (a review)."""
REVIEW_BODY_TIMEOUT_S = 10.0
"""The API server's own default timeout for a webhook call: a body slower than that is no review."""
MAX_ID_CHARS = 253  # a uid (36 in practice), a name, a namespace: no longer than a DNS subdomain
REVIEWED_OPERATIONS = ("CREATE", "UPDATE")  # the only ones the webhooks are registered for
CLIENT_CA_FILE = "client-ca.crt"  # beside tls.crt: only clients with a certificate it signed are heard


def review_problem(data: object) -> str | None:
    """Why `data` is not an AdmissionReview an API server sends for these webhooks; None if it is.
    Checked before kopf reads it: kopf keeps a memo under the object's uid of every review that is
    not a CREATE, for good, and any client that reaches the port can post reviews (the API server
    does not authenticate to it unless told to: docs/webhook.md). 300 DELETE reviews with 1 MiB
    uids took the operator from 79 to 397 MB, and reviews of other shapes were 500s with a
    traceback logged (outside probe)."""
    request = data.get("request") if isinstance(data, dict) else None
    if not isinstance(request, dict):
        return "not an AdmissionReview: no request object"
    if request.get("operation") not in REVIEWED_OPERATIONS:
        return f"request.operation: only {' and '.join(REVIEWED_OPERATIONS)} are reviewed here"
    for key in ("object", "oldObject") if request["operation"] == "UPDATE" else ("object",):
        if not isinstance(request.get(key), dict):
            return f"request.{key}: not an object"
        if not isinstance(request[key].get("metadata", {}), dict):
            return f"request.{key}.metadata: not an object"
    resource = request.get("resource")
    if not isinstance(resource, dict) or not all(isinstance(resource.get(k), str) for k in ("group", "version", "resource")):
        return "request.resource: not a group, version and resource"
    if not isinstance(request.get("userInfo"), dict):
        return "request.userInfo: not an object"
    ids = {"request.uid": request.get("uid"), "request.name": request.get("name"), "request.namespace": request.get("namespace")}
    for key in ("object", "oldObject"):
        metadata = request.get(key, {}).get("metadata") if isinstance(request.get(key), dict) else None
        if isinstance(metadata, dict):
            ids.update({f"request.{key}.metadata.{k}": metadata.get(k) for k in ("uid", "name", "namespace")})
    for where, value in ids.items():
        if value is not None and (not isinstance(value, str) or len(value) > MAX_ID_CHARS):
            return f"{where}: not a string of at most {MAX_ID_CHARS} characters"
    if not isinstance(request.get("uid"), str):
        return "request.uid: missing"
    return None


class GuardedWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server, with each request's body read within REVIEW_BODY_TIMEOUT_S (a
    client holding a half-sent body was kept for good: 400 of them took the operator 0.7 GB up)
    and checked by `review_problem` before kopf sees it: 400, not 500, for anything else."""

    def _build_ssl(self) -> tuple[bytes | None, ssl.SSLContext | None]:
        """Whether clients must present a certificate is decided each time the context is built
        (start, and every change of the serving certificate), from client-ca.crt as it is then:
        decided once, a file removed later made the next build fail."""
        client_ca = Path(self.certfile).parent / CLIENT_CA_FILE if self.certfile is not None else None
        present = client_ca is not None and client_ca.is_file()
        self.verify_mode = ssl.CERT_REQUIRED if present else None
        self.verify_cafile = client_ca if present else None
        return super()._build_ssl()

    @staticmethod
    async def _serve(fn: Any, request: aiohttp.web.Request) -> aiohttp.web.Response:
        try:
            async with asyncio.timeout(REVIEW_BODY_TIMEOUT_S):
                body = await request.read()  # kopf's own read below finds it cached
        except TimeoutError:
            raise aiohttp.web.HTTPRequestTimeout(reason=f"the body did not arrive within {REVIEW_BODY_TIMEOUT_S:g} s") from None
        try:
            problem = review_problem(json.loads(body.decode()))
        except (ValueError, RecursionError):  # not UTF-8 or JSON, a number Python will not hold, nesting it cannot
            problem = "not JSON a review can be"
        if problem is not None:
            raise aiohttp.web.HTTPBadRequest(reason=problem)
        # kopf reads the cached body and parses it once more (at most 1 MiB, per admission): its own
        # error mapping and handler call stay kopf's, not a copy of them here.
        return await kopf.WebhookServer._serve(fn, request)


def webhook_server(env: Mapping[str, str]) -> Any:
    """kopf's HTTPS server for the certificate in KVGUARD_WEBHOOK_CERT_DIR, or `webhook_off`."""
    cert_dir = env.get("KVGUARD_WEBHOOK_CERT_DIR")
    if not cert_dir:
        return webhook_off
    folder = Path(cert_dir)
    if not (folder / "tls.crt").is_file() or not (folder / "tls.key").is_file():
        # The Secret volume is optional (reconcile must run without it): stay off, loudly.
        log.error("admission webhook off: no tls.crt/tls.key in %s (create Secret kvguard-webhook-tls, "
                  "then restart the operator; docs/webhook.md)", folder)
        return webhook_off
    ca = folder / "ca.crt"
    # client-ca.crt: the CA of the certificate the API server presents to webhooks (its
    # AdmissionConfiguration's kubeConfigFile): then only the API server is heard.
    client_ca = folder / CLIENT_CA_FILE
    return GuardedWebhookServer(
        addr=env.get("KVGUARD_WEBHOOK_ADDR", "0.0.0.0"),
        port=int(env.get("KVGUARD_WEBHOOK_PORT", str(DEFAULT_PORT))),
        host=env.get("KVGUARD_WEBHOOK_HOST") or None,
        certfile=folder / "tls.crt",
        pkeyfile=folder / "tls.key",
        cafile=ca if ca.is_file() else None,
        verify_mode=ssl.CERT_REQUIRED if client_ca.is_file() else None,
        verify_cafile=client_ca if client_ca.is_file() else None,
    )


def configure_webhook(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.admission.server = webhook_server(os.environ)
    settings.admission.managed = os.environ.get("KVGUARD_WEBHOOK_MANAGED") or None
    if settings.admission.server is webhook_off:
        log.info("admission webhook off (KVGUARD_WEBHOOK_CERT_DIR unset); policy is enforced by reconcile only")


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the webhook, its settings and the policy index (done on import for kopf's default
    registry; tests use their own so that their login handlers stay apart)."""
    kopf.on.validate(*MODELS, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"], registry=registry)(validate_inference_model)
    kopf.on.validate(*POLICIES, id=POLICY_WEBHOOK_ID, operations=["CREATE", "UPDATE"], registry=registry)(validate_inference_policy)
    kopf.index(*POLICIES, registry=registry)(inference_policies)
    kopf.on.startup(registry=registry)(configure_webhook)


register(kopf.get_default_registry())
