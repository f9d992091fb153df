"""`Harness` on a real Kubernetes cluster (cluster-only code: nothing here runs without KUBECONFIG).

The operator installed in the cluster drives every rollout; this harness only does what a user
does: create or merge-patch the InferenceModel, create InferencePolicies, read the model's status,
list the Deployments and pods it owns, and query the model through `kubectl port-forward` to its
Service with the openai client. The restart scenario deletes the operator pods.

Needs (see e2e/test_local_rollouts.py for how to run it):
- KUBECONFIG, with rights to create namespaces, PVCs, Jobs, InferenceModels, InferencePolicies and
  to delete pods in the operator's namespace;
- the CRDs and the operator installed with the fault-injection component: `kubectl apply -k
  e2e/install` (manifests/ plus manifests/testing/fault-injection), and the webhook's certificate
  (docs/webhook.md). Only an operator started with KVGUARD_ALLOW_FAULT_INJECTION=true honours the
  `kvguard.io/faults` annotation (and then makes the faults part of the revision id);
- KVGUARD_E2E_WORKER_IMAGE: the worker image (docker/worker.Dockerfile), pullable by the cluster;
- a default StorageClass (the tiny models go on a 1Gi ReadWriteOnce PVC, so every worker pod must
  be able to mount it: a single-node cluster, or name a ReadWriteMany PVC in KVGUARD_E2E_MODEL_PVC);
- kubectl (.venv/bin/kubectl from scripts/install-kubectl.py, or on PATH).
Optional: KVGUARD_E2E_NAMESPACE (default kvguard-e2e, created if missing), KVGUARD_E2E_MODEL_PVC
(default kvguard-e2e-models, created if missing), KVGUARD_E2E_OPERATOR_NAMESPACE (kvguard-system).
The progressive-delivery scenarios (e2e/test_local_progressive.py, through progressive_cluster.py)
also need a Gateway: `kubectl apply -k e2e/install/gateway` after a Gateway API implementation
(docs/rollouts.md, "End-to-end scenarios on a cluster").
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from harness import NAME, Applied, Rejected, Result, Resumed, Serving, ask
from kubernetes import client, config
from kubernetes.client import ApiException
from waiting import wait_for as wait_on

from kvguard.operator.api import InferenceModelStatus, InferencePolicy
from kvguard.operator.controller import FAULT_INJECTION_ENV as ALLOW_FAULTS_ENV
from kvguard.operator.reconcile import FAULTS_ANNOTATION
from kvguard.operator.render import HTTP_PORT, LABEL_MODEL, LABEL_REVISION
from kvguard.operator.rollout import RolloutState

GROUP, VERSION, MODELS, POLICIES = "kvguard.io", "v1alpha1", "inferencemodels", "inferencepolicies"
OPERATOR_SELECTOR = "app.kubernetes.io/name=kvguard-operator"  # the operator Deployment's pods (manifests/operator.yaml)
MODELS_JOB = "e2e-tiny-models"
RESTING = (RolloutState.STABLE, RolloutState.BLOCKED, RolloutState.ROLLED_BACK)  # Failed goes on to RolledBack
CANARY = (RolloutState.CANARY_DEPLOYING, RolloutState.CANARY_VERIFYING)
REFUSED = (400, 403, 422)  # what the validating webhook (or the CRD schema) answers a refused change with
TIMEOUT, POLL = 600.0, 2.0
ACTED_TIMEOUT = 60.0
"""The operator records a step in the status before acting on it: how long to give it to act."""

T = TypeVar("T")


def unavailable() -> str | None:
    """Why the cluster variant cannot run here (the skip reason), or None."""
    if not os.environ.get("KUBECONFIG"):
        return "KUBECONFIG is unset: no cluster to run the rollout scenarios against"
    if not os.environ.get("KVGUARD_E2E_WORKER_IMAGE"):
        return "KVGUARD_E2E_WORKER_IMAGE is unset: the cluster needs the worker image to run the tiny model"
    if kubectl() is None:
        return "no kubectl (run scripts/install-kubectl.py .venv): the scenarios query the model through a port-forward"
    return None


def kubectl() -> str | None:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    return str(venv_kubectl) if venv_kubectl.exists() else shutil.which("kubectl")


class ClusterHarness:
    def __init__(self, *, image: str, namespace: str, pvc: str, operator_namespace: str) -> None:
        config.load_kube_config()
        self.core, self.apps, self.batch = client.CoreV1Api(), client.AppsV1Api(), client.BatchV1Api()
        self.custom = client.CustomObjectsApi()
        self.engine_image: str | None = image
        self.namespace, self.pvc, self.operator_namespace = namespace, pvc, operator_namespace
        self.log: list[str] = []
        self._policies: set[str] = set()
        self._sent_spec: dict[str, Any] | None = None
        """The spec last written, so a patch can drop the keys a new body no longer has."""

    @classmethod
    def from_env(cls) -> ClusterHarness:
        harness = cls(
            image=os.environ["KVGUARD_E2E_WORKER_IMAGE"],
            namespace=os.environ.get("KVGUARD_E2E_NAMESPACE", "kvguard-e2e"),
            pvc=os.environ.get("KVGUARD_E2E_MODEL_PVC", "kvguard-e2e-models"),
            operator_namespace=os.environ.get("KVGUARD_E2E_OPERATOR_NAMESPACE", "kvguard-system"),
        )
        harness.prepare()
        return harness

    # --- setup and teardown -------------------------------------------------------------------

    def prepare(self) -> None:
        """Namespace and PVC (created if missing), the tiny models on it, no model left from a
        previous run (the story starts with a first rollout)."""
        if _get(self.core.read_namespace, self.namespace) is None:
            self.core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})
        self._delete_model()
        if _get(self.core.read_namespaced_persistent_volume_claim, self.pvc, self.namespace) is None:
            self.core.create_namespaced_persistent_volume_claim(self.namespace, {
                "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": self.pvc},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
            })  # fmt: skip
        self._write_tiny_models()

    def _write_tiny_models(self) -> None:
        """`kvguard model tiny` with seeds 0 and 1 onto the PVC, in a Job running the worker image.
        Same seed, same files: rerunning it on every module run rewrites identical bytes."""
        if _get(self.batch.read_namespaced_job, MODELS_JOB, self.namespace) is not None:
            self.batch.delete_namespaced_job(MODELS_JOB, self.namespace, propagation_policy="Foreground")
            wait_for(lambda: _get(self.batch.read_namespaced_job, MODELS_JOB, self.namespace) is None, "the old models Job to go")
        assert self.engine_image is not None
        self.batch.create_namespaced_job(self.namespace, models_job(self.engine_image, self.pvc))

        def finished() -> Any:
            job = self.batch.read_namespaced_job(MODELS_JOB, self.namespace)
            return job if job.status and (job.status.succeeded or job.status.failed) else None

        job = wait_for(finished, f"Job {MODELS_JOB} to write the tiny models")
        assert job.status.succeeded, f"Job {MODELS_JOB} failed: kubectl logs -n {self.namespace} job/{MODELS_JOB}"

    def close(self) -> None:
        """Delete the model (first: a policy removed under it could let a blocked change roll out)
        and the policies this run created. The PVC and its models stay for the next run."""
        self._delete_model()
        self._set_policies(())

    def _delete_model(self) -> None:
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, MODELS, NAME)
        except ApiException as exc:
            if exc.status != 404:
                raise
        selector = f"{LABEL_MODEL}={NAME}"
        wait_for(lambda: _get(self.custom.get_namespaced_custom_object, GROUP, VERSION, self.namespace, MODELS, NAME) is None
                 and not self.apps.list_namespaced_deployment(self.namespace, label_selector=selector).items,
                 f"InferenceModel {NAME} and its Deployments to be deleted")  # fmt: skip
        self._sent_spec = None

    # --- Harness ------------------------------------------------------------------------------

    def model_source(self, seed: int) -> dict[str, Any]:
        return {"pvc": {"claimName": self.pvc, "path": f"tiny-{seed}"}, "revision": f"seed-{seed}"}

    def apply(self, body: dict[str, Any], *, faults: str = "", policies: tuple[InferencePolicy, ...] = ()) -> Applied:
        if faults:
            self._require_fault_injection()
        self._set_policies(policies)
        try:
            generation = self._write_model(body, faults)
        except ApiException as exc:
            if exc.status not in REFUSED:
                raise
            return Applied(rejection(exc))
        result = self._wait_resting(generation)
        return Applied(result, self._answers() if result.stable else {})

    def current(self) -> Serving:
        revision = self._status().revision
        if revision is None:
            return Serving(None, {}, {})
        self._wait_settled(revision)
        return Serving(revision, self._workloads(revision, detailed=True), self._answers())

    def serving(self) -> str | None:
        stable = self._status().revision
        eventually(lambda: self._service_selects() == stable)
        return self._service_selects()

    def revision_present(self, revision: str) -> bool:
        return bool(self._deployments(revision) or self._pods(revision))

    def revision_stopped(self, revision: str) -> bool:
        return eventually(lambda: all(d.spec.replicas == 0 for d in self._deployments(revision)))

    def workload_ids(self, revision: str) -> dict[str, str]:
        return self._workloads(revision, detailed=False)

    def interrupt_mid_rollout(self, body: dict[str, Any]) -> Resumed:
        """Patch the model, delete the operator pods once the candidate is in its canary, and
        wait for the operator's replacement to finish the rollout from status.rollout."""
        self._set_policies(())
        generation = self._write_model(body, faults="")
        status = self._wait_status(lambda s: seen(s, generation) and s.rollout.state in CANARY + RESTING,
                                   "the candidate's canary to start", poll=0.5)  # fmt: skip
        assert status.rollout is not None and status.target_revision is not None
        assert status.rollout.state in CANARY, f"the rollout reached {status.rollout.state.value} before it could be interrupted"
        candidate, started = status.target_revision, self.workload_ids(status.target_revision)
        self._kill_operator()
        stable = self._status().revision
        return Resumed(candidate, stable, started, self._wait_resting(generation))

    # --- the InferenceModel and its policies ----------------------------------------------------

    def _write_model(self, body: dict[str, Any], faults: str) -> int:
        """Create or merge-patch the model (spec and faults annotation in one write, so the
        operator never sees one without the other); returns the new metadata.generation."""
        annotations = {**(body.get("metadata") or {}).get("annotations", {}), FAULTS_ANNOTATION: faults or None}
        if self._sent_spec is None:
            metadata = {"name": NAME, "namespace": self.namespace, "annotations": {k: v for k, v in annotations.items() if v}}
            manifest = {**body, "metadata": metadata}
            obj = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, MODELS, manifest)
        else:
            patch = {"metadata": {"annotations": annotations}, "spec": merge_patch(self._sent_spec, body["spec"])}
            obj = self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, MODELS, NAME, patch)
        self._sent_spec = copy.deepcopy(body["spec"])
        self.log.append(f"wrote generation {obj['metadata']['generation']}" + (f" with faults {faults}" if faults else ""))
        return int(obj["metadata"]["generation"])

    def _set_policies(self, policies: tuple[InferencePolicy, ...]) -> None:
        """Exactly `policies` (of those this harness creates) are in force until the next apply."""
        wanted = {p.metadata.name for p in policies}
        for name in self._policies - wanted:
            _delete(self.custom.delete_cluster_custom_object, GROUP, VERSION, POLICIES, name)
        for policy in policies:
            wire = policy.to_wire()
            try:
                self.custom.create_cluster_custom_object(GROUP, VERSION, POLICIES, wire)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.custom.patch_cluster_custom_object(GROUP, VERSION, POLICIES, policy.metadata.name, {"spec": wire["spec"]})
        self._policies = wanted

    def _status(self) -> InferenceModelStatus:
        raw = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, MODELS, NAME).get("status") or {}
        known = {f.alias or n for n, f in InferenceModelStatus.model_fields.items()}
        return InferenceModelStatus.model_validate({k: v for k, v in raw.items() if k in known})

    def _wait_status(self, done: Callable[[InferenceModelStatus], bool], what: str, poll: float = POLL) -> InferenceModelStatus:
        deadline = time.monotonic() + TIMEOUT
        while True:
            status = self._status()
            if status.rollout is not None:
                line = f"rollout of {status.rollout.revision}: {status.rollout.state.value}: {status.rollout.message}"
                if not self.log or self.log[-1] != line:
                    self.log.append(line)
            if done(status):
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {TIMEOUT:.0f} s waiting for {what}; last: {self.log[-3:]}")
            time.sleep(poll)

    def _wait_resting(self, generation: int) -> Result:
        status = self._wait_status(lambda s: seen(s, generation) and s.rollout.state in RESTING,
                                   f"generation {generation} to rest (Stable, Blocked or RolledBack)")  # fmt: skip
        result = Result.of_status(status)
        if result.stable is not None:  # promotion is recorded before traffic moves: let it move
            eventually(lambda: self._service_selects() == result.stable)
        return result

    def _require_fault_injection(self) -> None:
        """Without it the operator ignores kvguard.io/faults: the faulty build would be healthy."""
        deployments = self.apps.list_namespaced_deployment(self.operator_namespace, label_selector=OPERATOR_SELECTOR).items
        env = {e.name: e.value for d in deployments for c in d.spec.template.spec.containers for e in c.env or []}
        assert (env.get(ALLOW_FAULTS_ENV) or "").lower() in ("1", "true", "yes"), (
            f"the operator in {self.operator_namespace} runs without {ALLOW_FAULTS_ENV}=true: "
            "install it with manifests/testing/fault-injection (kubectl apply -k e2e/install)"
        )

    def _kill_operator(self) -> None:
        """Delete the operator pods at once (no grace period), like a node lost under them."""
        pods = self.core.list_namespaced_pod(self.operator_namespace, label_selector=OPERATOR_SELECTOR).items
        assert pods, f"no operator pods ({OPERATOR_SELECTOR}) in {self.operator_namespace}: set KVGUARD_E2E_OPERATOR_NAMESPACE"
        for pod in pods:
            _delete(self.core.delete_namespaced_pod, pod.metadata.name, self.operator_namespace, grace_period_seconds=0)
        self.log.append(f"deleted operator pods {', '.join(p.metadata.name for p in pods)}")

    # --- what runs ----------------------------------------------------------------------------

    def _selector(self, revision: str) -> str:
        return f"{LABEL_MODEL}={NAME},{LABEL_REVISION}={revision}"

    def _deployments(self, revision: str) -> list[Any]:
        return self.apps.list_namespaced_deployment(self.namespace, label_selector=self._selector(revision)).items

    def _pods(self, revision: str) -> list[Any]:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=self._selector(revision)).items
        return [p for p in pods if p.metadata.deletion_timestamp is None]

    def _service_selects(self) -> str | None:
        service = _get(self.core.read_namespaced_service, NAME, self.namespace)
        return (service.spec.selector or {}).get(LABEL_REVISION) if service is not None else None

    def _workloads(self, revision: str, *, detailed: bool) -> dict[str, str]:
        """Object -> uid; `detailed` adds what changes when a workload is touched in place (a
        Deployment's generation, a pod's container restarts)."""
        ids = {}
        for d in self._deployments(revision):
            ids[f"deployment/{d.metadata.name}"] = d.metadata.uid + (f" generation {d.metadata.generation}" if detailed else "")
        for p in self._pods(revision):
            restarts = sum(c.restart_count for c in (p.status.container_statuses if p.status else None) or [])
            ids[f"pod/{p.metadata.name}"] = p.metadata.uid + (f" restarts {restarts}" if detailed else "")
        return ids

    def _wait_settled(self, revision: str) -> None:
        """Every Deployment of the revision observed and ready, and exactly its pods running: a
        snapshot taken mid-scale would differ from the next one for no fault of the rollout."""

        def settled() -> bool:
            deployments = self._deployments(revision)
            ready = all(d.status is not None and (d.status.observed_generation or 0) >= (d.metadata.generation or 0)
                        and (d.status.ready_replicas or 0) == d.spec.replicas for d in deployments)  # fmt: skip
            return bool(deployments) and ready and len(self._pods(revision)) == sum(d.spec.replicas for d in deployments)

        wait_for(settled, f"revision {revision}'s workloads to settle")

    def _answers(self) -> dict[str, str]:
        # A new port-forward every time: it binds to one pod, and promotion changes the pods.
        with port_forward(self.namespace, f"svc/{NAME}", HTTP_PORT) as port:
            return ask(f"http://127.0.0.1:{port}/v1")


