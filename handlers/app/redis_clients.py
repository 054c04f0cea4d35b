"""The replica's Redis clients: one Redis at ``REDIS_ADDR``, or the master Sentinel names.

Why apart from the composition root: the clients differ by mode and the root should not.
With ``REDIS_ADDR`` this builds exactly what the root built before Sentinel support: a writer
client for the event log (which the relay also appends through), one for usage telemetry
(its own connections, so telemetry never takes the ones events need), and the tailer's. With
``REDIS_SENTINELS`` (``eventsource.stream.sentinel``) every client follows the master one
``MasterWatch`` keeps current, the relay appends through a client of its own that it pins to
the master whose stream it checked, the tailer holds its subscribers across a failover, and
event reads wait briefly for a new master to catch up (``handlers.api.events``).
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from eventsource.metrics import Metrics
from eventsource.stream.clients import redis_url, writer_client
from eventsource.stream.eventlog import RedisEventLog
from eventsource.stream.replicas import ReplicaWait
from eventsource.stream.sentinel import MasterPin, MasterWatch
from eventsource.stream.tailer import StreamTailer
from handlers.settings.config import Settings

log = logging.getLogger("persys.server")

#: how long WatchEvents streams are kept open while Redis fails over (Sentinel's default
#: down-after is 30 s; a failover follows within seconds)
TAILER_HOLD_S = 60.0
#: how long an event read waits for a new master's stream to reach a client's cursor
CATCH_UP_S = 5.0


class RedisClients:
    """Builds and closes the clients; ``run`` is the Sentinel watch's task (if any)."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self._settings = settings
        self._metrics = metrics
        target = settings.sentinel_target
        #: the master Sentinel names (None with REDIS_ADDR)
        self.master = MasterWatch(target, metrics) if target is not None else None
        #: event reads (ListEvents, WatchEvents history) and, with REDIS_ADDR, the relay
        self.events = self._client()
        #: usage telemetry and heartbeat times
        self.usage = self._client(max_connections=4)
        self._relay: aioredis.Redis | None = None

    def _client(self, *, max_connections: int = 16) -> aioredis.Redis:
        if self.master is not None:
            return self.master.client(max_connections=max_connections)
        s = self._settings
        return writer_client(redis_url(s.redis_addr, s.redis_password, s.redis_db),
                             max_connections=max_connections)

    @property
    def catch_up_s(self) -> float:
        return CATCH_UP_S if self.master is not None else 0.0

    def tailer(self, stream_key: str) -> StreamTailer:
        if self.master is not None:
            return StreamTailer.following(self.master, stream_key, hold_s=TAILER_HOLD_S)
        s = self._settings
        return StreamTailer.from_url(redis_url(s.redis_addr, s.redis_password, s.redis_db),
                                     stream_key)

    def relay_log(self, shared: RedisEventLog) -> tuple[RedisEventLog, MasterPin | None]:
        """The log the relay appends through, and its pin on the master (Sentinel only);
        with REDIS_ADDR, ``shared`` (the event reads' log) as before."""
        if self.master is None:
            return shared, None
        self._relay = self.master.client()
        return RedisEventLog(self._relay, shared.key), self.master.pin(self._relay)

    def replica_wait(self) -> ReplicaWait | None:
        """What the relay waits for before an append counts (None: the master's word)."""
        waits, required = self._settings.replica_acks
        return ReplicaWait(required, metrics=self._metrics) if waits else None

    async def run(self) -> None:
        """The owned task of the Sentinel watch; returns at once with REDIS_ADDR."""
        if self.master is not None:
            await self.master.run()

    async def aclose(self) -> None:
        for client in (self.events, self.usage, self._relay):
            if client is not None:
                await client.aclose()
        if self.master is not None:
            await self.master.aclose()
