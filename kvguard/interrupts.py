"""SIGTERM handled as Ctrl-C by the long-running local commands (`kvguard demo`, `kvguard apply`):
the same cleanup, one line and exit 130, not death by the signal."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while inside, so the Ctrl-C path runs either way."""

    def handler(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
