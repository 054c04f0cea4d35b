"""Retention while leading: the stream trimmed by age every ``trim_interval`` seconds.

Why apart: only the relay trims (MAXLEN ~ ``max_entries`` rides on every XADD; this is the
other half), and the trimming is its own task beside the pump, cancelled with the leadership.
"""

from __future__ import annotations

import asyncio
import logging

from eventsource.clock import Clock
from eventsource.errors import StoreError
from eventsource.stream.eventlog import RedisEventLog

log = logging.getLogger("persys.relay")


async def trim_by_age_forever(stream: RedisEventLog, clock: Clock, *, ttl_ms: int,
                              interval: float) -> None:
    """Trim entries older than ``ttl_ms`` every ``interval`` seconds (no TTL: return)."""
    if ttl_ms <= 0:
        return
    while True:
        await asyncio.sleep(interval)
        now_ms = int(clock.now().timestamp() * 1000)
        try:
            removed = await stream.trim_by_age(ttl_ms, now_ms)
        except StoreError as exc:
            log.info("relay: trim failed (retrying later): %s", exc)
            continue
        if removed:
            log.debug("relay: trimmed %d entries older than %d ms", removed, ttl_ms)
