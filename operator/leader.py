"""Lease-based leader election (coordination.k8s.io/v1 Lease), as client-go's leaderelection does.

Every operator replica watches and indexes (a hot standby); only the holder of the Lease drives
rollouts. The rules:
- The holder renews every `retry_period`; a renewal is a write conditional on the Lease's
  resourceVersion, so two replicas can never both succeed from the same observed Lease.
- A standby takes the Lease over only after it has seen the same holder and renew time, unchanged,
  for `duration` on its own clock (never by comparing clocks across machines).
- The holder stops driving when it sees another holder, or when `renew_deadline` (shorter than
  `duration`) passes without a successful renewal: it has stopped before anyone may take over.
- On a clean shutdown the holder releases the Lease, so a successor starts at once.

`decide` is the pure rule; `LeaderElector` runs it against the API server.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvguard.operator.kube import Kube, KubeError, ObjectRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseConfig:
    name: str = "kvguard-operator"
    namespace: str = "kvguard-system"
    duration: float = 15.0
    """Seconds a standby waits, after the Lease last changed, before taking it over."""
    renew_deadline: float = 10.0
    """Seconds the holder keeps driving without a successful renewal."""
    retry_period: float = 2.0
    """Seconds between attempts (renewals by the holder, looks by a standby), jittered."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.duration:
            raise ValueError("Lease timing must satisfy 0 < retry_period < renew_deadline < duration")


@dataclass(frozen=True)
class LeaseRecord:
    """The parts of a Lease that decide who leads."""

    holder: str
    renew_time: str
    transitions: int
    resource_version: str | None

    @classmethod
    def of(cls, lease: Mapping[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""), renew_time=str(spec.get("renewTime") or ""),
            transitions=int(spec.get("leaseTransitions") or 0), resource_version=(lease.get("metadata") or {}).get("resourceVersion"),
        )  # fmt: skip

    @property
    def signature(self) -> tuple[str, str]:
        """What changes when the holder renews or someone takes over."""
        return self.holder, self.renew_time


class Move(enum.Enum):
    CREATE = "create"
    """No Lease yet: create it holding it."""
    RENEW = "renew"
    """We hold it: renew."""
    ACQUIRE = "acquire"
    """Free, or its holder stopped renewing for a whole duration: take it over."""
    FOLLOW = "follow"
    """Someone else holds it and renews: stand by."""


def decide(record: LeaseRecord | None, me: str, unchanged_for: float, duration: float) -> Move:
    """The one rule. `unchanged_for`: seconds, on our clock, since we first saw this record."""
    if record is None:
        return Move.CREATE
    if record.holder == me:
        return Move.RENEW
    if not record.holder or unchanged_for >= duration:
        return Move.ACQUIRE
    return Move.FOLLOW


def micro_time(moment: dt.datetime) -> str:
    """metav1.MicroTime."""
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Keeps trying to hold the Lease; calls `on_started` / `on_stopped` as leadership changes."""

    def __init__(
        self,
        kube: Kube,
        identity: str,
        config: LeaseConfig,
        on_started: Callable[[], Awaitable[None]],
        on_stopped: Callable[[], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube, self.identity, self.config = kube, identity, config
        self._on_started, self._on_stopped, self._clock = on_started, on_stopped, clock
        self.leading = False
        self._seen: tuple[tuple[str, str], float] | None = None
        self._last_renewal = 0.0
        self._held: LeaseRecord | None = None
        """The Lease as our last write left it: the holder renews on it without reading first."""
        self._ref = ObjectRef("Lease", config.name, config.namespace)

    async def run(self) -> None:
        try:
            while True:
                await self.attempt()
                await asyncio.sleep(self.config.retry_period * random.uniform(0.8, 1.2))
        finally:
            if self.leading:
                await self._stop("operator stopping")

    async def attempt(self) -> None:
        """One look at the Lease, and the move it calls for."""
        # A renewal counts from when it was sent, not from when its answer came: the API server
        # may have recorded it long before (a slow answer, up to the client's timeout), and a
        # standby's clock starts at that record.
        sent = self._clock()
        try:
            held = await self._try()
        except KubeError as exc:
            log.warning("leader election: %s", exc)
            held = None  # unknown: keep leading until the renew deadline
        now = self._clock()
        if held:
            self._last_renewal = sent
            if not self.leading:
                self.leading = True
                log.info("leader election: %s now leads (Lease %s)", self.identity, self._ref)
                await self._on_started()
        elif self.leading and (held is False or now - self._last_renewal > self.config.renew_deadline):
            await self._stop("another replica holds the Lease" if held is False else "renew deadline passed")

    def holds_lease(self) -> bool:
        """Leading, with a renewal within renew_deadline on this clock. `leading` alone is not
        enough: a holder paused past the deadline still says True until its next attempt runs,
        and a standby may have taken over meanwhile."""
        return self.leading and self._clock() - self._last_renewal <= self.config.renew_deadline

    async def _stop(self, why: str) -> None:
        self.leading, self._held = False, None
        log.warning("leader election: %s stops leading: %s", self.identity, why)
        await self._on_stopped()

    async def _try(self) -> bool:
        """True: we hold the Lease now; False: someone else does."""
        if self.leading and self._held is not None:
            renewed = await self._write(self._held, Move.RENEW)  # no read first: the write is conditional
            if renewed:
                return True
        lease = await self.kube.aget(self._ref)
        record = LeaseRecord.of(lease) if lease is not None else None
        now = self._clock()
        if record is not None and (self._seen is None or self._seen[0] != record.signature):
            self._seen = (record.signature, now)
        unchanged_for = now - self._seen[1] if self._seen is not None else 0.0
        move = decide(record, self.identity, unchanged_for, self.config.duration)
        if move is Move.FOLLOW:
            self._held = None
            return False
        return await self._write(record, move)

    async def _write(self, record: LeaseRecord | None, move: Move) -> bool:
        """Create, renew or take over the Lease; False when another writer got there first."""
        stamp = micro_time(dt.datetime.now(dt.UTC))
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.config.duration), "renewTime": stamp}
        if move is Move.CREATE:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self._ref.name, "namespace": self._ref.namespace},
                    "spec": {**spec, "acquireTime": stamp, "leaseTransitions": 0}}  # fmt: skip
            created = await self.kube.acreate(body)  # None: 409, someone created it first
            self._held = LeaseRecord.of(created) if created is not None else None
            return created is not None
        assert record is not None
        if move is Move.ACQUIRE:
            spec.update(acquireTime=stamp, leaseTransitions=record.transitions + 1)
        patch = {"metadata": {"resourceVersion": record.resource_version}, "spec": spec}
        try:
            written = await self.kube.amerge_patch(self._ref, patch)
        except KubeError as exc:
            if exc.status == 409:
                self._held = None
                return False  # someone else wrote it since we read it
            raise
        self._held = LeaseRecord.of(written)
        return True

    async def release(self) -> None:
        """Give the Lease up (clean shutdown): a standby takes over without waiting it out."""
        if not self.leading:
            return
        self.leading = False
        try:
            lease = await self.kube.aget(self._ref)
            if lease is not None and LeaseRecord.of(lease).holder == self.identity:
                patch = {"metadata": {"resourceVersion": (lease.get("metadata") or {}).get("resourceVersion")},
                         "spec": {"holderIdentity": None, "renewTime": micro_time(dt.datetime.now(dt.UTC))}}  # fmt: skip
                await self.kube.amerge_patch(self._ref, patch)
        except KubeError as exc:
            log.warning("leader election: could not release the Lease: %s", exc)
        await self._on_stopped()
