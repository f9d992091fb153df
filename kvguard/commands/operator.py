"""`kvguard operator`: run the kopf operator (same as `kopf run -m kvguard.operator.handlers`).

HA: run several replicas. Every replica watches, keeps its caches warm and serves the admission
webhook; the one holding the coordination Lease (KVGUARD_LEASE_NAME in KVGUARD_LEASE_NAMESPACE /
POD_NAMESPACE) drives rollouts, and another takes over when it stops renewing (leader.py). kopf's
own peering is not used (it runs `--standalone`).

Scope: every namespace (the cluster-wide install, manifests/), or only those named by
`--namespace` (repeatable) or WATCH_NAMESPACES (comma-separated; the namespaced install,
manifests/namespaced/, whose RBAC covers exactly those namespaces).

Before kopf starts, the command checks that a Kubernetes API server answers with the credentials
kopf will use (the pod's service account, else $KUBECONFIG or ~/.kube/config). Without one it
prints one line saying what is missing and exits 1 within seconds, instead of kopf's tracebacks.
Given namespaces, kopf runs in its restricted mode (no namespace or CRD scans, which the
namespaced install may not do, and so it finds its resources only when it starts): the check then
also asks that the API already serves InferenceModels, else the pod exits and is restarted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

WATCH_NAMESPACES_ENV = "WATCH_NAMESPACES"
EXIT_NO_CLUSTER = 1
PREFLIGHT_TIMEOUT_SECONDS = 5


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "operator", help="run the InferenceModel operator (kopf); exit 1 at once when no cluster answers",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help=f"watch only these namespaces (default: ${WATCH_NAMESPACES_ENV}, else all)")  # fmt: skip
    parser.add_argument("--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("--verbose", action="store_true")
    parser.set_defaults(func=run)


def watched_namespaces(flags: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """--namespace values, else WATCH_NAMESPACES; empty means every namespace."""
    names = list(flags) or [n.strip() for n in environ.get(WATCH_NAMESPACES_ENV, "").split(",")]
    return [n for n in names if n]


def kopf_argv(namespaces: Sequence[str], liveness: str | None = None, verbose: bool = False) -> list[str]:
    argv = ["run", "-m", "kvguard.operator.handlers", "--standalone"]  # leader election is the Lease
    argv += [f"--namespace={ns}" for ns in namespaces] or ["--all-namespaces"]
    if liveness:
        argv.append(f"--liveness={liveness}")
    if verbose:
        argv.append("--verbose")
    return argv


def run(args: argparse.Namespace) -> int:
    namespaces = watched_namespaces(args.namespace, os.environ)
    problem = cluster_problem(needs_crds=bool(namespaces))
    if problem is not None:
        print(f"kvguard operator: {problem}", file=sys.stderr)
        return EXIT_NO_CLUSTER
    import kopf.cli  # heavy: only when the command runs

    if namespaces:  # --namespace too: the handlers read it to run in kopf's restricted mode
        os.environ[WATCH_NAMESPACES_ENV] = ",".join(namespaces)
    argv = kopf_argv(namespaces, args.liveness, args.verbose)
    try:
        kopf.cli.main(argv, standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def cluster_problem(timeout: float = PREFLIGHT_TIMEOUT_SECONDS, needs_crds: bool = False) -> str | None:
    """Why no Kubernetes API server can be used, in one line; None when /version answers.

    Loads credentials the way kopf's `kubernetes`-client login does (in-cluster first, then the
    kubeconfig), then asks the server for its version once, without retries. `needs_crds` (the
    namespaced install: kopf's restricted mode looks for resources only when it starts): the API
    must already serve InferenceModels, else the pod exits and is restarted until it does."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            config.load_kube_config(client_configuration=configuration)
        except Exception as exc:  # noqa: BLE001 - a bad kubeconfig raises YAML, key and type errors too: one line for all
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return (f"no Kubernetes cluster to run against: not in a pod, and no usable kubeconfig "
                    f"({reason}); set KUBECONFIG or write ~/.kube/config")  # fmt: skip
    configuration.retries = 0
    try:
        with client.ApiClient(configuration) as api:
            client.VersionApi(api).get_code(_request_timeout=timeout)
            if needs_crds and not _serves_inference_models(api, timeout):
                return (f"the Kubernetes API server at {configuration.host} serves no InferenceModels yet (kvguard.io/v1alpha1): "
                        "install the CRDs first (kubectl apply -k manifests/namespaced/ does); an operator given namespaces "
                        "looks for its resources only when it starts")  # fmt: skip
    except client.ApiException as exc:
        return f"the Kubernetes API server at {configuration.host} refused the credentials: HTTP {exc.status} {exc.reason}"
    except Exception as exc:  # urllib3's connection errors: refused, DNS, TLS, timeout
        # MaxRetryError wraps the cause; its text ends in the part a person needs ("[Errno 111]
        # Connection refused", "Read timed out.", "certificate verify failed: ...").
        cause = str(getattr(exc, "reason", None) or exc).splitlines()[0]
        reason = cause.split("): ")[-1].split("new connection: ")[-1][:200] or type(exc).__name__
        return f"cannot reach the Kubernetes API server at {configuration.host}: {reason}"
    return None


def _serves_inference_models(api: Any, timeout: float) -> bool:
    """Whether API discovery (open to every authenticated client) lists the InferenceModel
    resource in kvguard.io/v1alpha1."""
    import json

    from kubernetes import client

    method, url, headers, body, _ = api.param_serialize(method="GET", resource_path="/apis/kvguard.io/v1alpha1",
                                                        header_params={"Accept": "application/json"}, auth_settings=["BearerToken"])  # fmt: skip
    response = api.call_api(method, url, headers, body, _request_timeout=timeout)  # raises only with no HTTP answer
    response.read()
    if int(response.status) == 404:
        return False
    if int(response.status) >= 400:  # told as the caller tells any other refusal
        raise client.ApiException(status=int(response.status), reason=response.reason)
    return any(r.get("name") == "inferencemodels" for r in json.loads(response.data or b"{}").get("resources") or [])
