"""kmock dressed as the kvguard API server for the tests that run kopf against it (see
../shared/reference/kmock-notes.md): our custom resources declared, a client pointed at it."""

from __future__ import annotations

from typing import Any

import kmock as km
import kubernetes

VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


def declare_kvguard_resources(kmock: Any, *, policies: bool = False) -> str:
    """Built-in kinds plus InferenceModel (and InferencePolicy); returns the emulator's URL."""
    kmock.resources.load_bundled()
    kmock.resources["kvguard.io/v1alpha1/inferencemodels"] = km.ResourceInfo(
        kind="InferenceModel", namespaced=True, subresources={"status"}, verbs=VERBS
    )
    if policies:
        kmock.resources["kvguard.io/v1alpha1/inferencepolicies"] = km.ResourceInfo(
            kind="InferencePolicy", namespaced=False, subresources={"status"}, verbs=VERBS
        )
    return str(kmock.url).rstrip("/")


def client_configuration(url: str, *, make_default: bool = False) -> kubernetes.client.Configuration:
    """A `kubernetes` client configuration for the emulator; optionally the process-wide default."""
    cfg = kubernetes.client.Configuration()
    cfg.host = url
    if make_default:
        kubernetes.client.Configuration.set_default(cfg)
        kubernetes.client.ApiClient.set_default(kubernetes.client.ApiClient(cfg))
    return cfg
