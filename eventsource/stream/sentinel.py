"""Following the Redis master that Sentinel names: discovery, failover detection, pinning.

Why it exists: production Redis runs as a master with replicas under Sentinel, which promotes
a replica when the master fails. redis-py's ``Sentinel(...).master_for(...)`` asks Sentinel for
the master's address on every new connection, which is enough for telemetry and readers; the
event relay needs more, because appending to a master other than the one whose stream it
checked would skip those checks (``eventsource.relay.takeover``):

* :class:`MasterWatch` (one per process) polls Sentinel every ``poll_s`` and also hears every
  address a pool is told when it connects. A change is a failover seen: counted
  (``redis_failovers_total``), shown (``redis_master{address}``), every pool's connections to
  the old address are closed (a command stuck on a paused master ends now instead of at its
  socket timeout, and no idle connection is left to write to a demoted or stale master), and
  whoever waits for a change (the relay's back-off, the tailer's retry) wakes up.
* :class:`FollowingPool` is a blocking pool (callers wait for a connection, as with
  ``writer_client``) that reports the addresses it is given, and can be *pinned*: then it
  refuses (``MasterMoved``, a connection error) to connect anywhere but the pinned address.
  redis-py reconnects a pooled connection silently when it finds it closed; pinned, that
  reconnection cannot reach the new master behind the relay's back.
* :class:`MasterPin` is the relay's handle: ``pin()`` at the start of each pass, before its
  take-over checks read the stream, ``check()`` before every append (the watch saw another
  master: start over), ``sleep()`` for a back-off that a failover cuts short.

The Sentinel clients never retry (discovery moves on to the next Sentinel) and every call has
a socket timeout; a master is taken from a Sentinel only if it reports it up (not ``s_down`` or
``o_down``) and knows at least ``min_other_sentinels`` peers (a majority of the configured
Sentinels, counting itself), so an isolated Sentinel's stale answer is not followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from eventsource.metrics import Metrics
from eventsource.stream.errors import RedisUnavailable

log = logging.getLogger("persys.stream")

Address = tuple[str, int]

#: how often the watch asks Sentinel for the master (cheap: one SENTINEL MASTERS)
POLL_S = 0.25
#: socket and connect timeout of one Sentinel call
SENTINEL_TIMEOUT_S = 1.0


def format_address(address: Address | None) -> str:
    return f"{address[0]}:{address[1]}" if address is not None else ""


def parse_sentinels(text: str) -> tuple[Address, ...]:
    """``host:port,host:port`` -> addresses; raises ``ValueError`` naming the bad part."""
    out: list[Address] = []
    for part in text.split(","):
        item = part.strip()
        host, sep, port_text = item.rpartition(":")
        host = host.strip("[]")  # [::1]:26379
        if not item or not sep or not host or not port_text.isdigit():
            raise ValueError(f"{item!r} is not host:port")
        port = int(port_text)
        if not 0 < port < 65536:
            raise ValueError(f"{item!r}: port {port} is outside 1..65535")
        out.append((host, port))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """Where the master is asked for, and how to talk to it (``REDIS_SENTINEL*``)."""

    sentinels: tuple[Address, ...]
    master_name: str
    #: the master's own password (``REDIS_PASSWORD``) and database (``REDIS_DB``)
    password: str = ""
    db: int = 0
    #: the Sentinels' password (``REDIS_SENTINEL_PASSWORD``; "" = none)
    sentinel_password: str = ""

    @property
    def min_other_sentinels(self) -> int:
        """Peers a Sentinel must know for its answer to count: a majority, itself included."""
        return len(self.sentinels) // 2


class MasterMoved(RedisConnectionError):
    """A pinned pool was told of another master: the relay must check the new one first."""


class FollowingPool(SentinelConnectionPool, BlockingConnectionPool):
    """A Sentinel-managed blocking pool that reports the addresses it is told, and refuses to
    connect anywhere but its pinned address while pinned (see the module docstring)."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        self._on_address: Callable[[Address], None] | None = kwargs.pop("on_address", None)
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        #: while set, connections go to this address only
        self.pinned: Address | None = None

    async def get_master_address(self) -> Address:
        found = await self.sentinel_manager.discover_master(self.service_name)
        address = (str(found[0]), int(found[1]))
        if self._on_address is not None:
            self._on_address(address)
        if self.pinned is not None and address != self.pinned:
            raise MasterMoved(f"the Redis master moved from {format_address(self.pinned)} to "
                              f"{format_address(address)}")
        if self.master_address != address:
            self.master_address = address
            await self.disconnect(inuse_connections=False)
        return address

    async def drop_others(self, address: Address) -> int:
        """Close every connection (idle or in use) to an address other than ``address``."""
        conns = [c for c in chain(self._available_connections, self._in_use_connections)
                 if c.is_connected and (getattr(c, "host", None), getattr(c, "port", None))
                 != address]
        results = await asyncio.gather(*(c.disconnect() for c in conns), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
        return len(conns)


class MasterWatch:
    """The process's view of the Redis master Sentinel names, and its clients' pools."""

    def __init__(self, target: SentinelTarget, metrics: Metrics | None = None, *,
                 poll_s: float = POLL_S, timeout_s: float = SENTINEL_TIMEOUT_S) -> None:
        if not target.sentinels or not target.master_name:
            raise ValueError("a Sentinel target needs sentinels and a master name")
        self.target = target
        self._metrics = metrics
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "decode_responses": True,
        }
        if target.sentinel_password:
            sentinel_kwargs["password"] = target.sentinel_password
        self._sentinel = Sentinel(list(target.sentinels),
                                  min_other_sentinels=target.min_other_sentinels,
                                  sentinel_kwargs=sentinel_kwargs)
        self._pools: list[FollowingPool] = []
        self._pins: list[MasterPin] = []
        #: the master's address as last seen (None until the first discovery)
        self.address: Address | None = None
        #: how many times the address changed (the first discovery counts as 1)
        self.generation = 0
        self._changed = asyncio.Event()
        #: set when the address changed and the pools are still to be told
        self._dirty = asyncio.Event()

    @property
    def master(self) -> str:
        """``host:port`` of the master as last seen ("" before the first discovery)."""
        return format_address(self.address)

    # -- clients -------------------------------------------------------------------------------
    def client(self, *, socket_timeout: float = 5.0, connect_timeout: float = 5.0,
               max_connections: int = 16) -> aioredis.Redis:
        """A client of the master that never retries (as ``writer_client``), on a
        :class:`FollowingPool` this watch keeps current; its owner closes it."""
        client = self._sentinel.master_for(
            self.target.master_name,
            connection_pool_class=FollowingPool,
            password=self.target.password or None,
            db=self.target.db,
            retry=None,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            max_connections=max_connections,
            timeout=connect_timeout,
            decode_responses=True,
            on_address=self.observe,
        )
        assert isinstance(client, aioredis.Redis)
        assert isinstance(client.connection_pool, FollowingPool)
        self._pools.append(client.connection_pool)
        return client

    def pin(self, client: aioredis.Redis) -> MasterPin:
        """The relay's handle on ``client`` (one of this watch's)."""
        pool = client.connection_pool
        if not isinstance(pool, FollowingPool) or pool not in self._pools:
            raise ValueError("not a client of this watch")
        handle = MasterPin(self, pool)
        self._pins.append(handle)
        return handle

    # -- discovery -----------------------------------------------------------------------------
    async def discover(self) -> Address:
        """Ask the Sentinels now; raises ``RedisUnavailable`` when none names an up master."""
        try:
            async with asyncio.timeout(self.timeout_s * (len(self.target.sentinels) + 1)):
                found = await self._sentinel.discover_master(self.target.master_name)
        except MasterNotFoundError as exc:
            raise RedisUnavailable(f"no Redis master: {exc}") from exc
        except (RedisError, OSError, TimeoutError) as exc:
            raise RedisUnavailable(f"Sentinel not answering: {exc!r}") from exc
        address = (str(found[0]), int(found[1]))
        self.observe(address)
        return address

    def observe(self, address: Address) -> None:
        """An address Sentinel gave (to the poll or to a pool): record a change."""
        if address == self.address:
            return
        old, self.address = self.address, address
        self.generation += 1
        if self._metrics is not None:
            if old is not None:
                self._metrics.redis_failovers.inc()
                with contextlib.suppress(KeyError):
                    self._metrics.redis_master.remove(format_address(old))
            self._metrics.redis_master.labels(format_address(address)).set(1)
        if old is None:
            log.info("redis master %s (Sentinel %s)", format_address(address),
                     self.target.master_name)
        else:
            log.warning("redis master changed from %s to %s (Sentinel %s)",
                        format_address(old), format_address(address), self.target.master_name)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        self._dirty.set()
        for handle in self._pins:
            handle.observe(address)

    async def wait_change(self, since: int, timeout: float) -> bool:
        """Wait up to ``timeout`` for a generation after ``since``; True if there is one."""
        if self.generation != since:
            return True
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await changed.wait()
        return self.generation != since

    async def run(self) -> None:
        """The owned task: poll Sentinel, and close every pool's connections to an old master
        when the address changes. Never returns; failures are logged and retried."""
        failing = False
        while True:
            try:
                await self.discover()
                if failing:
                    log.info("Sentinel answers again: master %s", self.master)
                failing = False
            except RedisUnavailable as exc:
                if not failing:
                    log.warning("redis master unknown: %s", exc)
                failing = True
            if self._dirty.is_set():
                self._dirty.clear()
                await self._drop_old_connections()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):
                    await self._dirty.wait()

    async def _drop_old_connections(self) -> None:
        address = self.address
        if address is None:
            return
        for pool in list(self._pools):
            try:
                async with asyncio.timeout(self.timeout_s):
                    dropped = await pool.drop_others(address)
            except (RedisError, OSError, TimeoutError) as exc:
                log.info("closing connections to the old redis master failed: %r", exc)
                continue
            if dropped:
                log.info("closed %d connections to an old redis master", dropped)

    async def aclose(self) -> None:
        """Close the Sentinel clients (the master clients are closed by their owners)."""
        await self._sentinel.aclose()


