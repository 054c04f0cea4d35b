"""The Redis stream log of events: append, range, trim, and one shared tail per process.

Why it exists: ``scheduler:events`` is the durable, ordered log that ListEvents and WatchEvents
serve (ARCHITECTURE section 3). Two Redis pitfalls shape it (STYLE 4.2): redis-py's default
retries would resend an XADD that may already have been applied, and one ``XREAD BLOCK`` per
subscriber would starve the shared pool. So appends use explicit ids on a writer client without
retries, and there is one blocking reader per process that fans entries out to bounded queues.

Invariants:

* Every entry we write has the explicit id ``"<revision>-<seq>"`` and one field ``data`` whose
  JSON carries ``eventId``. An XADD rejected as "equal or smaller than the target stream top
  item" counts as done only if ``XRANGE id id`` holds an entry with the same ``eventId``;
  anything else raises :class:`StreamIdConflict`. Appends are therefore idempotent and are
  retried only by the caller, never blindly by the client.
* Retention is MAXLEN ~ on XADD plus :meth:`RedisEventLog.trim_by_age` (``XTRIM MINID``). The
  key never gets an EXPIRE, and trimming never removes the newest entry, so "top below the
  relay's mark" always means that Redis lost data.
* Redis failures surface as :class:`RedisUnavailable` (a subclass of ``errors.Unavailable``);
  other stream trouble as :class:`StreamError` subclasses. Every call is bounded by
  ``op_timeout`` on top of the client's socket timeouts.
* :class:`StreamTailer` owns its task and its client's blocking connection; a
  :class:`Subscription` receives exactly the entries with ids strictly greater than its
  ``start_id`` (and its ``after_id``), in stream order, or an error that ends it. Its queue is
  bounded: a subscriber that falls ``queue_max`` entries behind is closed with ``overflowed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from eventsource.errors import StoreError, Unavailable
from eventsource.events import GAP_TYPE, StreamEntry, parse_stream_id, rfc3339

log = logging.getLogger("persys.stream")

__all__ = [
    "ZERO_ID",
    "RawEntry",
    "RedisEventLog",
    "RedisUnavailable",
    "StreamError",
    "StreamIdConflict",
    "StreamReset",
    "StreamTailer",
    "StreamWrongType",
    "Subscription",
    "SubscriptionClosed",
    "SubscriptionOverflow",
    "format_id",
    "id_key",
    "next_id",
    "reraise_swallowed_cancel",
    "tailer_client",
    "writer_client",
]

#: the id before every real entry (Redis rejects XADD of 0-0 itself)
ZERO_ID = "0-0"
#: the longest block of one XREAD (STYLE 4.2: longer blocks meet the client's socket timeout)
MAX_BLOCK_S = 5.0


# -- errors ----------------------------------------------------------------------------------


class RedisUnavailable(Unavailable):
    """Redis could not be reached or did not answer in time."""


class StreamError(StoreError):
    """The stream is not in the state our ids assume."""


class StreamIdConflict(StreamError):
    """An id we append is taken (or was passed) by an entry that is not the same event."""


class StreamWrongType(StreamError):
    """The stream key holds something that is not a stream."""


class StreamReset(StreamError):
    """The stream was replaced (moved aside or recreated) under a tailer's cursor."""


class SubscriptionClosed(StoreError):
    """The subscription was closed by its owner or by the tailer's shutdown."""


class SubscriptionOverflow(StoreError):
    """The subscriber fell too far behind and was dropped (answer RESOURCE_EXHAUSTED)."""


# -- ids and raw entries ----------------------------------------------------------------------


def id_key(stream_id: str) -> tuple[int, int]:
    """A stream id as a sortable tuple (``"12-3"`` -> ``(12, 3)``)."""
    return parse_stream_id(stream_id)


def format_id(key: tuple[int, int]) -> str:
    return f"{key[0]}-{key[1]}"


def next_id(stream_id: str) -> str:
    """The smallest id strictly greater than ``stream_id`` (same millisecond part)."""
    ms, seq = id_key(stream_id)
    return f"{ms}-{seq + 1}"


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _fields(raw: object) -> dict[str, str]:
    if isinstance(raw, Mapping):
        return {_text(k): _text(v) for k, v in raw.items()}
    if isinstance(raw, list | tuple):  # RESP2 flat field list, should a client hand it over
        items = list(raw)
        return {_text(items[i]): _text(items[i + 1]) for i in range(0, len(items) - 1, 2)}
    return {}


