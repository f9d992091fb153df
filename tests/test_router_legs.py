"""The router's two legs of one generation (workers/router.py): a prefill failure ends the wait on
decode at once, whatever that wait is for (S4)."""

from __future__ import annotations

import asyncio

import pytest

from kvguard.workers.openai_api import OpenAIError
from kvguard.workers.router import _unless_prefill_fails


async def test_a_prefill_failure_ends_the_wait_for_decodes_answer_and_cancels_the_call_s4() -> None:
    """Decode answers the call once it has pages; a prefill that failed while decode still queued
    for them was seen only after decode allocated for a dead request (the formal model lets the
    router see it at once: a review of the model against the code found the difference)."""
    called, cancelled = asyncio.Event(), asyncio.Event()

    async def decode_call_queued_for_pages() -> str:
        called.set()
        try:
            await asyncio.Event().wait()  # decode has no pages for it yet
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "headers"

    async def prefill_fails() -> None:
        await called.wait()
        raise OpenAIError(502, "prefill worker failed", code="prefill_failed")

    prefill = asyncio.create_task(prefill_fails())
    with pytest.raises(OpenAIError) as failed:
        await asyncio.wait_for(_unless_prefill_fails(decode_call_queued_for_pages, prefill), timeout=60)
    assert failed.value.code == "prefill_failed" and cancelled.is_set()


async def test_a_prefill_that_failed_before_the_wait_began_is_raised_and_the_call_never_starts() -> None:
    started = []

    async def decode_call() -> str:
        started.append(True)
        return "headers"

    async def prefill_fails() -> None:
        raise OpenAIError(502, "prefill worker failed", code="prefill_failed")

    prefill = asyncio.create_task(prefill_fails())
    await asyncio.wait((prefill,))
    with pytest.raises(OpenAIError):
        await _unless_prefill_fails(decode_call, prefill)
    assert started == []  # never started


async def test_without_a_prefill_failure_the_wait_gives_its_own_result_or_error() -> None:
    async def prefill_still_running() -> None:
        await asyncio.Event().wait()

    prefill = asyncio.create_task(prefill_still_running())

    async def answered() -> str:
        return "headers"

    async def refused() -> str:
        raise OpenAIError(400, "decode refused it", code="context_length_exceeded")

    assert await _unless_prefill_fails(answered, prefill) == "headers"
    with pytest.raises(OpenAIError) as refusal:
        await _unless_prefill_fails(refused, prefill)
    assert refusal.value.status == 400 and not prefill.done()
    prefill.cancel()
    assert await _unless_prefill_fails(answered, None) == "headers"
