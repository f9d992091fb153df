"""The type hints hold: mypy over the installed package (scripts/typecheck.py, also `make lint`).

In the suite so that CI enforces it: a hint that lies is worse than none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_mypy_finds_no_errors_in_the_package() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "typecheck.py")], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
