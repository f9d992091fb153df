"""What `kvguard apply --local` and `kvguard demo` say while a rollout waits.

Workers import torch and load weights before they answer, the canary runs its probes, a resize
waits for its new router to take over: each a wait of seconds to minutes. A person watching must never face a
silent terminal, so every wait gets a line when it begins, a line with the time waited after
every `every` seconds in which nothing else was said, and a line saying how long it took once it
ends (if it took longer than `quiet_below`). Plain lines: they read the same on a terminal, in a
pipe and in a CI log. Pure apart from `say`; the clock is passed in (tests drive it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

Say = Callable[[str], None]


@dataclass
class WaitReporter:
    say: Say
    clock: Callable[[], float] = time.monotonic
    every: float = 5.0
    """Seconds of silence after which a wait in progress is mentioned again."""
    quiet_below: float = 1.0
    """A wait shorter than this ends without a line."""
    _what: str | None = field(default=None, init=False)
    _since: float = field(default=0.0, init=False)
    _last_line: float = field(default=0.0, init=False)

    def tell(self, line: str) -> None:
        """Say something else (an event, a canary probe): it counts as a sign of life."""
        self._last_line = self.clock()
        self.say(line)

    def heard(self) -> None:
        """Something else was printed without going through `tell`."""
        self._last_line = self.clock()

    def waiting(self, what: str | None, message: str = "") -> None:
        """The rollout now waits for `what` (a short name: a condition reason), described by
        `message`; None: it waits for nothing. Call it after every look at the rollout."""
        now = self.clock()
        if what == self._what:
            if what is not None and now - self._last_line >= self.every:
                self.tell(f"... {message} ({now - self._since:.0f} s)")
            return
        if self._what is not None and now - self._since >= self.quiet_below:
            self.tell(f"... {self._what}: waited {now - self._since:.1f} s")
        self._what, self._since = what, now
        if what is not None:
            self.tell(f"... {message}")

    @property
    def current(self) -> str | None:
        return self._what

    def waited(self) -> float:
        """Seconds the current wait has lasted (0 when none)."""
        return self.clock() - self._since if self._what is not None else 0.0
