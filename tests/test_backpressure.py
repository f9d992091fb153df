"""backpressure.Slots: a request's generations take their slots together, first come first served;
SlotLease: each slot goes back once, a generation's own as soon as it ended at the workers;
Draining: those generations whose clients still read them are bounded as the slots are;
BodyMemory: the request bodies held at once are bounded in bytes;
SharedCheck: an answer that costs calls to other processes is made once for every caller."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvguard.workers.backpressure import BodyMemory, Draining, SharedCheck, SlotLease, Slots


async def until(condition: Callable[[], bool], what: str, turns: int = 100) -> None:
    """Let the other tasks run until `condition` holds (a few loop turns), else fail naming `what`."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)  # one loop turn: the tasks under test run their next step
    pytest.fail(f"{what} did not happen within {turns} loop turns")


async def queued(slots: Slots, count: int) -> asyncio.Future[None]:
    """A holder asking for `count` units, once it waits in the queue."""
    before = slots.waiting
    holder = asyncio.ensure_future(slots.acquire(count))
    await until(lambda: slots.waiting == before + count, f"a holder of {count} to queue")
    return holder


async def test_a_holder_takes_its_units_together_and_in_arrival_order() -> None:
    slots = Slots(4)
    await slots.acquire(3)
    big = await queued(slots, 4)  # waits for all four
    small = await queued(slots, 1)  # fits now, but arrived after `big`: waits behind it
    assert not big.done() and not small.done() and slots.waiting == 5
    slots.release(3)
    await until(big.done, "the big holder's grant")
    assert not small.done() and slots.free == 0
    slots.release(4)
    await until(small.done, "the small holder's grant")
    assert slots.free == 3 and slots.waiting == 0


async def test_a_waiter_that_gives_up_lets_the_next_ones_in() -> None:
    slots = Slots(2)
    await slots.acquire(1)
    head = await queued(slots, 2)
    behind = await queued(slots, 1)
    assert not behind.done()
    head.cancel()  # its request timed out waiting
    with pytest.raises(asyncio.CancelledError):
        await head
    await until(behind.done, "the holder behind to be granted")
    assert slots.free == 0 and slots.waiting == 0


async def test_units_granted_to_a_waiter_cancelled_meanwhile_come_back() -> None:
    slots = Slots(1)
    await slots.acquire(1)
    waiter = await queued(slots, 1)
    slots.release(1)  # granted...
    waiter.cancel()  # ...and cancelled before it ran
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.free == 1 and slots.waiting == 0


async def test_a_waiter_cancelled_and_released_to_in_the_same_turn_loses_no_units() -> None:
    """cancel() cancels the waiter's future at once, its clean-up runs a turn later: a release in
    between handed it the units, set_result raised InvalidStateError, and the unit was gone."""
    slots = Slots(1)
    await slots.acquire(1)
    waiter = await queued(slots, 1)
    waiter.cancel()  # its request timed out, or its client left...
    slots.release(1)  # ...as another generation ended, in the same turn
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.free == 1 and slots.waiting == 0
    await slots.acquire(1)  # and the unit can be taken again


async def test_a_generation_that_ended_gives_its_slot_back_once_and_the_request_the_rest() -> None:
    slots = Slots(4)
    await slots.acquire(3)
    lease = SlotLease(slots, 3, Draining(4, 30.0), lambda: None)  # a request of three choices
    next_one = await queued(slots, 2)  # another tenant's request of two
    lease.release_one("choice-a")  # choice a ended at the workers; its client still reads it
    await until(next_one.done, "the next request's grant")
    lease.release_one("choice-a")  # decode's finish seen twice: no second slot
    assert slots.free == 0 and lease.held == 2
    lease.release_rest()  # the request ends: the two still held
    lease.release_one("choice-b")  # a finish seen after the request ended: nothing left to give
    lease.release_rest()
    assert slots.free == 2 and lease.held == 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_full_draining_room_gives_the_place_of_a_reader_past_the_grace_and_no_other() -> None:
    clock, dropped = Clock(), []
    draining = Draining(2, grace_s=30.0, clock=clock)
    assert draining.enter("a", lambda: dropped.append("a")) and draining.enter("b", lambda: dropped.append("b"))
    clock.now = 30.0  # "a" has drained for the grace, no longer
    assert not draining.enter("c", lambda: dropped.append("c")) and dropped == []
    clock.now = 30.5
    assert draining.enter("c", lambda: dropped.append("c"))  # "a" loses its connection for "c"
    assert dropped == ["a"] and len(draining) == 2
    draining.leave("b")  # b's client read it all
    assert draining.enter("d", lambda: dropped.append("d")) and dropped == ["a"]


