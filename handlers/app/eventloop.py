"""Which event loop runs a scheduler process.

Why uvloop by default: the scheduler is one event loop that does everything (gRPC calls,
watch batches, the relay, the stream tailer), and most of an event's path is loop overhead:
callbacks, futures, wake-ups from grpc's poller and the etcd threads. With uvloop the events
benchmark at 500 events/s, run alternately with the standard loop, delivered events with about
a third less latency (p50 32-53 ms against 45-82 ms, p99 132-176 ms against 148-279 ms).
``SCHEDULER_EVENT_LOOP=asyncio`` runs the standard loop, and so does a platform uvloop does not
support; everything the scheduler does is plain asyncio and works on either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("persys.loop")

T = TypeVar("T")


def loop_factory(name: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """The factory for ``asyncio.Runner`` and the name of the loop it makes.

    None means the standard loop: asked for, or uvloop is not installed (it is a dependency
    on Linux and macOS only).
    """
    if name == "asyncio":
        return None, "asyncio"
    try:
        import uvloop
    except ImportError:
        return None, "asyncio (uvloop not installed)"
    return uvloop.new_event_loop, "uvloop"


def run(main: Callable[[], Coroutine[Any, Any, T]], event_loop: str) -> T:
    """Run ``main()`` to completion on a new loop of the kind named (``uvloop``/``asyncio``)."""
    factory, chosen = loop_factory(event_loop)
    log.info("event loop: %s", chosen)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())