# --- helpers ------------------------------------------------------------------------------------


def seen(status: InferenceModelStatus, generation: int) -> bool:
    """The operator has reconciled `generation` and its rollout is about the resulting revision."""
    rollout = status.rollout
    return (status.observed_generation or 0) >= generation and rollout is not None and rollout.revision == status.target_revision


def merge_patch(sent: Any, desired: Any) -> Any:
    """A JSON merge patch (RFC 7386) from the spec last sent to `desired`: keys dropped since are
    nulled; keys never sent (the API server's defaults) are left alone."""
    if not isinstance(sent, dict) or not isinstance(desired, dict):
        return desired
    return {**{k: None for k in sent if k not in desired}, **{k: merge_patch(sent.get(k), v) for k, v in desired.items()}}


def rejection(exc: ApiException) -> Rejected:
    try:
        message = json.loads(exc.body)["message"]
    except (TypeError, ValueError, KeyError):
        message = str(exc.body or exc.reason)
    return Rejected(int(exc.status or 0), message)


def models_job(image: str, pvc: str) -> dict[str, Any]:
    script = " && ".join(f"python -P -m kvguard model tiny /models/tiny-{seed} --seed {seed}" for seed in (0, 1))
    container = {
        "name": "write", "image": image, "command": ["sh", "-c", script], "workingDir": "/tmp",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
    }  # fmt: skip
    # The image runs as 1000; fsGroup makes a fresh volume writable for it.
    security = {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
    pod = {
        "restartPolicy": "Never",
        "securityContext": security,
        "containers": [container],
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": pvc}}],
    }
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": MODELS_JOB},
            "spec": {"backoffLimit": 0, "template": {"spec": pod}}}  # fmt: skip


