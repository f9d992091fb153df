"""What a fresh clone gets: the README's quick start refers only to what the repository carries.

A clone holds the tracked files, nothing else (no .venv, no ../shared, nothing untracked). So:
every repository path the README names is tracked; the `make` targets it names run from a copy of
the tracked files alone (dry run: the first thing they do is create .venv and install, step by
step); and every command of its Commands table exists, with every flag the row promises in its
`--help`. `scripts/fresh_clone_check.sh` does the whole thing for real (clone, `make demo`); it
takes minutes, so it is run by hand, not here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
TOP_DIRS = "bench|crds|docker|docs|e2e|examples|kvguard|manifests|operator|scripts|tests|workers"
PATH = re.compile(rf"(?<![\w./<-])((?:{TOP_DIRS})/[\w./-]*)")


def tracked_files() -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot tell tracked files from the rest")
    done = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"not a git checkout ({done.stderr.strip()}): nothing says what a clone holds")
    return [name for name in done.stdout.split("\0") if name and (REPO / name).exists()]


def readme_paths() -> set[str]:
    return {match.rstrip(".") for match in PATH.findall(README)}


def test_every_path_the_readme_names_is_in_a_clone() -> None:
    tracked = tracked_files()
    paths = readme_paths()
    assert {"examples/incident.yaml", "docs/architecture.md", "bench/run_all.py"} <= paths  # the parser finds them
    missing = [p for p in sorted(paths) if not any(t == p.rstrip("/") or t.startswith(p.rstrip("/") + "/") for t in tracked)]
    assert not missing, f"README.md names paths a clone does not have: {missing}"


def make_dry_run(target: str, clone: Path, *, check: bool = False) -> subprocess.CompletedProcess[str]:
    """`make -n TARGET` as a user runs it: not as a sub-make of CI's `make test` (whose MAKELEVEL
    and MAKEFLAGS would add "Entering directory" lines and inherited flags)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    return subprocess.run(["make", "-n", target], cwd=clone, capture_output=True, text=True, timeout=60, check=check, env=env)


def make_targets() -> list[str]:
    return sorted(set(re.findall(r"`make ([\w-]+)", README)))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_make_targets_the_readme_names_run_from_the_tracked_files_alone(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    for name in tracked_files():
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, clone / name)
    assert {"demo", "test"} <= set(make_targets())  # the two commands of "Set up"
    for target in make_targets():
        done = make_dry_run(target, clone)
        assert done.returncode == 0, f"make -n {target}: {done.stderr}"
        if target in ("demo", "test"):
            steps = re.findall(r"setup_step\.py (\d+)/(\d+)", done.stdout)
            total = len(steps)
            assert total >= 6 and steps == [(str(n), str(total)) for n in range(1, total + 1)], done.stdout  # .venv first, every step said out loud
            assert (clone / "scripts" / "setup_step.py").is_file()
    last = make_dry_run("demo", clone, check=True)
    assert last.stdout.strip().splitlines()[-1] == ".venv/bin/kvguard demo"


def command_rows() -> list[tuple[str, list[str]]]:
    """(subcommand words or "", flags) of each `kvguard ...` row of the README's Commands table."""
    rows = []
    for line in README.split("## Commands", 1)[1].split("\n\n", 2)[1].splitlines()[2:]:
        usage = line.split("|")[1].strip().strip("`")
        words = usage.split()
        if words[0] != "kvguard":
            continue
        subcommand = []  # "model tiny DIR" -> ["model", "tiny"]; "--version" -> []
        for word in words[1:]:
            if not re.fullmatch(r"[a-z][a-z-]*", word):
                break
            subcommand.append(word)
        rows.append((" ".join(subcommand), sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line)))))
    return rows


@pytest.mark.parametrize(("sub", "flags"), command_rows(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_readme_command_exists_with_the_flags_it_promises(sub: str, flags: list[str]) -> None:
    argv = [sys.executable, "-P", "-m", "kvguard", *sub.split(), "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    missing = [flag for flag in flags if flag != "--help" and not re.search(rf"(?<![\w-]){flag}(?![\w-])", done.stdout)]
    assert not missing, f"`kvguard {sub}` --help lacks {missing}, which README.md promises"
