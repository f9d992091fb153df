"""`kvguard model tiny DIR [--seed N]`: write a small random model in Hugging Face folder format."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="create model folders (tiny random model for tests and the demo)")
    actions = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    tiny = actions.add_parser("tiny", help="write a deterministic random LlamaForCausalLM (config, safetensors, tokenizer)")
    tiny.add_argument("dir", help="output folder (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0); same seed, same files")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvguard.workers.tiny import write_tiny_model

    path = write_tiny_model(args.dir, seed=args.seed)
    print(json.dumps({"model_dir": str(path), "seed": args.seed}))
    return 0
