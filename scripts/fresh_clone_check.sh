#!/bin/sh
# The README's quick start, for real, on what a clone holds: clone the committed HEAD into a
# temporary folder (no .venv, nothing untracked, no ../shared beside it), run `make demo` there,
# then `kvguard --version`. Takes minutes (the whole install, then the demo), so it is run by
# hand, not by `make test` (tests/test_fresh_clone.py checks the same from the tracked files,
# without installing). TORCH_SPEC / TORCH_INDEX are passed on to make as the README describes.
#
#   scripts/fresh_clone_check.sh            # exit status: make demo's
#   KEEP=1 scripts/fresh_clone_check.sh     # keep the clone (its .venv, the demo's output)
set -eu
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
commit=$(git -C "$repo" rev-parse HEAD)
work=$(mktemp -d "${TMPDIR:-/tmp}/kvguard-fresh-clone-XXXXXX")
cleanup() { if [ "${KEEP:-}" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi; }
trap cleanup EXIT
echo "fresh clone of $repo at $commit in $work"
git clone -q --no-local "$repo" "$work/kvguard"
git -C "$work/kvguard" checkout -q --detach "$commit"
cd "$work/kvguard"
if [ -n "$(git status --porcelain)" ]; then echo "the clone is not clean"; exit 1; fi
began=$(date +%s)
make demo
echo "make demo in a fresh clone: $(($(date +%s) - began)) s (install and demo)"
.venv/bin/kvguard --version
