"""The replica's owned tasks: started by name, restarted with backoff when they fail, and
cancelled and awaited (within a deadline) at shutdown.

Apart from the composition root because owning tasks is a job of its own, with its own rules
(no task without an owner, a stop never waits past its deadline, and a task that will not stop
is named with where it waits), and nothing in it depends on what the tasks are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("persys.server")


def awaiting(task: asyncio.Task[Any]) -> str:
    """Where a task waits: its chain of awaited coroutines, innermost last (``get_stack``
    shows only the outermost frame of a suspended task, which names nothing useful)."""
    steps: list[str] = []
    current: Any = task.get_coro()
    while current is not None and len(steps) < 32:
        frame = getattr(current, "cr_frame", None) or getattr(current, "ag_frame", None)
        if frame is not None:
            steps.append(f"{frame.f_code.co_qualname} "
                         f"({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
        nxt = getattr(current, "cr_await", None) or getattr(current, "ag_await", None)
        if nxt is None and frame is None:
            steps.append(repr(current)[:120])  # a future, a task or a foreign awaitable
        current = nxt
    return " > ".join(steps) or "?"


class TaskOwner:
    """Owns named eternal tasks: a failure is logged and the task restarted with backoff."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, factory: Any) -> None:
        self._tasks[name] = asyncio.get_running_loop().create_task(
            self._guard(name, factory), name=name)

    async def _guard(self, name: str, factory: Any) -> None:
        backoff = 0.5
        while True:
            try:
                coro: Coroutine[Any, Any, None] = factory()
                await coro
                log.warning("task %s returned; restarting", name)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("task %s failed; restarting in %.1fs", name, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)

    async def stop(self, *names: str, timeout: float = 10.0) -> None:
        """Cancel and await the named tasks (all by default); never wait past ``timeout``."""
        targets = [self._tasks.pop(n) for n in (names or list(self._tasks)) if n in self._tasks]
        for task in targets:
            task.cancel()
        if not targets:
            return
        _, pending = await asyncio.wait(targets, timeout=timeout)
        for task in pending:
            log.error("task %s did not stop within %.0fs; abandoning it; it waits in %s",
                      task.get_name(), timeout, awaiting(task))
