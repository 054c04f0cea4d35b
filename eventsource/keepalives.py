"""Node liveness keepalives, several leases per etcd gateway call.

Why: a gateway call costs this process about a millisecond of client CPU (and a thread of the
etcd pool) whatever it carries, and 5,000 nodes heartbeating every 10 s need about 250 lease
renewals per second (``handlers.nodes.liveness`` already halves that): one call per renewal timed
out by the thousand next to a placement load on two cores. The gateway's ``/v3/lease/keepalive`` is
a stream, so one call renews up to ``KEEPALIVE_BATCH_MAX`` (16) leases.

How: the first waiting renewal starts a timer of ``linger_s``; when it fires, or as soon as a
full batch waits, one call renews what waits (at most ``max_batch``), with at most
``max_inflight`` calls at once. A renewal therefore waits at most the linger, plus the calls
ahead of it when more than ``max_inflight`` batches are queued. Each caller awaits its own
future and gets its lease's TTL, or ``LeaseLost`` when etcd answered that the lease is gone, or
``Unavailable`` when the call failed or etcd did not answer for that lease. Every future is
settled when its batch's task ends, whatever ended it (the task's done callback), and on close.
"""

from __future__ import annotations

import asyncio
import logging
from itertools import islice

from eventsource.errors import LeaseLost, StoreError, Unavailable
from eventsource.etcd import KEEPALIVE_BATCH_MAX, AsyncEtcd
from eventsource.group import settle
from eventsource.metrics import Metrics

log = logging.getLogger("persys.keepalives")

#: lease id -> (loop time it started waiting, the callers waiting for its renewal)
Batch = dict[int, tuple[float, list[asyncio.Future[int]]]]


class KeepaliveBatcher:
    """Renews leases for many callers with few gateway calls; owns its send tasks."""

    def __init__(self, etcd: AsyncEtcd, *, metrics: Metrics | None = None,
                 linger_s: float = 0.05, max_batch: int = KEEPALIVE_BATCH_MAX,
                 max_inflight: int = 2) -> None:
        if not 1 <= max_batch <= KEEPALIVE_BATCH_MAX:
            raise ValueError(f"max_batch must be 1..{KEEPALIVE_BATCH_MAX}, got {max_batch}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        if linger_s < 0:
            raise ValueError(f"linger_s must not be negative, got {linger_s}")
        self.etcd = etcd
        self.metrics = metrics
        self.linger_s = linger_s
        self.max_batch = max_batch
        self.max_inflight = max_inflight
        self._waiting: Batch = {}
        self._timer: asyncio.TimerHandle | None = None
        #: each send task and the batch it must answer
        self._tasks: dict[asyncio.Task[None], Batch] = {}
        self._closed = False
        #: gateway calls made and leases they carried (for metrics and tests)
        self.calls = 0
        self.leases_sent = 0

    async def renew(self, lease_id: int) -> int:
        """Renew ``lease_id``; returns its TTL. Raises ``LeaseLost`` or ``Unavailable``."""
        if self._closed:
            raise Unavailable("keepalives closed: scheduler shutting down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        entry = self._waiting.get(lease_id)
        if entry is None:
            self._waiting[lease_id] = (loop.time(), [future])
        else:
            entry[1].append(future)  # one renewal answers every caller of the same lease
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if self._closed or not self._waiting or len(self._tasks) >= self.max_inflight:
            return  # a finished call schedules again
        if len(self._waiting) >= self.max_batch:
            self._start()
            return
        if self._timer is None:
            loop = asyncio.get_running_loop()
            oldest = next(iter(self._waiting.values()))[0]
            delay = max(0.0, oldest + self.linger_s - loop.time())
            self._timer = loop.call_later(delay, self._start)

    def _start(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._closed or not self._waiting or len(self._tasks) >= self.max_inflight:
            return
        batch = {lease_id: self._waiting.pop(lease_id)
                 for lease_id in list(islice(self._waiting, self.max_batch))}
        task = asyncio.get_running_loop().create_task(self._send(batch),
                                                      name="lease-keepalive-batch")
        self._tasks[task] = batch
        task.add_done_callback(self._finished)
        self._schedule()  # more than a batch waited: the rest may go in a second call

    def _finished(self, task: asyncio.Task[None]) -> None:
        batch = self._tasks.pop(task, {})
        if not task.cancelled() and task.exception() is not None:
            log.error("lease keepalive batch failed leases=%d", len(batch),
                      exc_info=task.exception())
        _fail(batch, "lease keepalive not answered")  # only what is still open
        self._schedule()

    async def _send(self, batch: Batch) -> None:
        self.calls += 1
        self.leases_sent += len(batch)
        if self.metrics is not None:
            self.metrics.lease_keepalive_calls.inc()
            self.metrics.lease_keepalives.inc(len(batch))
        try:
            ttls = await self.etcd.lease_keepalive_many(list(batch))  # the bulk lane
        except StoreError as exc:
            log.warning("lease keepalives failed leases=%d: %s", len(batch), exc)
            _fail(batch, f"lease keepalives failed: {exc}")
            return
        if len(ttls) < len(batch):
            # etcd stopped answering part-way; those leases are renewed at the next heartbeat
            log.warning("etcd answered %d of %d lease keepalives", len(ttls), len(batch))
        for lease_id, (_, futures) in batch.items():
            ttl = ttls.get(lease_id)
            for future in futures:
                if ttl is None:
                    settle(future, error=Unavailable(
                        f"etcd did not answer the keepalive of lease {lease_id:x}"))
                elif ttl > 0:
                    settle(future, result=ttl)
                else:
                    settle(future, error=LeaseLost(f"lease {lease_id:x} expired"))

    async def aclose(self) -> None:
        """Answer what waits, cancel and await the calls in flight (their callers are
        answered by the tasks' done callbacks)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, {}
        _fail(waiting, "keepalives closed: scheduler shutting down")
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _fail(batch: Batch, reason: str) -> None:
    """Answer every open caller of ``batch`` with ``Unavailable`` (one instance each: a shared
    one would tie every caller's traceback together)."""
    for _, futures in batch.values():
        for future in futures:
            settle(future, error=Unavailable(reason))