@dataclass(frozen=True, slots=True)
class RawEntry:
    """A stream entry as Redis holds it, before we decide whether it is ours."""

    stream_id: str
    fields: Mapping[str, str]

    @property
    def data(self) -> str | None:
        return self.fields.get("data")

    def _body(self) -> dict[str, Any] | None:
        data = self.data
        if data is None:
            return None
        try:
            body = json.loads(data)
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    @property
    def event_id(self) -> str | None:
        """Our ``eventId``; None for entries we did not write (e.g. the Go version's)."""
        body = self._body()
        if body is None:
            return None
        value = body.get("eventId")
        return value if isinstance(value, str) and value else None

    @property
    def is_ours(self) -> bool:
        return self.event_id is not None

    def decode(self) -> StreamEntry:
        """The entry as ListEvents/WatchEvents serve it; tolerant of foreign or broken data."""
        body = self._body()
        if body is None:
            return StreamEntry(
                stream_id=self.stream_id, event_id="", type="", workload_id="", node_id="",
                reason="", timestamp="", details={}, revision=0, seq=0, ts=0, prev="",
            )  # fmt: skip
        try:
            return StreamEntry.from_body(self.stream_id, body)
        except (ValueError, TypeError, AttributeError):
            return StreamEntry(
                stream_id=self.stream_id, event_id=str(body.get("eventId") or ""),
                type=str(body.get("type", "")), workload_id="", node_id="", reason="",
                timestamp="", details={}, revision=0, seq=0, ts=0, prev="",
            )  # fmt: skip

    def ts(self) -> int:
        """The commit time in ms, 0 when absent (such entries count as old)."""
        body = self._body()
        if body is None:
            return 0
        try:
            return int(body.get("ts", 0))
        except (TypeError, ValueError):
            return 0


def _entries(raw: object) -> list[RawEntry]:
    out: list[RawEntry] = []
    if not raw:
        return out
    assert isinstance(raw, list | tuple)
    for item in raw:
        stream_id, fields = item[0], item[1]
        out.append(RawEntry(_text(stream_id), _fields(fields)))
    return out


def reraise_swallowed_cancel() -> None:
    """Re-raise a cancellation that an awaited call swallowed.

    Measured with redis-py 8.1.0: cancelling a task blocked in ``XREAD BLOCK`` can make the
    call return a normal (empty) answer while ``task.cancelling()`` stays 1, so the task would
    carry on as if never cancelled. Every Redis round trip here ends with this check; inside an
    ``asyncio.timeout`` block the re-raised error becomes the timeout, as it should. The leader
    loop checks it on every pass too: a cancellation that arrived while leadership was being
    recorded was swallowed the same way, and the loop outlived shutdown.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# -- clients ----------------------------------------------------------------------------------


def redis_url(addr: str, password: str, db: int) -> str:
    """``redis://`` for ``host:port`` with ``password`` quoted: one from ``openssl rand
    -base64`` holds '/', and '%' must stay itself (go-redis takes the password as is)."""
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{addr}/{db}"


def writer_client(
    url: str,
    *,
    socket_timeout: float = 5.0,
    connect_timeout: float = 5.0,
    max_connections: int = 16,
) -> aioredis.Redis:
    """A command client that never retries (a retried XADD could duplicate an append).

    Its pool makes a caller wait (up to ``connect_timeout``) for one of ``max_connections``
    instead of failing at once: 100 WatchEvents clients opening together each read the
    stream's top, and the default pool answered the 17th with MaxConnectionsError.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        retry=None,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        max_connections=max_connections,
        timeout=connect_timeout,
        decode_responses=True,
    )
    return aioredis.Redis.from_pool(pool)


def tailer_client(url: str, *, block_s: float = MAX_BLOCK_S) -> aioredis.Redis:
    """The one blocking-read client of a process: socket timeout above the block, no retries."""
    if not 0 < block_s <= MAX_BLOCK_S:
        raise ValueError(f"block_s must be in (0, {MAX_BLOCK_S}]")
    return aioredis.Redis.from_url(
        url,
        retry=None,
        socket_timeout=block_s + 5.0,
        socket_connect_timeout=5.0,
        max_connections=4,
        decode_responses=True,
    )


# -- the log ----------------------------------------------------------------------------------


