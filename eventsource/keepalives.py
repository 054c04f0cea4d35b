"""Node liveness keepalives, many leases per etcd gateway call.

Why: a gateway call costs this process about a millisecond of client CPU (and a thread of the
etcd pool) whatever it carries, and 5,000 nodes heartbeating every 10 s need about 250 lease
renewals per second (``handlers.liveness`` already halves that): one call per renewal timed out
by the thousand next to a placement load on two cores. The gateway's ``/v3/lease/keepalive`` is
a stream, so one call with newline-delimited requests renews any number of leases.

How: a renewal waits up to ``linger_s`` for others, then one call renews all that are waiting
(at most ``max_batch``), with at most ``max_inflight`` calls at once; while calls are in flight
the next batch keeps filling. A heartbeat's answer is delayed by at most the linger plus one
call, far inside any lease. Each caller awaits its own future and gets its lease's TTL, or
``LeaseLost`` for a lease that expired, or the call's ``Unavailable``: the outcome of one lease
never depends on another's.
"""

from __future__ import annotations

import asyncio
import logging
from itertools import islice

from eventsource.errors import LeaseLost, StoreError, Unavailable
from eventsource.etcd import BULK, AsyncEtcd, Lane
from eventsource.group import settle
from eventsource.metrics import Metrics

log = logging.getLogger("persys.keepalives")


class KeepaliveBatcher:
    """Renews leases for many callers with few gateway calls; owns its send tasks."""

    def __init__(self, etcd: AsyncEtcd, *, metrics: Metrics | None = None,
                 linger_s: float = 0.02, max_batch: int = 256, max_inflight: int = 2,
                 lane: Lane = BULK) -> None:
        if max_batch < 1 or max_inflight < 1 or linger_s < 0:
            raise ValueError("max_batch and max_inflight must be positive, linger_s not negative")
        self.etcd = etcd
        self.metrics = metrics
        self.linger_s = linger_s
        self.max_batch = max_batch
        self.max_inflight = max_inflight
        self.lane = lane
        #: lease id -> the callers waiting for its renewal (one renewal answers them all)
        self._waiting: dict[int, list[asyncio.Future[int]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        #: gateway calls made and leases renewed by them (for metrics and tests)
        self.calls = 0
        self.leases_sent = 0

    async def renew(self, lease_id: int) -> int:
        """Renew ``lease_id``; returns its TTL. Raises ``LeaseLost`` or ``Unavailable``."""
        if self._closed:
            raise Unavailable("keepalives closed: scheduler shutting down")
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(lease_id, []).append(future)
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if self._timer is not None or not self._waiting or self._closed:
            return
        if len(self._tasks) >= self.max_inflight:
            return  # the next finished call schedules again
        delay = 0.0 if len(self._waiting) >= self.max_batch else self.linger_s
        self._timer = asyncio.get_running_loop().call_later(delay, self._start)

    def _start(self) -> None:
        self._timer = None
        if self._closed or len(self._tasks) >= self.max_inflight or not self._waiting:
            return
        batch = {lease_id: self._waiting.pop(lease_id)
                 for lease_id in list(islice(self._waiting, self.max_batch))}
        task = asyncio.get_running_loop().create_task(self._send(batch),
                                                      name="lease-keepalive-batch")
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        self._schedule()  # more than a batch waited: the rest may go in a second call

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._schedule()

    async def _send(self, batch: dict[int, list[asyncio.Future[int]]]) -> None:
        self.calls += 1
        self.leases_sent += len(batch)
        if self.metrics is not None:
            self.metrics.lease_keepalive_calls.inc()
            self.metrics.lease_keepalives.inc(len(batch))
        try:
            ttls = await self.etcd.lease_keepalive_many(list(batch), lane=self.lane)
        except StoreError as exc:
            log.warning("lease keepalives failed leases=%d: %s", len(batch), exc)
            for futures in batch.values():
                for future in futures:
                    settle(future, error=exc)
            return
        except asyncio.CancelledError:
            for futures in batch.values():
                for future in futures:
                    future.cancel()
            raise
        for lease_id, futures in batch.items():
            ttl = ttls.get(lease_id, 0)
            for future in futures:
                if ttl > 0:
                    settle(future, result=ttl)
                else:
                    settle(future, error=LeaseLost(f"lease {lease_id:x} expired"))

    async def aclose(self) -> None:
        """Fail what waits, cancel and await the calls in flight."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, {}
        for futures in waiting.values():
            for future in futures:
                settle(future, error=Unavailable("keepalives closed: scheduler shutting down"))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
