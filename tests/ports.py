"""A loopback port held for a server the test starts by port number (kopf's webhook server).

Picking a free port and closing it before the server binds leaves a window in which any other
process on a shared machine may take it. Here the port stays bound (SO_REUSEADDR, never
listening) until the test ends: the kernel gives it to no other bind(0) or outgoing connection,
while a server that also sets SO_REUSEADDR (aiohttp does on POSIX, kopf's webhook server too) can
still bind and listen on it. Linux semantics; the tests using it run on Linux.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        yield int(held.getsockname()[1])