async def test_a_generation_with_no_draining_room_keeps_its_slot_until_its_request_ends() -> None:
    slots = Slots(2)
    await slots.acquire(2)
    draining = Draining(1, grace_s=30.0)
    first, second = SlotLease(slots, 1, draining, lambda: None), SlotLease(slots, 1, draining, lambda: None)
    first.release_one("one")  # ended at the workers; its client still reads
    second.release_one("two")  # ended too, but the room is full of a reader within its grace
    assert slots.free == 1 and second.held == 1 and len(draining) == 1
    first.close()  # the first client read it all: it leaves the room
    first.release_rest()
    second.close()
    second.release_rest()
    assert slots.free == 2 and len(draining) == 0


async def test_a_generation_leaves_the_draining_room_once_relayed_and_all_leave_when_the_request_ends() -> None:
    """A review: an entry aged from its generation's end until the whole request ended, so a client
    keeping up with a long sibling (or paced choices) looked like a slow reader and was evicted;
    and an eviction after the handler ended reset the connection's next request."""
    slots = Slots(4)
    await slots.acquire(4)
    draining = Draining(4, grace_s=30.0)
    lease = SlotLease(slots, 4, draining, lambda: None)  # a request of four choices
    lease.release_one("choice-0")  # ended at the workers
    lease.release_one("choice-1")
    assert len(draining) == 2 and slots.free == 2
    lease.relayed("choice-0")  # its last event went out to the client: it no longer lags
    assert len(draining) == 1
    lease.relayed("choice-2")  # relayed before its release ran (a client that keeps up)...
    lease.release_one("choice-2")  # ...gives its slot back without taking a place
    assert len(draining) == 1 and slots.free == 3
    lease.close()  # the handler ended (its last slot may still wait for aborts)
    lease.release_one("choice-3")  # a finish seen after that: no place, and the slot waits for release_rest
    assert len(draining) == 0 and lease.held == 1 and slots.free == 3
    lease.release_rest()
    assert slots.free == 4


# -------------------------------------------------------------------------------- BodyMemory


def test_bodies_are_charged_past_their_free_bytes_and_refused_past_the_room() -> None:
    memory = BodyMemory(capacity=1000, free_bytes=100)
    with memory.reading() as first, memory.reading() as second:
        assert first.grow_to(100) and memory.held == 0  # within its own free bytes
        assert first.grow_to(900) and memory.held == 800
        assert second.grow_to(300) and memory.held == 1000  # exactly full
        assert not second.grow_to(301) and memory.held == 1000 and second.charged == 200  # refused: nothing more charged
        assert second.grow_to(300)  # growing to what it already holds costs nothing
    assert memory.held == 0


def test_a_body_that_ends_in_an_error_gives_its_bytes_back() -> None:
    memory = BodyMemory(capacity=1000, free_bytes=0)
    with pytest.raises(RuntimeError), memory.reading() as lease:
        assert lease.grow_to(700)
        raise RuntimeError("the client went away mid-body")
    assert memory.held == 0
    with memory.reading() as lease:
        assert lease.grow_to(1000)


async def test_a_shared_check_runs_once_for_every_caller_and_is_reused_while_fresh() -> None:
    """The router's /health asked every worker once per call: a flood of the public endpoint was
    a flood of signed internal calls (an outside probe). Callers now share one run, a caller that
    leaves does not cancel it for the others, and a fresh answer is reused."""
    runs: list[asyncio.Event] = []

    async def check() -> int:
        runs.append(asyncio.Event())
        await runs[-1].wait()
        return len(runs)

    shared = SharedCheck(check, fresh_s=3600.0)
    callers = [asyncio.ensure_future(shared.get()) for _ in range(50)]
    await until(lambda: len(runs) == 1, "the one run to start")
    callers[0].cancel()  # its client left
    runs[0].set()
    answers = await asyncio.gather(*callers[1:])
    assert answers == [1] * 49 and len(runs) == 1
    assert await shared.get() == 1 and len(runs) == 1  # fresh: reused, no new run

    shared.forget()  # what it judged changed (a worker failed a request): the next caller runs it again
    again = asyncio.ensure_future(shared.get())
    await until(lambda: len(runs) == 2, "a run again after forget")
    runs[1].set()
    assert await again == 2
    runs.pop()  # (the fresh_s=0 check below counts its runs from here)

    stale = SharedCheck(check, fresh_s=0.0)  # every answer stale at once: a new run once the last ended
    first = asyncio.ensure_future(stale.get())
    await until(lambda: len(runs) == 2, "the second check's run")
    runs[1].set()
    assert await first == 2
    second = asyncio.ensure_future(stale.get())
    await until(lambda: len(runs) == 3, "a run again once the answer is stale")
    runs[2].set()
    assert await second == 3

