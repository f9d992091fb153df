"""`kvguard crds`: print the CRD YAML generated from the pydantic models, or write it to a directory.

    kvguard crds                 # both CRDs on stdout, as one multi-document YAML stream
    kvguard crds -o crds/        # one file per CRD (what the repository ships)
    kvguard crds --check crds/   # exit 1 when the files differ from the models (2: no such folder)

Exit 2 when -o names something that is not a folder, or a folder that cannot be created.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("crds", help="print or write the InferenceModel/InferencePolicy CRDs")
    parser.add_argument("-o", "--output-dir", type=_folder, help="write one YAML file per CRD into this directory")
    parser.add_argument("--check", type=Path, metavar="DIR", help="exit 1 if DIR's files differ from the models")
    parser.set_defaults(func=run)


def _folder(text: str) -> Path:
    """An empty -o is refused: Path("") is the current folder, written into without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; name the folder to write")
    return Path(text)


def run(args: argparse.Namespace) -> int:
    from kvguard.operator.crdgen import all_files

    files = all_files()
    if args.check:
        if not args.check.is_dir():
            print(f"kvguard crds: --check {args.check}: no such folder", file=sys.stderr)
            return 2
        problems = [f"{args.check / name}: {why}; run `kvguard crds -o {args.check}`"
                    for name, text in files.items() if (why := _stale(args.check / name, text))]  # fmt: skip
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    if args.output_dir:
        if args.output_dir.exists() and not args.output_dir.is_dir():
            print(f"kvguard crds: -o {args.output_dir} is not a folder; nothing was written", file=sys.stderr)
            return 2
        try:
            args.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"kvguard crds: -o {args.output_dir}: cannot create the folder: {exc.strerror or exc}; nothing was written",
                  file=sys.stderr)  # fmt: skip
            return 2
        for name, text in files.items():
            (args.output_dir / name).write_text(text)
            print(args.output_dir / name)
        return 0
    sys.stdout.write("---\n".join(files.values()))
    return 0


def _stale(path: Path, text: str) -> str | None:
    """Why the file at `path` is not `text` (missing, out of date), or None."""
    if not path.is_file():
        return "missing"
    return "out of date" if path.read_text() != text else None
