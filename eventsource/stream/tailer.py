"""``StreamTailer``: the process's one blocking reader of the stream, and its subscriptions.

Why apart: one ``XREAD BLOCK`` per subscriber would starve the shared pool, so one reader per
process fans entries out to bounded queues (:class:`Subscription`). It owns its task and its
client's blocking connection; a subscription receives exactly the entries with ids strictly
greater than its ``start_id`` (and its ``after_id``), in stream order, or an error that ends it.
A subscriber that falls ``queue_max`` entries behind is closed with ``overflowed``.

Under Sentinel (``master``, with ``hold_s``), a Redis failure does not end the subscriptions at
once: a failover takes seconds, and ending every WatchEvents stream would send every client
back through a reconnection for nothing. The tailer holds them for up to ``hold_s`` while it
retries from its cursor (at once when the watch names a new master), and only then ends them
as before. A new master's stream may end below the cursor for a moment (entries the old one
had not yet passed to a replica, which the relay appends again with the same ids): within the
hold that is not taken for a replaced stream, and the tailer waits at its cursor, so nothing
it delivered is delivered twice and nothing after it is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ReadOnlyError, RedisError, ResponseError

from eventsource.errors import Unavailable
from eventsource.events import GAP_TYPE, StreamEntry, rfc3339
from eventsource.stream.clients import MAX_BLOCK_S, reraise_swallowed_cancel, tailer_client
from eventsource.stream.entries import ZERO_ID, id_key, raw_entries
from eventsource.stream.errors import (
    RedisUnavailable,
    StreamError,
    StreamReset,
    SubscriptionClosed,
    SubscriptionOverflow,
)
from eventsource.stream.eventlog import RedisEventLog
from eventsource.stream.sentinel import MasterWatch

log = logging.getLogger("persys.stream")

#: the end marker a subscription's queue receives after its last entry
_CLOSED = object()


class Subscription:
    """Entries after ``start_id`` from a :class:`StreamTailer`, through a bounded queue.

    ``get()`` returns entries in stream order. It raises the error that ended the
    subscription once the entries received before it are consumed (``RedisUnavailable`` when
    the tailer lost Redis, ``StreamReset`` when the stream was replaced,
    ``SubscriptionClosed`` after ``close()``), except ``SubscriptionOverflow``, which is raised
    at once: an overflowed subscriber is too slow to be served its backlog.
    """

    def __init__(
        self, tailer: StreamTailer, *, start_id: str, after_id: str | None, queue_max: int,
        accept: Callable[[StreamEntry], bool] | None = None, node_id: str = "",
    ) -> None:
        self._tailer = tailer
        #: when set, only this node's entries (and gaps) are offered: see StreamTailer
        self.node_id = node_id
        #: the subscriber's filter, applied before queueing: a watcher of one node costs the
        #: tailer one cheap check per entry instead of a queue round trip
        self._accept = accept
        #: the tailer's cursor at subscribe time: entries strictly after it are delivered
        self.start_id = start_id
        #: the caller's cursor (if any); entries up to it are skipped as well
        self.after_id = after_id
        self.queue_max = queue_max
        floor = id_key(start_id)
        if after_id:
            floor = max(floor, id_key(after_id))
        self._floor = floor
        # one spare slot so the end marker always fits
        self._queue: asyncio.Queue[StreamEntry | object] = asyncio.Queue(maxsize=queue_max + 1)
        self._error: BaseException | None = None
        #: set when the subscriber fell ``queue_max`` entries behind and was dropped
        self.overflowed = False
        #: the id of the last entry handed to the subscriber
        self.last_id: str | None = None

    @property
    def closed(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _offer(self, entry: StreamEntry, key: tuple[int, int]) -> None:
        if self._error is not None:
            return
        if key <= self._floor:
            return
        if self._accept is not None and not self._accept(entry):
            return
        if self._queue.qsize() >= self.queue_max:
            self.overflowed = True
            self._end(SubscriptionOverflow(f"subscriber fell {self.queue_max} entries behind"))
            return
        self._queue.put_nowait(entry)

    def _end(self, error: BaseException) -> None:
        if self._error is not None:
            return
        self._error = error
        self._tailer._forget(self)
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(_CLOSED)

    async def get(self) -> StreamEntry:
        """The next entry (wrap in ``asyncio.timeout`` to bound the wait; that is safe).

        Raises:
            SubscriptionOverflow, RedisUnavailable, StreamReset, SubscriptionClosed: the end.
        """
        if self.overflowed or (self._queue.empty() and self._error is not None):
            assert self._error is not None
            raise self._error
        item = await self._queue.get()
        if self.overflowed or item is _CLOSED:
            assert self._error is not None
            raise self._error
        assert isinstance(item, StreamEntry)
        self.last_id = item.stream_id
        return item

    def close(self) -> None:
        """Unsubscribe; pending ``get()`` calls end with ``SubscriptionClosed``."""
        self._end(SubscriptionClosed("subscription closed"))

    def __aiter__(self) -> AsyncIterator[StreamEntry]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamEntry]:
        while True:
            try:
                yield await self.get()
            except SubscriptionClosed:
                return

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def unread_gap(cursor: str, cursor_key: tuple[int, int],
               entry: StreamEntry) -> StreamEntry | None:
    """A synthetic ``EventsGap`` when ``entry`` says (``prev``) that its predecessor is newer
    than the last entry the tailer read: entries were deleted or trimmed before it read them
    (the key deleted or flushed, Redis evicting it, or a tailer further behind than
    retention). Its id is that predecessor's, so a subscriber resuming from it loses nothing
    more; the relay writes such gaps only for losses it can see."""
    if not entry.prev:
        return None
    try:
        prev_key = id_key(entry.prev)
    except ValueError:
        return None
    if prev_key <= cursor_key:
        return None
    now = datetime.now(UTC)
    return StreamEntry(
        stream_id=entry.prev, event_id="", type=GAP_TYPE, workload_id="", node_id="",
        reason="events before this one are no longer in the stream",
        timestamp=rfc3339(now),
        details={"from": cursor, "to": entry.prev, "cause": "gone-before-read"},
        revision=prev_key[0], seq=prev_key[1], ts=int(now.timestamp() * 1000), prev=cursor,
    )


class StreamTailer:
    """The process's one ``XREAD BLOCK`` reader of a stream, fanning out to subscriptions.

    It reads only while someone is subscribed. The first subscriber fixes the cursor at the
    stream's current top (``$`` semantics, as a concrete id); later subscribers join at the
    cursor the tailer has reached. On a Redis error every current subscriber is ended with
    :class:`RedisUnavailable` and the tailer retries every ``retry_delay`` seconds from its
    last id, so subscribers that join meanwhile continue without a gap. If the stream is
    replaced under the cursor (renamed aside, recreated), subscribers end with
    :class:`StreamReset` and the cursor restarts at the new top.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        stream_key: str,
        *,
        block_s: float = MAX_BLOCK_S,
        count: int = 1000,
        queue_max: int = 10_000,
        retry_delay: float = 1.0,
        owns_client: bool = False,
        hold_s: float = 0.0,
        master: MasterWatch | None = None,
    ) -> None:
        if not 0 < block_s <= MAX_BLOCK_S:
            raise ValueError(f"block_s must be in (0, {MAX_BLOCK_S}]")
        socket_timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
        if socket_timeout is not None and float(socket_timeout) <= block_s:
            raise ValueError(
                f"the tailer's client needs socket_timeout > block_s ({socket_timeout} <= "
                f"{block_s}): use tailer_client()"
            )
        self._client = client
        self.stream_key = stream_key
        self.block_s = block_s
        self.count = count
        self.queue_max = queue_max
        self.retry_delay = retry_delay
        self._owns_client = owns_client
        self._log = RedisEventLog(client, stream_key, op_timeout=block_s + 10.0)
        self._subs: set[Subscription] = set()
        #: the subscriptions of one node's entries, by node, and those of any node's
        self._by_node: dict[str, set[Subscription]] = {}
        self._any_node: set[Subscription] = set()
        self._cursor: str | None = None
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        #: how many times a Redis error ended the subscribers (for tests and /health)
        self.disconnects = 0
        #: how long subscribers are kept across Redis errors (0: ended at the first)
        self.hold_s = hold_s
        self._master = master
        #: loop time of the first error of the current outage (None: reading)
        self._down_since: float | None = None
        #: until when a stream top below the cursor is a failover's tail, not a replacement
        self._behind_until = 0.0
        #: the watch's generation the last retry was made for
        self._seen_generation = master.generation if master is not None else 0

    @classmethod
    def from_url(
        cls, url: str, stream_key: str, *, block_s: float = MAX_BLOCK_S, **kwargs: Any
    ) -> StreamTailer:
        """A tailer with its own correctly configured client, closed by ``aclose()``."""
        client = tailer_client(url, block_s=block_s)
        return cls(client, stream_key, block_s=block_s, owns_client=True, **kwargs)

    @classmethod
    def following(cls, master: MasterWatch, stream_key: str, *, block_s: float = MAX_BLOCK_S,
                  hold_s: float = 60.0, **kwargs: Any) -> StreamTailer:
        """A tailer of the master ``master`` follows, with its own client (closed by
        ``aclose()``), holding its subscribers across a failover of up to ``hold_s``."""
        client = master.client(socket_timeout=block_s + 5.0, connect_timeout=5.0,
                               max_connections=4)
        return cls(client, stream_key, block_s=block_s, owns_client=True, hold_s=hold_s,
                   master=master, **kwargs)

    @property
    def cursor(self) -> str | None:
        """The id the tailer has read up to (None while idle)."""
        return self._cursor

    @property
    def subscriber_count(self) -> int:
        return len(self._subs)

    async def start(self) -> None:
        if self._task is not None:
            return
        if self._closed:
            raise RuntimeError("tailer closed")
        self._task = asyncio.create_task(self._run(), name=f"stream-tailer:{self.stream_key}")

    async def aclose(self) -> None:
        """End every subscription, cancel and await the reader, close an owned client."""
        self._closed = True
        self._wake.set()  # an idle reader wakes up, sees the flag and returns
        for sub in list(self._subs):
            sub._end(SubscriptionClosed("tailer closed"))
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            _, pending = await asyncio.wait({task}, timeout=0.5)
            if pending:
                # redis-py 8.1 may sit out a cancelled XREAD BLOCK until the server answers;
                # closing the sockets ends the read now
                await self._client.connection_pool.disconnect()
            await asyncio.gather(task, return_exceptions=True)
        if self._owns_client:
            await self._client.aclose()

    async def subscribe(
        self, after_id: str | None = None, *, queue_max: int | None = None,
        accept: Callable[[StreamEntry], bool] | None = None, node_id: str = "",
    ) -> Subscription:
        """A subscription to the entries after the tailer's cursor (and after ``after_id``)
        that ``accept`` (if given) lets through.

        ``node_id`` narrows it to that node's entries, and ``EventsGap`` entries, before
        ``accept`` runs. Why: subscriptions are indexed by it, so an entry costs the tailer
        only its own node's watchers and the unfiltered ones, not one check per watcher of
        every other node (a dashboard per node of a 5,000-node fleet).

        The caller reads history up to ``subscription.start_id`` with ``RedisEventLog.range``
        and then consumes the subscription: no gap, no duplicate.

        Raises:
            RedisUnavailable: the tailer is idle and the stream's top could not be read.
        """
        if self._closed or self._task is None:
            raise RuntimeError("tailer not running")
        if self._task.done():
            raise RedisUnavailable("event stream tailer has stopped")
        async with self._lock:
            if self._cursor is None:
                top = await self._log.top()
                self._cursor = top.stream_id if top is not None else ZERO_ID
            sub = Subscription(
                self,
                start_id=self._cursor,
                after_id=after_id,
                queue_max=queue_max if queue_max is not None else self.queue_max,
                accept=accept,
                node_id=node_id,
            )
            self._subs.add(sub)
            if node_id:
                self._by_node.setdefault(node_id, set()).add(sub)
            else:
                self._any_node.add(sub)
            self._wake.set()
        return sub

    def _forget(self, sub: Subscription) -> None:
        self._subs.discard(sub)
        self._any_node.discard(sub)
        same_node = self._by_node.get(sub.node_id)
        if same_node is not None:
            same_node.discard(sub)
            if not same_node:
                del self._by_node[sub.node_id]

    def _end_all(self, error: BaseException) -> None:
        for sub in list(self._subs):
            sub._end(error)

    async def _run(self) -> None:
        """The owned task; if it ever fails, its subscribers learn it instead of hanging."""
        try:
            await self._read_and_fan_out()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("stream tailer %s failed", self.stream_key)
            self._end_all(RedisUnavailable(f"event stream tailer failed: {exc!r}"))
            raise

    async def _read_and_fan_out(self) -> None:
        block_ms = int(self.block_s * 1000)
        while not self._closed:
            if not self._subs:
                # idle: the next first subscriber starts at the top again
                self._cursor = None
                self._wake.clear()
                await self._wake.wait()
                continue
            cursor = self._cursor
            assert cursor is not None
            try:
                async with asyncio.timeout(self.block_s + 10.0):
                    raw = await self._client.xread(
                        {self.stream_key: cursor}, count=self.count, block=block_ms
                    )
                    reraise_swallowed_cancel()
                if self._closed:
                    return
                if self._down_since is not None:
                    log.info("stream tailer %s reads again from %s", self.stream_key, cursor)
                    self._down_since = None
                entries = self._parse(raw)
                if not entries:
                    await self._check_reset(cursor)
                    continue
            except (RedisError, OSError, TimeoutError, StreamError, Unavailable) as exc:
                self.disconnects += 1
                if not self._hold(exc, cursor):
                    log.warning("stream tailer %s: %r; retrying from %s", self.stream_key, exc,
                                cursor)
                    self._end_all(RedisUnavailable(f"event stream unavailable: {exc!r}"))
                await self._pause()
                continue
            # fan out without awaiting, so a subscribe() sees either none or all of this read;
            # iterate over copies, since an offer that overflows a subscription forgets it
            # (an ended subscription ignores later offers)
            everyone = list(self._subs)
            any_node = list(self._any_node)
            previous = id_key(cursor)
            for entry in entries:
                key = id_key(entry.stream_id)
                lost = unread_gap(cursor, previous, entry)
                if lost is not None:
                    log.error("stream %s: entries after %s up to %s are gone before this "
                              "replica read them; subscribers get an EventsGap",
                              self.stream_key, lost.details["from"], lost.details["to"])
                    lost_key = id_key(lost.stream_id)
                    for sub in everyone:
                        sub._offer(lost, lost_key)
                previous, cursor = key, entry.stream_id
                if entry.type == GAP_TYPE:
                    targets: Iterable[Subscription] = everyone
                else:
                    same_node = self._by_node.get(entry.node_id)
                    targets = any_node if not same_node else [*any_node, *same_node]
                for sub in targets:
                    sub._offer(entry, key)
            self._cursor = entries[-1].stream_id

    @staticmethod
    def _parse(raw: object) -> list[StreamEntry]:
        """XREAD's answer (RESP2 list of ``[key, messages]``, or a RESP3 mapping)."""
        if not raw:
            return []
        if isinstance(raw, Mapping):
            batches = list(raw.values())
        else:
            assert isinstance(raw, list | tuple)
            batches = [item[1] for item in raw]
        return [entry.decode() for batch in batches for entry in raw_entries(batch)]

    def _hold(self, exc: BaseException, cursor: str) -> bool:
        """Whether the subscribers are kept across this error (within ``hold_s`` of the
        outage's first error); a top below the cursor is expected for as long."""
        if self.hold_s <= 0 or isinstance(exc, StreamError) or (
                isinstance(exc, ResponseError) and not isinstance(exc, ReadOnlyError)):
            return False  # not Redis away: the stream itself is wrong, as without the hold
        now = asyncio.get_running_loop().time()
        self._behind_until = now + self.hold_s
        if self._down_since is None:
            self._down_since = now
            log.warning("stream tailer %s: %r; holding %d subscribers up to %.0fs while "
                        "retrying from %s", self.stream_key, exc, len(self._subs), self.hold_s,
                        cursor)
            return True
        if now - self._down_since < self.hold_s:
            log.debug("stream tailer %s: still failing: %r", self.stream_key, exc)
            return True
        return False

    async def _pause(self) -> None:
        """The retry delay; none, once, when the watch names a master not yet tried, and cut
        short by a failover."""
        master = self._master
        if master is None:
            await asyncio.sleep(self.retry_delay)
            return
        if master.generation != self._seen_generation:
            self._seen_generation = master.generation
            return
        await master.wait_change(self._seen_generation, self.retry_delay)

    async def _check_reset(self, cursor: str) -> None:
        """After an idle block: a top below the cursor means the stream was replaced (except
        just after a failover held, where it is the tail the relay is appending again)."""
        top = await self._log.top()
        top_id = top.stream_id if top is not None else ZERO_ID
        if id_key(top_id) >= id_key(cursor):
            self._behind_until = 0.0
            return
        if asyncio.get_running_loop().time() < self._behind_until:
            log.info("stream %s: the new master's top %s is below the cursor %s: waiting "
                     "for the relay to append the rest again", self.stream_key, top_id, cursor)
            return
        if id_key(top_id) < id_key(cursor):
            log.warning(
                "stream %s was replaced (top %s < cursor %s); subscribers restart",
                self.stream_key, top_id, cursor,
            )  # fmt: skip
            self._end_all(StreamReset(f"stream {self.stream_key} was replaced"))
            self._cursor = top_id
