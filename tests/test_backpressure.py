"""backpressure.Slots: a request's generations take their slots together, first come first served."""

from __future__ import annotations

import asyncio

import pytest

from kvguard.workers.backpressure import Slots


async def test_a_holder_takes_its_units_together_and_in_arrival_order() -> None:
    slots = Slots(4)
    await slots.acquire(3)
    big = asyncio.ensure_future(slots.acquire(4))  # waits for all four
    await asyncio.sleep(0)
    small = asyncio.ensure_future(slots.acquire(1))  # fits now, but arrived after `big`: waits behind it
    await asyncio.sleep(0)
    assert not big.done() and not small.done() and slots.waiting == 5
    slots.release(3)
    await asyncio.sleep(0)
    assert big.done() and not small.done() and slots.free == 0
    slots.release(4)
    await asyncio.sleep(0)
    assert small.done() and slots.free == 3 and slots.waiting == 0


async def test_a_waiter_that_gives_up_lets_the_next_ones_in() -> None:
    slots = Slots(2)
    await slots.acquire(1)
    head = asyncio.ensure_future(slots.acquire(2))
    await asyncio.sleep(0)
    behind = asyncio.ensure_future(slots.acquire(1))
    await asyncio.sleep(0)
    assert not behind.done()
    head.cancel()  # its request timed out waiting
    with pytest.raises(asyncio.CancelledError):
        await head
    await asyncio.sleep(0)
    assert behind.done() and slots.free == 0 and slots.waiting == 0


async def test_units_granted_to_a_waiter_cancelled_meanwhile_come_back() -> None:
    slots = Slots(1)
    await slots.acquire(1)
    waiter = asyncio.ensure_future(slots.acquire(1))
    await asyncio.sleep(0)
    slots.release(1)  # granted...
    waiter.cancel()  # ...and cancelled before it ran
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.free == 1 and slots.waiting == 0