class MasterPin:
    """The relay's hold on one client's master: pinned at each pass, checked before appends."""

    def __init__(self, watch: MasterWatch, pool: FollowingPool) -> None:
        self._watch = watch
        self._pool = pool
        #: the watch's generation when the pin was last set
        self.generation = 0
        #: the generation a back-off last returned early for (once per change)
        self._woken_for = 0
        #: set once the watch sees a master other than the pinned one (new for each pin)
        self.moved = asyncio.Event()

    @property
    def address(self) -> str:
        return format_address(self._pool.pinned)

    async def pin(self) -> str:
        """Pin the client to the master Sentinel names now (closing connections elsewhere);
        returns its ``host:port``. Raises ``RedisUnavailable`` when there is none."""
        self._pool.pinned = None  # discovery below must not refuse the new address
        address = await self._watch.discover()
        self.generation = self._watch.generation
        self._pool.pinned = address
        self._pool.master_address = address
        self.moved = asyncio.Event()
        self.observe(self._watch.address or address)
        await self._pool.drop_others(address)
        return format_address(address)

    def observe(self, address: Address) -> None:
        """The watch saw ``address``: another master than the pinned one sets ``moved``."""
        if self._pool.pinned is not None and address != self._pool.pinned:
            self.moved.set()

    def check(self) -> None:
        """Raise ``RedisUnavailable`` if the master moved since the pin."""
        pinned = self._pool.pinned
        current = self._watch.address
        if pinned is None or (current is not None and current != pinned):
            raise RedisUnavailable(f"the Redis master moved from {format_address(pinned)} to "
                                   f"{format_address(current)}: checking the new one first")

    async def sleep(self, delay: float) -> None:
        """Sleep ``delay`` seconds, or less if the master changes meanwhile; not at all,
        once, after a change the pin has not caught up with (a new master to try now)."""
        current = self._watch.generation
        if current != self._woken_for:
            self._woken_for = current
            if current != self.generation:
                return
        await self._watch.wait_change(current, delay)
