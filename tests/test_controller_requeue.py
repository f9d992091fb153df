"""The controller looks again after the rollout's requeue delay instead of waiting for the timer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvguard.operator import controller


async def test_a_requeue_reconciles_once_after_its_delay_and_a_newer_one_replaces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    async def reconcile_model(kube: Any, body: dict[str, Any], **_: Any) -> None:
        calls.append(body)

    monkeypatch.setattr(controller, "reconcile_model", reconcile_model)
    key = (id(asyncio.get_running_loop()), "models", "tiny")
    controller._schedule_requeue(None, None, None, key, 0.2)  # type: ignore[arg-type]
    controller._schedule_requeue(None, None, None, key, 0.05)  # type: ignore[arg-type]  # a newer reconcile's delay wins
    await asyncio.sleep(0.4)
    assert calls == [{"metadata": {"namespace": "models", "name": "tiny"}}]
    controller._schedule_requeue(None, None, None, key, 0.05)  # type: ignore[arg-type]
    controller._schedule_requeue(None, None, None, key, None)  # type: ignore[arg-type]  # at rest: nothing pending
    await asyncio.sleep(0.15)
    assert len(calls) == 1 and key not in controller._REQUEUES
