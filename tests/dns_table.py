"""Run a `kvguard worker` whose name lookups read a table: the cluster's DNS for a test.

    python -P tests/dns_table.py TABLE.json worker --role router --discovery dns ...

TABLE.json maps a host name to the addresses it resolves to now (re-read on every lookup, so a
test changes the answer as a headless Service's changes when pods come and go); an empty list is
a name with no addresses (NXDOMAIN), and a name the table does not hold is looked up for real.
A number under "__delay__" makes every lookup of the table's names take that many seconds (a
resolver that is down: glibc waits and retries).
Nothing else in the process is changed: a headless Service's DNS cannot be served on this machine
(no DNS server the resolver would ask), and the router's behaviour is what the tests check.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

_real_getaddrinfo = socket.getaddrinfo


def main() -> int:
    table = Path(sys.argv[1])

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        names: dict[str, list[str]] = json.loads(table.read_text())
        if host not in names:
            return _real_getaddrinfo(host, port, *args, **kwargs)
        time.sleep(float(names.get("__delay__", 0)))  # type: ignore[arg-type]
        if not names[host]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, int(port))) for address in names[host]]

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]
    from kvguard.cli import main as kvguard

    return kvguard(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