@contextmanager
def port_forward(namespace: str, target: str, port: int) -> Iterator[int]:
    """`kubectl port-forward` to a free local port, for as long as the block runs."""
    argv = [kubectl() or "kubectl", "port-forward", "-n", namespace, target, f":{port}", "--address", "127.0.0.1"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # "Forwarding from 127.0.0.1:40123 -> 8000"; EOF if kubectl gave up
        found = re.search(r"127\.0\.0\.1:(\d+)", line)
        if found is None:
            proc.kill()
            raise AssertionError(f"kubectl port-forward {target} failed: {line}{proc.stderr.read()}")
        yield int(found.group(1))
    finally:
        proc.terminate()
        proc.wait(10)


def wait_for(fetch: Callable[[], T], what: str, timeout: float = TIMEOUT) -> T:
    return wait_on(fetch, what, timeout, POLL)


def eventually(check: Callable[[], bool], timeout: float = ACTED_TIMEOUT) -> bool:
    """True once `check` holds, False if it still does not after `timeout`."""
    try:
        return wait_for(check, "", timeout)
    except AssertionError:
        return False


def _get(read: Callable[..., T], *args: Any) -> T | None:
    """The object, or None when the API server says 404."""
    try:
        return read(*args)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _delete(delete: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        delete(*args, **kwargs)
    except ApiException as exc:
        if exc.status != 404:
            raise
