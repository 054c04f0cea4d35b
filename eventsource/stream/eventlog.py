"""``RedisEventLog``: append, read, trim and move aside one stream key.

Why apart: the writer side of the log, through a writer client owned by the caller. Appends use
explicit ids and no client retries, so they are idempotent and retried only by the caller (the
relay); every call is bounded by ``op_timeout`` and its failures are translated here only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.sentinel import MasterNotFoundError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from eventsource.events import StreamEntry
from eventsource.stream.clients import reraise_swallowed_cancel
from eventsource.stream.entries import RawEntry, id_key, next_id, raw_entries
from eventsource.stream.errors import (
    NothingSent,
    RedisUnavailable,
    StreamError,
    StreamIdConflict,
    StreamWrongType,
)
from eventsource.stream.replicas import ReplicaWait
from eventsource.stream.sentinel import MasterMoved

log = logging.getLogger("persys.stream")


def _never_connected(exc: BaseException) -> bool:
    """Whether a failed round trip never had a connection: nothing of it reached Redis."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, MasterNotFoundError | MasterMoved | ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What one ``append_batch`` did: entries Redis took now, and ids it already held."""

    added: int
    present: frozenset[str]


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
        except ReadOnlyError as exc:
            # a master demoted to a replica under us (a failover): Redis is unavailable here
            raise RedisUnavailable(f"redis {what} on {self.key}: {exc!r}") from exc
        except ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                raise StreamWrongType(f"{self.key} is not a stream: {exc}") from exc
            raise StreamError(f"redis {what} on {self.key}: {exc}") from exc
        except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError) as exc:
            raise RedisUnavailable(f"redis {what} on {self.key}: {exc!r}") from exc
        except RedisError as exc:
            raise RedisUnavailable(f"redis {what} on {self.key}: {exc!r}") from exc

    # -- appending ----------------------------------------------------------------------------
    async def append_batch(self, entries: Sequence[tuple[str, str]], *, maxlen: int,
                           wait: ReplicaWait | None = None) -> AppendResult:
        """XADD ``(id, data)`` pairs in one pipeline, in order, with ``MAXLEN ~ maxlen``.

        Idempotent: an id that Redis rejects as "equal or smaller" is accepted only when
        ``XRANGE id id`` holds the same ``eventId`` (a previous attempt already appended it),
        or when it lies below the oldest entry (appended, then trimmed by retention).

        With ``wait``, the pipeline ends with ``WAIT`` for the replicas it asks for
        (``eventsource.stream.replicas``): the append is done only once they hold it.

        Raises:
            StreamIdConflict: an id is taken by another event, or lies between the oldest
                entry and the top but is absent (a stream not written from our outbox).
            ReplicasBehind: appended, but fewer replicas than required hold it yet.
            NothingSent: Redis could not be reached at all; nothing was appended.
            RedisUnavailable: Redis failed; some entries may have been appended, which a retry
                of the same batch recognises.
        """
        if not entries:
            return AppendResult(added=0, present=frozenset())
        needed = 0
        try:
            if wait is not None:
                async with self._call("INFO"):
                    needed = await wait.needed(self._client)
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
                if needed:
                    pipe.execute_command("WAIT", needed, wait.timeout_ms if wait else 0)
                results = await pipe.execute(raise_on_error=False)
        except RedisUnavailable as exc:
            if _never_connected(exc):
                raise NothingSent(str(exc)) from exc
            raise
        acked = results.pop() if needed else None
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
        if wait is not None and needed:
            if len(rejected) == len(entries):
                # nothing written on this connection: WAIT would count an older offset
                acked = await self._sync_replicas(needed, wait.timeout_ms)
            if not isinstance(acked, int):
                raise RedisUnavailable(f"redis WAIT on {self.key}: {acked!r}")
            async with self._call("INFO"):
                await wait.judge(self._client, acked, needed)
        return AppendResult(added=len(entries) - len(rejected),
                            present=frozenset(stream_id for stream_id, _ in rejected))

    async def _sync_replicas(self, needed: int, timeout_ms: int) -> object:
        """WAIT after a write that covers everything before it (a PUBLISH, propagated to the
        replicas like a write): the answer for entries another connection appended."""
        async with self._call("WAIT"):
            pipe = self._client.pipeline(transaction=False)
            pipe.publish(f"{self.key}:relay-sync", "1")
            pipe.execute_command("WAIT", needed, timeout_ms)
            results = await pipe.execute(raise_on_error=False)
        return results[-1]

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
        oldest = raw_entries(first_raw)
        for (stream_id, data), raw in zip(rejected, found, strict=True):
            ours = RawEntry(stream_id, {"data": data}).event_id
            present = raw_entries(raw)
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
        entries = raw_entries(raw)
        return entries[0] if entries else None

    async def last_entry(self) -> StreamEntry | None:
        top = await self.top()
        return top.decode() if top is not None else None

    async def first_entry(self) -> StreamEntry | None:
        async with self._call("XRANGE"):
            raw = await self._client.xrange(self.key, "-", "+", count=1)
        entries = raw_entries(raw)
        return entries[0].decode() if entries else None

    async def range_raw(self, after_id: str | None, count: int) -> list[RawEntry]:
        """Up to ``count`` entries with ids strictly greater than ``after_id``, ascending."""
        start = f"({after_id}" if after_id else "-"
        async with self._call("XRANGE"):
            raw = await self._client.xrange(self.key, start, "+", count=count)
        return raw_entries(raw)

    async def range(self, after_id: str | None, count: int) -> list[StreamEntry]:
        """Up to ``count`` entries after ``after_id`` (exclusive; None = from the head)."""
        return [entry.decode() for entry in await self.range_raw(after_id, count)]

    async def before(self, before_id: str, count: int) -> list[StreamEntry]:
        """Up to ``count`` entries with ids strictly less than ``before_id``, ascending."""
        async with self._call("XREVRANGE"):
            raw = await self._client.xrevrange(self.key, f"({before_id}", "-", count=count)
        return [entry.decode() for entry in reversed(raw_entries(raw))]

    async def newest(self, count: int) -> list[StreamEntry]:
        """The newest ``count`` entries, in ascending order."""
        async with self._call("XREVRANGE"):
            raw = await self._client.xrevrange(self.key, "+", "-", count=count)
        return [entry.decode() for entry in reversed(raw_entries(raw))]

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
