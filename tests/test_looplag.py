"""Process health: the loop-lag probe, garbage-collection pause timing, collector tuning."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from handlers.app.looplag import GcPauses, probe_loop_lag, tune_gc
from tests.fixtures.waiting import wait_for


async def test_a_stall_is_recorded_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    lag = Histogram("lag_seconds", "lag", registry=registry, buckets=(0.05, 0.1, 1.0))
    probe = asyncio.create_task(probe_loop_lag(lag, interval=0.01, warn_after=0.1))
    try:
        await asyncio.sleep(0)  # the probe starts and waits on its timer
        with caplog.at_level(logging.WARNING, logger="persys.looplag"):
            time.sleep(0.2)  # noqa: ASYNC251  # allowed: deliberately holds the loop
            await wait_for(lambda: any("stalled" in r.message for r in caplog.records),
                           message="the stall was never reported")
    finally:
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
    over = registry.get_sample_value("lag_seconds_count") or 0.0
    under = registry.get_sample_value("lag_seconds_bucket", {"le": "0.1"}) or 0.0
    assert over - under >= 1, "the 200 ms stall is not in the histogram"


def test_every_collection_is_timed_by_generation() -> None:
    registry = CollectorRegistry()
    pauses = Histogram("gc_seconds", "gc", ["generation"], registry=registry)
    timer = GcPauses(pauses)
    timer.install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        timer.remove()
    assert timer not in gc.callbacks
    assert (registry.get_sample_value("gc_seconds_count", {"generation": "0"}) or 0) >= 1
    assert (registry.get_sample_value("gc_seconds_count", {"generation": "2"}) or 0) >= 1


def test_tuning_raises_the_thresholds_and_freezes_the_start_up_heap() -> None:
    before = gc.get_threshold()
    try:
        tune_gc(young=12_345, middle=7, old=9)
        assert gc.get_threshold() == (12_345, 7, 9)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
