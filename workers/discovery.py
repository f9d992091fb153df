"""Which workers the router's `--prefill` / `--decode` URLs name (`--discovery`).

`static` (the default, and the local backend's): each URL is one worker process.

`dns` (what the operator renders): each URL's host is a headless Service's name, and every address
it resolves to is one worker pod, addressed by its own IP. A request's calls must all reach the pod
that holds its KV: prefill's computing call and its ticket, decode's call and the token channel it
names. Through a Service's virtual IP each connection may land on another pod, so with two replicas
about half the tickets and channel names went to a pod that had never heard of the request. A
headless Service lists only ready pods, so a pod whose KV-pool readiness gate has not passed (S7),
or one that is draining, is not sent new requests; the router reads the names again on every
refresh of the workers' limits.

Pure helpers (the names, the membership change) apart from the router's I/O.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

Discovery = Literal["static", "dns"]
RESOLVE_TIMEOUT_S = 5.0
"""A lookup that takes longer is a resolver failure (NoAnswer): with the cluster's DNS down, glibc
waits and retries per search domain, tens of seconds per name."""


class NoAnswer(Exception):
    """The resolver could not answer now (a timeout, a failing DNS server): the set of workers is
    unknown, which is not the same as empty."""


def address_url(url: str, address: str) -> str:
    """`url` with its host replaced by one resolved address (IPv6 in brackets), port and path kept."""
    parts = urllib.parse.urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


_Lookup = concurrent.futures.Future[list[Any]]
_lookups: dict[tuple[str | None, int], _Lookup] = {}
_lookups_lock = threading.Lock()


def _lookup(host: str | None, port: int) -> _Lookup:
    """getaddrinfo on a daemon thread of its own, one at a time per name. A resolver that hangs
    (the cluster's DNS down) then holds neither the event loop, nor more than one thread per name,
    nor the process's exit: the loop's default executor is joined when the process ends, so a
    lookup stuck there kept a router that was told to stop alive until the resolver gave up."""
    key = (host, port)
    with _lookups_lock:
        if (pending := _lookups.get(key)) is not None:
            return pending
        lookup: _Lookup = concurrent.futures.Future()
        lookup.set_running_or_notify_cancel()  # a caller that gives up cannot cancel it for the others
        _lookups[key] = lookup

    def done() -> None:
        with _lookups_lock:
            del _lookups[key]

    def run() -> None:
        try:
            lookup.set_result(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except BaseException as exc:  # handed to every waiting caller, who decides
            lookup.set_exception(exc)
        finally:
            done()

    try:
        threading.Thread(target=run, name=f"kvguard-resolve-{host}", daemon=True).start()
    except RuntimeError as exc:  # no thread to be had (a pids limit): this lookup fails, the next may not
        done()
        lookup.set_exception(exc)
    return lookup


async def resolve(url: str) -> list[str]:
    """One URL per address `url`'s host resolves to, sorted; [] when the name has no addresses
    (a headless Service with no ready pod); NoAnswer when the resolver failed."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await asyncio.wrap_future(_lookup(parts.hostname, port))
    except TimeoutError:
        raise NoAnswer(f"{parts.hostname}: no answer within {RESOLVE_TIMEOUT_S:g} s") from None
    except RuntimeError as exc:  # the lookup's thread could not start
        raise NoAnswer(f"{parts.hostname}: {exc}") from None
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise NoAnswer(f"{parts.hostname}: {exc}") from exc
    return sorted({address_url(url, str(info[4][0])) for info in infos})


@dataclass(frozen=True)
class Membership:
    """How the workers of one role changed between two reads of their names."""

    added: tuple[str, ...]
    removed: tuple[str, ...]


def membership_change(current: Iterable[str], resolved: Iterable[str]) -> Membership:
    """What to add and remove to go from `current` to `resolved`. An empty `resolved` removes
    nothing: with no worker left to name, the last ones known stay, judged by their own reads
    (one that is gone is unreachable, out of rotation), so the router keeps limits to check
    intake against and says "not serving" rather than failing."""
    now, then = set(resolved), set(current)
    if not now:
        return Membership((), ())
    return Membership(tuple(sorted(now - then)), tuple(sorted(then - now)))
