"""mypy over the kvguard package as it is installed: `kvguard.operator` and `kvguard.workers`.

The repository maps two top-level folders into the package (pyproject.toml's `package-dir`:
`operator` is a standard-library name), which mypy cannot follow. So this builds the installed
layout out of symbolic links in a temporary folder, checks `-p kvguard` there with the settings
of pyproject.toml's `[tool.mypy]`, and prints each error with the repository's own path.

    python scripts/typecheck.py        # exit status: mypy's (0: no errors)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"operator": ROOT / "operator", "workers": ROOT / "workers"}  # kvguard.<name> -> folder


def installed_layout(into: Path) -> Path:
    package = into / "kvguard"
    package.mkdir()
    for entry in (ROOT / "kvguard").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in MAPPED.items():
        (package / name).symlink_to(folder, target_is_directory=True)
    return package


def repository_path(line: str) -> str:
    """`kvguard/workers/x.py:3: error` -> `workers/x.py:3: error` (the file one opens)."""
    for name in MAPPED:
        if line.startswith(f"kvguard/{name}/"):
            return line.removeprefix("kvguard/")
    return line


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvguard-typecheck-") as tmp:
        installed_layout(Path(tmp))
        result = subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
             "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "kvguard"],
            cwd=tmp, capture_output=True, text=True, check=False,
        )  # fmt: skip
    for line in (result.stdout + result.stderr).splitlines():
        print(repository_path(line))
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
