"""The layering docs/architecture.md promises: pure operator parts import neither kopf, kubernetes
nor torch; `workers` never imports `operator`; the operator never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PURE = ("api", "planner", "spec_checks", "estimates", "suggestions", "policy", "rollout", "reconcile", "render", "revision",
        "conditions", "crdgen", "hf_config", "canary", "traffic", "analysis", "pool_gate", "continuous")  # fmt: skip


def imported_modules(folder: Path) -> dict[Path, set[str]]:
    """Every module each file under `folder` imports (absolute names, from the source)."""
    found: dict[Path, set[str]] = {}
    for path in folder.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[path] = names
    return found


def test_pure_operator_modules_load_without_kopf_kubernetes_or_torch() -> None:
    imports = "; ".join(f"import kvguard.operator.{name}" for name in PURE)
    probe = f"import sys; {imports}; print(sorted(m for m in ('kopf', 'kubernetes', 'torch') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_workers_never_import_the_operator() -> None:
    offenders = {path.name: sorted(n for n in names if n.startswith("kvguard.operator"))
                 for path, names in imported_modules(REPO / "workers").items()}  # fmt: skip
    assert not any(offenders.values()), offenders


def test_the_operator_never_imports_torch() -> None:
    offenders = {str(path.relative_to(REPO)): sorted(n for n in names if n.split(".")[0] == "torch")
                 for path, names in imported_modules(REPO / "operator").items()}  # fmt: skip
    assert not any(offenders.values()), offenders
