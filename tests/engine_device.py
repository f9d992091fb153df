"""The device the engine's own tests build engines on: `cpu` here and in CI (where no GPU is),
`KVGUARD_TEST_DEVICE=cuda` to run the same tests on a GPU (scripts/device_check.sh does)."""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("KVGUARD_TEST_DEVICE", "cpu")
