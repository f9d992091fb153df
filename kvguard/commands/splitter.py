"""`kvguard splitter --table FILE --port P --metrics-port M`: the local backend's weighted splitter.

One port for the whole life of a state folder: `kvguard apply --local` starts it and prints its
URL, and writes the split table (FILE, split.json) that says which revision's router gets what
share of the requests. Promotions, traffic steps and rollbacks change the table, never the URL
(workers/splitter.py). Exit codes: 0 stopped by SIGTERM/SIGINT, 2 bad flags or a busy port.

A table FILE that does not exist yet, cannot be read or does not parse is not refused: the local
backend starts the splitter before it writes the first table. The splitter says so once, as a
warning when it starts, and answers every request 503 no_backend until a valid table is written
(it re-reads FILE on each request).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvguard.commands.serve import port_number


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("splitter", help="run the local backend's weighted traffic splitter (one stable URL)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--table", type=Path, required=True, metavar="FILE", help="the split table (split.json) to follow; it may not exist yet (a warning, then 503 until it is written)")
    parser.add_argument("--port", type=port_number, required=True, help="the OpenAI API port clients use (0: any free one)")
    parser.add_argument("--metrics-port", type=port_number, required=True, help="read-only /metrics and /health")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import socket

    from kvguard.workers.args import open_listener
    from kvguard.workers.servers import serve
    from kvguard.workers.splitter import Splitter, SplitterConfig, table_problem

    logging.basicConfig(level=logging.INFO, format="%(asctime)s splitter %(name)s %(levelname)s %(message)s")
    sockets: list[socket.socket] = []
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        try:
            # The local backend hands the socket down (it held the port since choosing it); else bound here,
            # with SO_REUSEADDR: a restart takes the same port back.
            sockets.append(open_listener(args.host, port))
        except OSError as exc:
            for sock in sockets:
                sock.close()
            print(f"kvguard splitter: {flag} {port}: cannot listen on {args.host}:{port}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if (problem := table_problem(args.table)) is not None:
        logging.getLogger("kvguard.splitter").warning(
            "split table %s %s: every request gets 503 no_backend until a valid table is written there", args.table, problem)
    splitter = Splitter(SplitterConfig(table_path=args.table))
    asyncio.run(serve([(splitter.app(), sockets[0]), (splitter.metrics_app(), sockets[1])], registry=splitter.registry))
    return 0