class RedisEventLog:
    """Appends, reads and trims one stream key through a writer client owned by the caller."""

    def __init__(self, client: aioredis.Redis, key: str, *, op_timeout: float = 10.0) -> None:
        self._client = client
        self.key = key
        self.op_timeout = op_timeout

    @contextlib.asynccontextmanager
    async def _call(self, what: str) -> AsyncIterator[None]:
        """Bound one Redis round trip and translate its failures (the only place that does)."""
        try:
            async with asyncio.timeout(self.op_timeout):
                yield
                reraise_swallowed_cancel()
        except ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                raise StreamWrongType(f"{self.key} is not a stream: {exc}") from exc
            raise StreamError(f"redis {what} on {self.key}: {exc}") from exc
        except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError) as exc:
            raise RedisUnavailable(f"redis {what} on {self.key}: {exc!r}") from exc
        except RedisError as exc:
            raise RedisUnavailable(f"redis {what} on {self.key}: {exc!r}") from exc

    # -- appending ----------------------------------------------------------------------------
    async def append_batch(self, entries: Sequence[tuple[str, str]], *, maxlen: int) -> None:
        """XADD ``(id, data)`` pairs in one pipeline, in order, with ``MAXLEN ~ maxlen``.

        Idempotent: an id that Redis rejects as "equal or smaller" is accepted only when
        ``XRANGE id id`` holds the same ``eventId`` (a previous attempt already appended it),
        or when it lies below the oldest entry (appended, then trimmed by retention).

        Raises:
            StreamIdConflict: an id is taken by another event, or lies between the oldest
                entry and the top but is absent (a stream not written from our outbox).
            RedisUnavailable: Redis failed; some entries may have been appended, which a retry
                of the same batch recognises.
        """
        if not entries:
            return
        async with self._call("XADD"):
            pipe = self._client.pipeline(transaction=False)
            for stream_id, data in entries:
                pipe.xadd(
                    self.key,
                    {"data": data},
                    id=stream_id,
                    maxlen=maxlen if maxlen > 0 else None,
                    approximate=True,
                )
            results = await pipe.execute(raise_on_error=False)
        rejected: list[tuple[str, str]] = []
        for (stream_id, data), result in zip(entries, results, strict=True):
            if isinstance(result, ResponseError) and "equal or smaller" in str(result):
                rejected.append((stream_id, data))
            elif isinstance(result, ResponseError) and "WRONGTYPE" in str(result):
                raise StreamWrongType(f"{self.key} is not a stream: {result}")
            elif isinstance(result, BaseException):
                raise RedisUnavailable(f"redis XADD {stream_id} on {self.key}: {result!r}")
        if rejected:
            await self._confirm_present(rejected)

    async def _confirm_present(self, rejected: list[tuple[str, str]]) -> None:
        """Each rejected id holds our event, or lies below the oldest entry: retention
        trimmed it after an earlier attempt appended it (a relay that crashed before its mark
        moved re-sends up to two batches, and a small MAXLEN or a short TTL may have trimmed
        them meanwhile). Only an id above the oldest entry that holds something else, or
        nothing, is a conflict."""
        async with self._call("XRANGE"):
            pipe = self._client.pipeline(transaction=False)
            pipe.xrange(self.key, min="-", max="+", count=1)
            for stream_id, _ in rejected:
                pipe.xrange(self.key, min=stream_id, max=stream_id, count=1)
            first_raw, *found = await pipe.execute()
        oldest = _entries(first_raw)
        for (stream_id, data), raw in zip(rejected, found, strict=True):
            ours = RawEntry(stream_id, {"data": data}).event_id
            present = _entries(raw)
            theirs = present[0].event_id if present else None
            if ours is not None and theirs == ours:
                continue
            if ours is not None and not present and (
                    not oldest or id_key(stream_id) < id_key(oldest[0].stream_id)):
                log.info("stream %s: %s already appended and since trimmed", self.key,
                         stream_id)
                continue
            held = f"event {theirs}" if present else "no entry (and it is not below the oldest)"
            raise StreamIdConflict(
                f"stream {self.key}: XADD {stream_id} rejected as equal or smaller than "
                f"the top, and the stream holds {held} there instead of event {ours}"
            )

    # -- reading ------------------------------------------------------------------------------
    async def top(self) -> RawEntry | None:
        """The newest entry as stored (to tell our entries from foreign ones)."""
        async with self._call("XREVRANGE"):
            raw = await self._client.xrevrange(self.key, "+", "-", count=1)
        entries = _entries(raw)
        return entries[0] if entries else None

    async def last_entry(self) -> StreamEntry | None:
        top = await self.top()
        return top.decode() if top is not None else None

    async def first_entry(self) -> StreamEntry | None:
        async with self._call("XRANGE"):
            raw = await self._client.xrange(self.key, "-", "+", count=1)
        entries = _entries(raw)
        return entries[0].decode() if entries else None

    async def range_raw(self, after_id: str | None, count: int) -> list[RawEntry]:
        """Up to ``count`` entries with ids strictly greater than ``after_id``, ascending."""
        start = f"({after_id}" if after_id else "-"
        async with self._call("XRANGE"):
            raw = await self._client.xrange(self.key, start, "+", count=count)
        return _entries(raw)

    async def range(self, after_id: str | None, count: int) -> list[StreamEntry]:
        """Up to ``count`` entries after ``after_id`` (exclusive; None = from the head)."""
        return [entry.decode() for entry in await self.range_raw(after_id, count)]

    async def before(self, before_id: str, count: int) -> list[StreamEntry]:
        """Up to ``count`` entries with ids strictly less than ``before_id``, ascending."""
        async with self._call("XREVRANGE"):
            raw = await self._client.xrevrange(self.key, f"({before_id}", "-", count=count)
        return [entry.decode() for entry in reversed(_entries(raw))]

    async def newest(self, count: int) -> list[StreamEntry]:
        """The newest ``count`` entries, in ascending order."""
        async with self._call("XREVRANGE"):
            raw = await self._client.xrevrange(self.key, "+", "-", count=count)
        return [entry.decode() for entry in reversed(_entries(raw))]

    async def length(self) -> int:
        async with self._call("XLEN"):
            return int(await self._client.xlen(self.key))

    # -- retention ----------------------------------------------------------------------------
    async def trim_by_age(
        self, ttl_ms: int, now_ms: int, scan: int = 1000, *, max_pages: int = 100
    ) -> int:
        """Trim the entries older than ``ttl_ms`` from the head; returns how many went.

        Walks from the head in pages of ``scan`` (at most ``max_pages`` per call, so one call
        is bounded), keeps the running maximum of ``ts`` and trims with ``XTRIM MINID`` up to
        the first entry whose running maximum is younger than the TTL. Entries without ``ts``
        count as old. The newest entry is never trimmed: it anchors ``prev`` and the relay's
        "top below the mark means data loss" check.
        """
        if ttl_ms <= 0:
            return 0
        cutoff = now_ms - ttl_ms
        top = await self.top()
        if top is None:
            return 0
        top_key = id_key(top.stream_id)
        running = -1
        last_old: str | None = None
        boundary: str | None = None
        after: str | None = None
        # most calls find the head young: start with a small page and grow it
        size = min(16, scan)
        for _ in range(max_pages):
            page = await self.range_raw(after, size)
            for entry in page:
                if id_key(entry.stream_id) >= top_key:
                    boundary = entry.stream_id
                    break
                running = max(running, entry.ts())
                if running >= cutoff:
                    boundary = entry.stream_id
                    break
                last_old = entry.stream_id
            if boundary is not None or len(page) < size:
                break
            after = page[-1].stream_id
            size = min(size * 4, scan)
        if last_old is None:
            return 0
        minid = boundary if boundary is not None else next_id(last_old)
        async with self._call("XTRIM"):
            removed = await self._client.xtrim(self.key, minid=minid, approximate=False)
        return int(removed)

    async def move_aside(self, reason: str, *, now_ms: int | None = None) -> str | None:
        """Rename the stream to ``<key>:foreign:<unix ms>`` and return that name.

        Used for streams we must never append to (the Go version's ``*`` ids, or ids that
        conflict with our outbox): the data stays readable under the new name. Returns None if
        the key does not exist.
        """
        stamp = now_ms if now_ms is not None else int(time.time() * 1000)
        for attempt in range(100):
            target = f"{self.key}:foreign:{stamp + attempt}"
            try:
                async with self._call("RENAMENX"):
                    renamed = await self._client.renamenx(self.key, target)
            except StreamError as exc:
                if "no such key" in str(exc).lower():
                    return None
                raise
            if renamed:
                log.warning("stream %s moved aside to %s: %s", self.key, target, reason)
                return target
        raise StreamError(f"could not find a free name to move {self.key} aside")


