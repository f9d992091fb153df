"""When the local backend restarts a worker that died: the kubelet's CrashLoopBackOff, for processes.

A pod's container that keeps exiting is restarted after 10 s, 20 s, 40 s, ... at most 5 minutes
apart, and the delay resets once it has run for 10 minutes. The local backend follows that rule
with one difference: the first death in a streak is restarted at once. A developer watching
`kvguard apply --local` wants a worker killed by accident (or by the OOM killer, once) back
immediately; only a worker that keeps dying -- a bad flag, a model it cannot load, a port taken --
waits, so it cannot spin a core reloading torch forever or bury its own log.

Pure: the caller owns the clock and the worker's record (`LocalWorker`), and persists both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartBackoff:
    initial_s: float = 10.0
    """The delay before the second restart of a streak; it doubles with each restart after."""
    cap_s: float = 300.0
    reset_after_s: float = 600.0
    """A worker that ran this long before it died starts a new streak."""

    def streak(self, previous: int, ran_for_s: float | None) -> int:
        """The deaths in a row, counting this one: a worker that died within `reset_after_s` of
        its start continues its streak; one that ran longer starts a new one, as does one whose
        start is unknown (`ran_for_s=None`: it was adopted, recorded by an older version, or its
        command line changed since, which on a cluster would be a new pod)."""
        if ran_for_s is None or ran_for_s >= self.reset_after_s:
            return 1
        return previous + 1

    def delay_s(self, streak: int) -> float:
        """How long to wait before restarting after the `streak`-th death in a row."""
        if streak <= 1:
            return 0.0
        return min(self.initial_s * 2.0 ** (streak - 2), self.cap_s)


KUBELET = RestartBackoff()
