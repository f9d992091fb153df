"""`kvguard model tiny DIR [--seed N] [--force]`: write a small random model in Hugging Face folder format."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2
EXIT_EXISTS = 2  # the folder holds other files of the same names: nothing was written


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="create model folders (tiny random model for tests and the demo)")
    actions = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    tiny = actions.add_parser("tiny", help="write a deterministic random LlamaForCausalLM (config, safetensors, tokenizer)")
    tiny.add_argument("dir", help="output folder (created if missing)")
    tiny.add_argument("--seed", type=_seed, default=0, help="weight seed, 0..2**63-1 (default 0); same seed, same files")
    tiny.add_argument("--force", action="store_true",
                      help="replace files of the same names that hold something else (another model, another seed)")
    parser.set_defaults(func=run)


def _seed(text: str) -> int:
    """A seed torch's generator takes (a 64-bit integer; larger ones were a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in 0..2**63-1, got {text[:40]}")
    return value


def run(args: argparse.Namespace) -> int:
    from kvguard.workers.tiny import tiny_model_files, write_files

    if not args.dir:  # Path("") is the working folder: never what an empty argument meant
        print("kvguard model: DIR is empty; name the folder to write", file=sys.stderr)
        return EXIT_BAD_INPUT
    folder = Path(args.dir)
    if folder.exists() and not folder.is_dir():
        print(f"kvguard model: {folder} is not a folder; nothing was written", file=sys.stderr)
        return EXIT_BAD_INPUT
    files = tiny_model_files(seed=args.seed)
    # Writing the same bytes again is harmless (same seed, same files); replacing a real model's
    # config.json or weights is not, unless asked for.
    differing = [name for name, content in files.items() if (folder / name).exists() and (folder / name).read_bytes() != content]
    if differing and not args.force:
        print(f"kvguard model: {folder} already holds {', '.join(differing)} with other content; "
              "nothing was written (--force replaces them)", file=sys.stderr)  # fmt: skip
        return EXIT_EXISTS
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # `/proc/x`, a parent that is a file, no permission: bad input, as a path that is a file
        print(f"kvguard model: cannot create the folder {folder}: {exc.strerror or exc}; nothing was written", file=sys.stderr)
        return EXIT_BAD_INPUT
    write_files(folder, files)
    print(json.dumps({"model_dir": str(folder), "seed": args.seed}))
    return 0
