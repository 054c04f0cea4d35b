"""One replica's run as a process: build it, start it, wait for the stop signal, stop it.

Apart from the composition root because this is the process's side (ops/cli.py sets the stop
event from SIGINT/SIGTERM and turns ``StartError`` into an exit status), while ``Scheduler``
knows only how to build, start and stop a replica.
"""

from __future__ import annotations

import asyncio

from handlers.app.server import READY_TIMEOUT_S, Scheduler
from handlers.settings.config import Settings


async def serve(settings: Settings, stop: asyncio.Event, *,
                ready_timeout: float = READY_TIMEOUT_S) -> None:
    """Run one replica until ``stop`` is set (also while it starts).

    Raises:
        StartError: it could not start (see ``Scheduler.start``).
    """
    scheduler = Scheduler(settings)
    try:
        await scheduler.start(stop, ready_timeout=ready_timeout)
        await stop.wait()
    finally:
        await scheduler.stop()
