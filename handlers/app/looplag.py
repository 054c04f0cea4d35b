"""Process health: event-loop lag, garbage-collection pauses, and the collector settings.

Why: every RPC, watch delivery and event fan-out runs on one loop, so a callback that holds it
(a large decode, a burst of agent replies) delays everything behind it. Operators need that as a
number, and latency targets (apply p99, event delivery p99) are bounded by it. The probe sleeps
``interval`` and records how much later than asked it woke; a stall past ``warn_after`` is logged
with its length so it can be grepped and matched against the work that ran then.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

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


class GcPauses:
    """Times every garbage collection (``gc.callbacks``) into a histogram by generation.

    Why: a full collection walks every tracked object, and with 100,000 workloads in the
    projections that is millions of objects; the collection holds the event loop for as long as
    it runs. Long pauses are logged with their generation so a loop stall can be told apart
    from a slow callback.
    """

    def __init__(self, histogram: Histogram, *, warn_after: float = 0.25) -> None:
        self._histogram = histogram
        self._warn_after = warn_after
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info.get("generation", 0)
        self._histogram.labels(str(generation)).observe(pause)
        if pause >= self._warn_after:
            log.warning("garbage collection paused the process generation=%d pause_ms=%.0f "
                        "collected=%d", generation, pause * 1000.0, info.get("collected", 0))

    def install(self) -> None:
        gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def tune_gc(*, young: int = 50_000, middle: int = 5, old: int = 400) -> None:
    """Collector settings for a process whose heap is mostly long-lived projections.

    With CPython's defaults (700, 10, 10) a young collection runs every 700 allocations, so the
    short-lived objects of a reconcile cycle or a burst of heartbeats are still alive when it
    runs, get promoted, and soon trigger a full collection that walks the whole heap: measured
    at 5,000 nodes, one full collection every ~5 s pausing the loop for 250-860 ms while
    collecting almost nothing. Larger thresholds let those objects die young (reference
    counting frees them), and full collections become rare (CPython still runs one once the
    promoted objects exceed a quarter of the heap). A generation-1 collection walks everything
    that survived up to ``middle`` young ones (at most ``middle x young`` objects): with 20,
    generation-1 pauses reached about a second while 100,000 workloads were created. 5 bounds
    each to a quarter of that for the same total work, since every survivor is walked there
    once before it is promoted either way. ``old`` counts generation-1 collections, so it is
    400 (was 100) to keep full collections as rare as before: at most one per 100 million net
    allocations (400 x 5 x 50,000, as 100 x 20 x 50,000 was), and the quarter-of-the-heap
    rule still applies. ``gc.freeze()`` first moves everything allocated at start-up (modules,
    gRPC, settings) out of every future collection.
    """
    gc.freeze()
    gc.set_threshold(young, middle, old)
