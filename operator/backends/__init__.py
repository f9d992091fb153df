"""Backends that run revisions of an InferenceModel: Kubernetes (`kubernetes`) and local processes
(`local`). The interface and the shared driver helpers are in `base`."""

from kvguard.operator.backends.base import (
    Backend,
    CanaryRunner,
    ModelRef,
    Observation,
    RevisionEndpoints,
    RevisionRequest,
    WorkerEndpoint,
    execute,
    scrape_workers,
)

__all__ = [
    "Backend",
    "CanaryRunner",
    "ModelRef",
    "Observation",
    "RevisionEndpoints",
    "RevisionRequest",
    "WorkerEndpoint",
    "execute",
    "scrape_workers",
]
