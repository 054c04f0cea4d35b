"""The loop-lag probe records how long a blocking callback held the event loop."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from handlers.looplag import probe_loop_lag


async def test_a_stall_is_recorded_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    lag = Histogram("lag_seconds", "lag", registry=registry, buckets=(0.05, 0.1, 1.0))
    probe = asyncio.create_task(probe_loop_lag(lag, interval=0.01, warn_after=0.1))
    try:
        await asyncio.sleep(0.05)  # the probe is sleeping on its timer now
        with caplog.at_level(logging.WARNING, logger="persys.looplag"):
            time.sleep(0.2)  # noqa: ASYNC251 - deliberately holds the loop, as a blocking call would
            deadline = time.monotonic() + 5.0
            while not any("stalled" in r.message for r in caplog.records):
                assert time.monotonic() < deadline, "the stall was never reported"
                await asyncio.sleep(0.01)
    finally:
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
    over = registry.get_sample_value("lag_seconds_count") or 0.0
    under = registry.get_sample_value("lag_seconds_bucket", {"le": "0.1"}) or 0.0
    assert over - under >= 1, "the 200 ms stall is not in the histogram"
