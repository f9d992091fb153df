"""The pure layers import nothing beyond pydantic and pyyaml, and `kvguard plan` runs on the base
install (`pip install .`: pydantic + pyyaml). Each check runs in a fresh interpreter where every
top-level module outside the standard library and the base install's dependencies is unimportable
(aiohttp, kopf, kubernetes, torch, prometheus_client, requests...), so a transitive import fails
here exactly as it would on the base install."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE_INSTALL = ("kvguard", "pydantic", "pydantic_core", "annotated_types", "typing_extensions", "typing_inspection", "yaml", "_yaml")
PURE = (
    "kvguard.operator.api", "kvguard.operator.conditions", "kvguard.operator.crdgen", "kvguard.operator.planner",
    "kvguard.operator.policy", "kvguard.operator.rollout", "kvguard.operator.render", "kvguard.operator.revision",
    "kvguard.operator.reconcile", "kvguard.operator.hf_config", "kvguard.operator.engine_support",
    "kvguard.operator.canary.spec", "kvguard.operator.canary.report",
)  # fmt: skip

GUARD = textwrap.dedent(
    f"""
    import importlib.abc, sys
    ALLOWED = set(sys.stdlib_module_names) | set({BASE_INSTALL!r})

    class OnlyTheBaseInstall(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top not in ALLOWED and not top.startswith("_sysconfigdata"):  # the stdlib's own build data
                raise ModuleNotFoundError(f"{{name}} is not part of the base install", name=name)
            return None

    sys.meta_path.insert(0, OnlyTheBaseInstall())
    """
)


def run_guarded(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-c", GUARD + textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_guard_blocks_what_the_base_install_lacks() -> None:
    result = run_guarded("import aiohttp")
    assert result.returncode != 0 and "not part of the base install" in result.stderr


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_only_pydantic_and_pyyaml(module: str) -> None:
    result = run_guarded(f"import {module}")
    assert result.returncode == 0, result.stderr[-2000:]


def test_kvguard_plan_runs_on_the_base_install() -> None:
    result = run_guarded(
        """
        from kvguard.cli import main
        raise SystemExit(main(["plan", "-f", "examples/tiny-cpu.yaml"]))
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "4,096" in result.stdout or "4096" in result.stdout
