"""How many replicas must hold the relay's appends before it removes them from the outbox.

Why it exists: Redis replicates asynchronously, and Sentinel promotes a replica when the master
fails. An entry the master acknowledged but no replica received yet is gone after that
failover; had the relay deleted its outbox key on the master's word, the event would be lost
(the take-over of the new master sees its stream end below the mark and can only write an
``EventsGap``). So each append ends with ``WAIT numreplicas timeout``, and what fewer replicas
acknowledged stays in the outbox (``ReplicasBehind``): the next pass appends it again, which
Redis recognises, or which fills in what a new master lacks.

``required`` is ``REDIS_MIN_REPLICAS_ACK``. Unset (None) it means 1 while the master has a
connected replica and 0 while it has none (``INFO replication``, read again at most every
``recheck_s`` seconds and after every short wait): a master whose only replica is down keeps
relaying on its own word, as it would without replicas. A number insists: the relay stops
removing events while fewer replicas answer (appends go on being retried; watchers see nothing
new meanwhile), which is the stricter choice for a master run with ``min-replicas-to-write``.

WAIT counts the replicas that acknowledged the connection's last write. When every XADD of a
batch was refused as already present (a pass after a failure appends again), the connection
wrote nothing, so the wait is preceded by a PUBLISH, which Redis propagates to its replicas:
its offset covers every write before it, whichever connection made it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from eventsource.metrics import Metrics
from eventsource.stream.errors import ReplicasBehind

log = logging.getLogger("persys.stream")

#: how long one WAIT may take (below the writer client's socket timeout)
WAIT_TIMEOUT_MS = 1000
#: how long a count of connected replicas is trusted (unset REDIS_MIN_REPLICAS_ACK)
RECHECK_S = 1.0


class ReplicaWait:
    """The replicas one append needs (see the module docstring), and the verdict on WAIT."""

    def __init__(self, required: int | None, *, timeout_ms: int = WAIT_TIMEOUT_MS,
                 recheck_s: float = RECHECK_S, metrics: Metrics | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if required is not None and required < 0:
            raise ValueError("required replicas must be >= 0")
        if timeout_ms < 1:
            raise ValueError("timeout_ms must be positive")
        self.required = required
        self.timeout_ms = timeout_ms
        self.recheck_s = recheck_s
        self._metrics = metrics
        self._monotonic = monotonic
        self._replicas = 0
        self._checked_until = float("-inf")
        self._alone_logged = False

    @property
    def auto(self) -> bool:
        return self.required is None

    async def needed(self, client: aioredis.Redis) -> int:
        """How many replicas the next append waits for (may read ``INFO replication``)."""
        if self.required is not None:
            return self.required
        if self._monotonic() >= self._checked_until:
            await self._count(client)
        return 1 if self._replicas > 0 else 0

    async def _count(self, client: aioredis.Redis) -> int:
        info = await client.info("replication")
        self._replicas = int(info.get("connected_slaves", 0) or 0)
        self._checked_until = self._monotonic() + self.recheck_s
        if self._replicas > 0:
            self._alone_logged = False
        return self._replicas

    async def judge(self, client: aioredis.Redis, acked: int, needed: int) -> None:
        """After WAIT answered ``acked`` of ``needed``: return when that is enough (or, unset,
        when the master has no replica left to wait for); else raise ``ReplicasBehind``."""
        if acked >= needed:
            self._count_result("confirmed")
            return
        if self.auto and await self._count(client) == 0:
            self._count_result("alone")
            if not self._alone_logged:
                self._alone_logged = True
                log.warning("redis master has no connected replica: events are taken as "
                            "appended on its word (a failover now could lose them)")
            return
        self._count_result("short")
        raise ReplicasBehind(f"{acked} of {needed} replicas acknowledged the append within "
                             f"{self.timeout_ms} ms: kept in the outbox, appended again")

    def _count_result(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.event_replica_waits.labels(result).inc()
