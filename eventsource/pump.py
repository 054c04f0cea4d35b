"""The queue-and-send skeleton shared by the group committer and the placement batcher.

Why one helper: both queue work from many callers, send it in batches from at most
``max_inflight`` tasks they own, start the next batch when one finishes, and on close fail
whatever still waits and cancel (and await) what is in flight. Only *what goes into a batch*
and *how a batch is sent* differ; those are the two functions given here.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class BatchPump(Generic[T]):
    """Owns the queue and the send tasks; ``take`` picks a batch, ``send`` delivers it.

    ``take`` removes what it picks from ``queue`` (it may leave items that must wait) and
    returns them; an empty list means nothing can go now. ``send`` must settle every item's
    caller itself; the pump only sequences the tasks. Each batch runs in a context of its own
    (empty): what must run in a caller's context is carried by the item.
    """

    def __init__(self, *, max_inflight: int,
                 take: Callable[[deque[T]], list[T]],
                 send: Callable[[list[T]], Coroutine[Any, Any, None]]) -> None:
        self.max_inflight = max_inflight
        self.queue: deque[T] = deque()
        self.inflight = 0
        self.closed = False
        self._take = take
        self._send = send
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, item: T) -> None:
        self.queue.append(item)
        self.pump()

    def pump(self) -> None:
        """Start batches while there is work and room in flight."""
        while self.queue and self.inflight < self.max_inflight and not self.closed:
            batch = self._take(self.queue)
            if not batch:
                return
            self.inflight += 1
            # an empty context: the batch serves many callers, so it must not run in the
            # context of whichever one happened to start it (its trace, for one)
            task = asyncio.get_running_loop().create_task(self._run(batch),
                                                          context=contextvars.Context())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[T]) -> None:
        try:
            await self._send(batch)
        finally:
            self.inflight -= 1
            self.pump()

    async def aclose(self, fail: Callable[[T], None]) -> None:
        """Fail every queued item, then cancel and await the batches in flight."""
        self.closed = True
        for item in self.queue:
            fail(item)
        self.queue.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
