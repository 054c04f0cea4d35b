"""Run a coroutine until it ends or an event is set: how a loop stops waiting when asked to.

Why one helper: the relay (its term, its back-off, its leadership against a lost lease) and the
certificate manager's start (a Vault call against a stop request) need the same thing, and
the details are easy to get wrong: both tasks must be cancelled and awaited on every path,
also when the caller itself is cancelled, and the work's own failure must come through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def race(work: Coroutine[Any, Any, T], event: asyncio.Event) -> tuple[bool, T | None]:
    """``(True, result)`` when ``work`` ends first; ``(False, None)`` when ``event`` is set
    first (``work`` is then cancelled). ``work``'s exception propagates."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        task.cancel()
        await asyncio.wait({task, waiter})
    if task.cancelled():
        return False, None
    return True, task.result()
