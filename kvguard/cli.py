"""The `kvguard` command line.

Each subcommand lives in `kvguard.commands.<name>` and exposes `add_parser(subparsers)`, which
registers its flags and sets `func`. Command modules import heavy dependencies (torch, kopf) only
inside the function that runs the command, so `kvguard plan` works in the operator image without
torch and `--help` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

# Module names under kvguard.commands, in the order `--help` lists them. A module that is not
# present yet is skipped, so the command list grows as the parts land.
COMMANDS: tuple[str, ...] = (
    "plan",
    "model",
    "serve",
    "worker",
    "splitter",
    "canary",
    "crds",
    "render",
    "operator",
    "apply",
    "status",
    "demo",
)


def version() -> str:
    """The installed package's version (its metadata), or the source tree's when not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("kvguard")
    except PackageNotFoundError:
        from kvguard import __version__

        return __version__


class _Parser(argparse.ArgumentParser):
    """kvguard's parser: an argument no command knows is refused by that command's parser, with
    its usage (`kvguard serve: error: unrecognized arguments: --kv-pool-tokns 4096`), as a bad
    value is; argparse's own top-level refusal named neither (a new user's report). Commands of
    commands (`kvguard model tiny`) are followed down to the innermost one named."""

    command_parsers: Mapping[str, argparse.ArgumentParser] = {}

    def add_subparsers(self, **kwargs: Any) -> Any:
        action = super().add_subparsers(**kwargs)
        self.command_parsers = action.choices
        return action

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self._named_by(sys.argv[1:] if args is None else args).error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed

    def _named_by(self, words: Sequence[str]) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self
        for word in words:
            parser = getattr(parser, "command_parsers", {}).get(word, parser)
        return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvguard", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvguard {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"kvguard.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"kvguard.commands.{name}":
                continue
            raise
        module.add_parser(subparsers)
    return parser


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped

EXIT_MISSING_EXTRA = 2  # as for bad input: nothing was started
WORKER_COMMANDS = frozenset({"model", "serve", "worker", "splitter", "apply", "demo"})
"""Commands that run the engine (the `workers` extra); the others need the `operator` extra."""
EXTRA_PACKAGES = frozenset({"kopf", "kubernetes", "urllib3", "prometheus_client", "requests", "aiohttp", "torch",
                            "safetensors", "numpy", "tokenizers", "xxhash", "cryptography"})  # fmt: skip
"""Top-level modules of pyproject.toml's optional dependencies: a command that needs one that is
not installed says which extra to install instead of printing a traceback."""


def _stop_signals_from_the_start(command: str, argv: Sequence[str]) -> contextlib.AbstractContextManager[None]:
    """For the commands that promise exit 130 on SIGTERM too (`canary`, `apply --local`, `demo`),
    and `serve`, which promises exit 0 on SIGINT, SIGTERM or SIGHUP during start-up too: the stop
    signals as one KeyboardInterrupt from here on, before the parser imports every command module
    and the command its dependencies (pydantic, aiohttp, torch). Installed only in the command, it
    left the first ~0.4 s to the default action: a SIGTERM then ended `kvguard canary` by the
    signal, -15, not 130, and `kvguard serve` with 143 (outside probes). The command's own
    handler nests inside (serve's replaces it before it starts any worker)."""
    if command in ("canary", "demo", "serve") or (command == "apply" and "--local" in argv):
        from kvguard.interrupts import stop_signals_as_one_interrupt

        hangup = (signal.SIGHUP,) if command == "serve" else ()  # serve's promise covers a closed terminal too
        return stop_signals_as_one_interrupt(signals=(signal.SIGINT, signal.SIGTERM, *hangup))
    return contextlib.nullcontext()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Ctrl-C that a command does not handle itself (e.g. while it still imports)
    ends it with one line and 130, not a traceback; so does SIGTERM for the commands that promise
    it; a closed stdout (`kvguard plan ... | head`) ends it quietly."""
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in words if a in COMMANDS), "")
    try:
        # A launcher starts its workers with SIGINT blocked (workers/launcher.py `_spawn`): one
        # sent while the interpreter initialised waited, and is raised here, inside the handler.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        with _stop_signals_from_the_start(command, words):
            args = build_parser().parse_args(argv)
            code = int(args.func(args) or 0)
            sys.stdout.flush()  # stdout on a full disk fails here, in the handlers below, not at exit
            return code
    except KeyboardInterrupt:
        if command == "serve":  # before its own handlers, so before any worker started
            print("kvguard serve: stopped during start-up", file=sys.stderr)
            return 0
        print(f"kvguard {command}: interrupted" if command else "kvguard: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        if package not in EXTRA_PACKAGES:
            raise  # a bug, not a missing extra
        extra = "workers" if command in WORKER_COMMANDS else "operator"
        who = f"kvguard {command}" if command else "kvguard"
        print(f"{who}: needs the Python package {package}, which is not installed: pip install 'kvguard[{extra}]'", file=sys.stderr)
        return EXIT_MISSING_EXTRA
    except BrokenPipeError:
        # The reader went away: nothing more can be said on stdout, and Python's flush at exit
        # would raise again (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        _drop_stdout()
        return 1
    except OSError as exc:
        # A file the command was told to write that cannot be (`crds -o` into a read-only folder,
        # `plan > /dev/full`): one line naming it, not a traceback.
        try:
            sys.stdout.flush()  # what was printed before the failure, unless stdout is what failed
        except OSError:
            _drop_stdout()
        where = f": {exc.filename}" if exc.filename else ""
        print(f"{f'kvguard {command}' if command else 'kvguard'}: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1


def _drop_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for it cannot be written, and the
    interpreter's flush at exit would raise again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # not a real file (a test's capture): nothing to point
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)


if __name__ == "__main__":
    sys.exit(main())
