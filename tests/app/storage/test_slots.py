"""app/storage/slots.py: admission slots that serve a request's later waits first."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from app.storage.slots import Slots


def request() -> Any:
    """What Slots reads of a request: its `state`."""
    return SimpleNamespace(state=SimpleNamespace())


def test_a_request_that_held_a_slot_goes_ahead_of_new_ones() -> None:
    served: list[str] = []

    async def main() -> None:
        slots = Slots(1)
        returning = request()
        async with slots.slot(returning):
            pass  # it held one before: its next wait is a later one

        async def take(name: str, asker: Any) -> None:
            async with slots.slot(asker):
                served.append(name)

        # The one slot taken; released when the block ends, after the others queued:
        # the returning request is served first, then the new ones in order.
        async with anyio.create_task_group() as tg, slots.slot(request()):
            for n in range(3):
                tg.start_soon(take, f"new {n}", request())
                await anyio.sleep(0.01)
            tg.start_soon(take, "returning", returning)
            await anyio.sleep(0.01)

    anyio.run(main)
    assert served == ["returning", "new 0", "new 1", "new 2"]


def test_a_waiter_cancelled_while_it_waits_leaves_the_queue() -> None:
    async def main() -> list[str]:
        slots = Slots(1)
        served: list[str] = []
        scope = anyio.CancelScope()

        async def cancelled() -> None:
            with scope:
                async with slots.slot(request()):
                    served.append("cancelled")

        async def later() -> None:
            async with slots.slot(request()):
                served.append("later")

        async with anyio.create_task_group() as tg, slots.slot(request()):
            tg.start_soon(cancelled)
            await anyio.sleep(0.01)
            tg.start_soon(later)
            await anyio.sleep(0.01)
            scope.cancel()  # while it waits
            await anyio.sleep(0.01)
        # The slot went to the next in line, and is back: one can be had at once.
        with anyio.fail_after(1):
            async with slots.slot(request()):
                served.append("after")
        return served

    assert anyio.run(main) == ["later", "after"]


@pytest.mark.parametrize("total", [1, 3])
def test_never_more_holders_than_slots(total: int) -> None:
    async def main() -> int:
        slots = Slots(total)
        holding = most = 0

        async def hold() -> None:
            nonlocal holding, most
            async with slots.slot(request()):
                holding += 1
                most = max(most, holding)
                await anyio.sleep(0.001)
                holding -= 1

        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(hold)
        return most

    assert anyio.run(main) == total