# -- the tailer -------------------------------------------------------------------------------

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

    @classmethod
    def from_url(
        cls, url: str, stream_key: str, *, block_s: float = MAX_BLOCK_S, **kwargs: Any
    ) -> StreamTailer:
        """A tailer with its own correctly configured client, closed by ``aclose()``."""
        client = tailer_client(url, block_s=block_s)
        return cls(client, stream_key, block_s=block_s, owns_client=True, **kwargs)

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
                entries = self._parse(raw)
                if not entries:
                    await self._check_reset(cursor)
                    continue
            except (RedisError, OSError, TimeoutError, StreamError, Unavailable) as exc:
                self.disconnects += 1
                log.warning("stream tailer %s: %r; retrying from %s", self.stream_key, exc, cursor)
                self._end_all(RedisUnavailable(f"event stream unavailable: {exc!r}"))
                await asyncio.sleep(self.retry_delay)
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
        return [entry.decode() for batch in batches for entry in _entries(batch)]

    async def _check_reset(self, cursor: str) -> None:
        """After an idle block: a top below the cursor means the stream was replaced."""
        top = await self._log.top()
        top_id = top.stream_id if top is not None else ZERO_ID
        if id_key(top_id) < id_key(cursor):
            log.warning(
                "stream %s was replaced (top %s < cursor %s); subscribers restart",
                self.stream_key, top_id, cursor,
            )  # fmt: skip
            self._end_all(StreamReset(f"stream {self.stream_key} was replaced"))
            self._cursor = top_id
