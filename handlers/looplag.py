"""Event-loop lag: how late a timer fires on the scheduler's one event loop.

Why: every RPC, watch delivery and event fan-out runs on one loop, so a callback that holds it
(a large decode, a burst of agent replies) delays everything behind it. Operators need that as a
number, and latency targets (apply p99, event delivery p99) are bounded by it. The probe sleeps
``interval`` and records how much later than asked it woke; a stall past ``warn_after`` is logged
with its length so it can be grepped and matched against the work that ran then.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Histogram

log = logging.getLogger("persys.looplag")


async def probe_loop_lag(histogram: Histogram, *, interval: float = 0.05,
                         warn_after: float = 0.5) -> None:
    """Record the loop's lag every ``interval`` seconds, forever (the owner cancels it)."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + interval
        await asyncio.sleep(interval)
        lag = max(0.0, loop.time() - asked)
        histogram.observe(lag)
        if lag >= warn_after:
            log.warning("event loop stalled lag_ms=%.0f", lag * 1000.0)
