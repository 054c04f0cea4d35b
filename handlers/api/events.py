"""ListEvents and WatchEvents over Redis (docs/architecture.md, "Events and the stream").

* ListEvents: the newest ``limit`` entries that match the filters (filters before the limit), in
  ascending order; with ``after_id``, the first ``limit`` matching entries after that cursor.
* WatchEvents: subscribe to the process's one tailer first, then replay history up to the
  subscription's start id (the newest 100 matching entries, or everything after ``after_id``),
  then follow: the seam has no gap and no duplicate, because history ends exactly where the
  subscription begins.
* Gaps are explicit: when the first retained entry after a cursor says (``prev``) that its
  predecessor is newer than the cursor, entries were trimmed, and the client first receives one
  synthetic ``EventsGap`` view; so does a watcher whose cursor is older than where it joins the
  tailer while the stream holds nothing after the cursor (the key was deleted under us), and
  the tailer offers one when a live entry's ``prev`` is an entry it never read. ``EventsGap``
  entries always pass the filters.
* A read after a cursor goes on until it has ``limit`` matches or reaches the end: a short page
  means "nothing more", except a page that ends early at ``PAGE_BYTES_MAX`` (3 MiB, under the
  4 MiB every gRPC client takes by default): read on after its last id. Watch history is sent
  page by page.
* A watch that ends because Redis went away or the client fell behind gets UNAVAILABLE or
  RESOURCE_EXHAUSTED naming the last id it was sent, to resume from.
* Under Sentinel (``catch_up_s`` > 0), just after a failover the new master's stream may end
  below an id a client was already sent (the relay is appending again what the old master had
  not passed to a replica, with the same ids). A cursor above the top, or a subscription that
  starts above it, first waits up to ``catch_up_s`` for the stream to reach it: answered at
  once, the client would get a false ``cursor-ahead`` gap and those events twice, or a history
  that misses them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from eventsource.events import StreamEntry, parse_stream_id
from eventsource.stream.entries import ZERO_ID, id_key
from eventsource.stream.errors import (
    RedisUnavailable,
    StreamError,
    StreamReset,
    SubscriptionClosed,
    SubscriptionOverflow,
)
from eventsource.stream.eventlog import RedisEventLog
from eventsource.stream.tailer import StreamTailer, Subscription
from handlers.api.convert import event_view
from projections.event_views import ViewFilter as EventFilter
from proto.persys.control.v1 import control_pb2

log = logging.getLogger("persys.events")

DEFAULT_LIMIT = 100
MAX_LIMIT = 10_000
WATCH_REPLAY = 100
PAGE = 500
#: how far back a filtered ListEvents without a cursor may scan for the newest matches before
#: it settles for fewer (a reader after a cursor reads on to the end instead)
MAX_SCAN = 200_000
#: the most a ListEvents page holds in bytes: under the 4 MiB every gRPC client accepts by
#: default, with room for the envelope. A page that would be larger ends early; the last
#: event's id is the cursor (``after_id``) to read on from.
PAGE_BYTES_MAX = 3 * 1024 * 1024
#: the longest filter value (an id or an event type)
FILTER_MAX_CHARS = 253


@dataclass(frozen=True, slots=True)
class AfterScan:
    """What a forward read after a cursor found."""

    entries: list[StreamEntry]
    #: the first retained entry after the cursor, matching or not (for the gap check)
    first: StreamEntry | None
    #: the last id read: the next read continues after it
    scanned_to: str
    #: the end of the stream (or of the range asked for) was reached
    done: bool


def gap_view(cursor: str, first: StreamEntry) -> control_pb2.SchedulerEventView | None:
    """An EventsGap view when entries between ``cursor`` and ``first`` were trimmed."""
    if not first.prev:
        return None
    try:
        if id_key(first.prev) <= id_key(cursor):
            return None
    except ValueError:
        return None
    view = control_pb2.SchedulerEventView(
        id=cursor, type="EventsGap", reason="events between the cursor and the oldest retained "
        "entry were trimmed", details={"from": cursor, "to": first.prev},
    )
    return view


def history_gap(cursor: str, first: StreamEntry | None,
                start_id: str) -> control_pb2.SchedulerEventView | None:
    """The gap a resuming watcher is owed before its history, if any.

    Besides a first entry whose ``prev`` is newer than the cursor, a stream that holds
    nothing at all after the cursor although the subscription starts later (the tailer saw an
    entry there) has lost those entries: the key was deleted or flushed under us.
    """
    if first is not None:
        return gap_view(cursor, first)
    try:
        if id_key(start_id) <= id_key(cursor):
            return None
    except ValueError:
        return None
    return control_pb2.SchedulerEventView(
        id=cursor, type="EventsGap", reason="events between the cursor and the stream's top "
        "are no longer in the stream", details={"from": cursor, "to": start_id},
    )


class EventService:
    """Serves the event RPCs from one stream."""

    def __init__(self, log_: RedisEventLog, tailer: StreamTailer, *,
                 observe_delay: Callable[[float], None] | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 catch_up_s: float = 0.0) -> None:
        self.log = log_
        self.tailer = tailer
        #: how long a read waits for the stream to reach an id after a failover (0: never)
        self._catch_up_s = catch_up_s
        #: takes each live event's timestamp-to-hand-over time in seconds (the metric
        #: event_delivery_delay_seconds); the history a watcher replays is not delivery delay
        self._observe_delay = observe_delay
        self._wall_clock = wall_clock

    @staticmethod
    async def _cursor(value: str, context: grpc.aio.ServicerContext) -> str | None:
        text = value.strip()
        if not text:
            return None
        try:
            parse_stream_id(text)
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"after_id: {text!r} is not a stream id like 123-0")
        return text

    async def _past_the_top(self, cursor: str
                            ) -> tuple[control_pb2.SchedulerEventView | None, str]:
        """An EventsGap and the stream's newest id, for a cursor above the newest entry;
        otherwise (None, cursor).

        Every id a client was sent is in the stream (the relay appends before any replica
        can deliver), so a cursor above the top means the stream lost its entries (the key
        deleted, flushed or evicted) or was replaced (moved aside after etcd was rebuilt, ids
        starting over). Taken as is, the cursor would hide every new event up to it without
        a word; the reader is told, and continues from the newest entry instead.
        """
        top_id = await self._top_reaching(cursor)
        if id_key(cursor) <= id_key(top_id):
            return None, cursor
        view = control_pb2.SchedulerEventView(
            id=top_id, type="EventsGap", reason="the cursor is ahead of the stream's newest "
            "entry: the stream lost its entries or was replaced",
            details={"from": cursor, "to": top_id, "cause": "cursor-ahead"},
        )
        return view, top_id

    async def _top_reaching(self, stream_id: str) -> str:
        """The stream's newest id; with ``catch_up_s``, once it reaches ``stream_id`` or the
        wait is over (see the module docstring)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        waited = False
        while True:
            top = await self.log.top()
            top_id = top.stream_id if top is not None else ZERO_ID
            reached = id_key(stream_id) <= id_key(top_id)
            if reached or loop.time() >= started + self._catch_up_s:
                if waited:
                    log.info("events: the stream %s %s after %.2fs (top %s)", "reached"
                             if reached else "did not reach", stream_id,
                             loop.time() - started, top_id)
                return top_id
            waited = True
            await asyncio.sleep(0.05)

    async def _newest_matching(self, flt: EventFilter, limit: int, *,
                               upto: str | None = None) -> list[StreamEntry]:
        out: list[StreamEntry] = []
        scanned = 0
        before = upto
        while len(out) < limit and scanned < MAX_SCAN:
            if before is None:
                page = await self.log.newest(PAGE)
            else:
                page = await self.log.before(before, PAGE)
            if not page:
                break
            scanned += len(page)
            for entry in reversed(page):
                if flt.matches(entry):
                    out.append(entry)
                    if len(out) >= limit:
                        break
            if len(page) < PAGE:
                break
            before = page[0].stream_id
        out.reverse()
        return out

    async def _after_matching(self, flt: EventFilter, after_id: str, limit: int,
                              *, upto: str | None = None) -> AfterScan:
        """Up to ``limit`` matching entries after ``after_id`` (and not after ``upto``).

        Reads forward page by page until it has ``limit`` matches or reaches the end (or
        ``upto``); no scan bound: a short answer must mean "nothing more", or a client paging
        with a filter would stop early. The cost is bounded by retention.
        """
        out: list[StreamEntry] = []
        first: StreamEntry | None = None
        cursor = after_id
        while len(out) < limit:
            page = await self.log.range(cursor, PAGE)
            if not page:
                return AfterScan(out, first, cursor, done=True)
            if first is None:
                first = page[0]
            for entry in page:
                if upto is not None and id_key(entry.stream_id) > id_key(upto):
                    return AfterScan(out, first, cursor, done=True)
                cursor = entry.stream_id
                if flt.matches(entry):
                    out.append(entry)
                    if len(out) >= limit:
                        break
            if len(page) < PAGE and cursor == page[-1].stream_id:
                return AfterScan(out, first, cursor, done=True)
        return AfterScan(out, first, cursor, done=False)

    async def list_events(self, req: control_pb2.ListEventsRequest,
                          context: grpc.aio.ServicerContext) -> control_pb2.ListEventsResponse:
        if req.limit < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit: must not be negative")
        limit = min(int(req.limit) or DEFAULT_LIMIT, MAX_LIMIT)
        await self._check_filters(context, req)
        flt = EventFilter(req.type.strip(), req.workload_id.strip(), req.node_id.strip())
        cursor = await self._cursor(req.after_id, context)
        resp = control_pb2.ListEventsResponse()
        try:
            if cursor is None:
                entries = await self._newest_matching(flt, limit)
            else:
                ahead, cursor = await self._past_the_top(cursor)
                if ahead is not None:
                    resp.events.append(ahead)
                scan = await self._after_matching(flt, cursor, limit)
                entries = scan.entries
                if scan.first is not None:
                    gap = gap_view(cursor, scan.first)
                    if gap is not None:
                        resp.events.append(gap)
        except (RedisUnavailable, StreamError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"event stream unavailable: {exc}")
        size = resp.ByteSize()
        for entry in entries:
            view = event_view(entry)
            # a repeated field costs its bytes plus a tag and a length of at most 6 bytes
            size += view.ByteSize() + 6
            if size > PAGE_BYTES_MAX and resp.events:
                break  # ends early: the client reads on after the last id it got
            resp.events.append(view)
        return resp

    @staticmethod
    async def _check_filters(context: grpc.aio.ServicerContext,
                             req: control_pb2.ListEventsRequest | control_pb2.WatchEventsRequest
                             ) -> None:
        for field in ("type", "workload_id", "node_id", "after_id"):
            if len(getattr(req, field)) > FILTER_MAX_CHARS:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{field}: longer than {FILTER_MAX_CHARS} characters")

    async def watch_events(self, req: control_pb2.WatchEventsRequest,
                           context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[control_pb2.SchedulerEventView]:
        await self._check_filters(context, req)
        flt = EventFilter(req.type.strip(), req.workload_id.strip(), req.node_id.strip())
        cursor = await self._cursor(req.after_id, context)
        last_sent = cursor or ""
        ahead: control_pb2.SchedulerEventView | None = None
        try:
            if cursor is not None:
                ahead, cursor = await self._past_the_top(cursor)
            sub: Subscription = await self.tailer.subscribe(cursor, accept=flt.matches,
                                                            node_id=flt.node_id)
        except (RedisUnavailable, StreamError, RuntimeError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"event stream unavailable: {exc}")
            return
        try:
            if self._catch_up_s > 0:
                await self._top_reaching(sub.start_id)  # the history must reach the start
            if ahead is not None:
                last_sent = ahead.id
                yield ahead
            # history up to where the subscription starts, sent page by page (a watcher
            # resuming far back must not hold the whole retained stream in memory)
            if cursor is None:
                history = await self._newest_matching(flt, WATCH_REPLAY, upto=None)
                for entry in history:
                    if id_key(entry.stream_id) <= id_key(sub.start_id):
                        last_sent = entry.stream_id
                        yield event_view(entry)
            else:
                after = cursor
                first_seen = False
                while True:
                    scan = await self._after_matching(flt, after, PAGE, upto=sub.start_id)
                    if not first_seen:
                        first_seen = True
                        # a cursor found ahead of the stream was answered with its gap already
                        gap = None if ahead else history_gap(cursor, scan.first, sub.start_id)
                        if gap is not None:
                            yield gap
                    for entry in scan.entries:
                        last_sent = entry.stream_id
                        yield event_view(entry)
                    if scan.done:
                        break
                    after = scan.scanned_to
            observe = self._observe_delay
            while True:
                entry = await sub.get()  # the subscription applies the filter
                last_sent = entry.stream_id
                if observe is not None and entry.ts > 0:
                    observe(max(0.0, self._wall_clock() - entry.ts / 1000.0))
                yield event_view(entry)
        except SubscriptionOverflow:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"watcher fell behind; resume with after_id={last_sent}")
        except (RedisUnavailable, StreamReset, StreamError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"event stream interrupted ({exc}); resume with "
                                f"after_id={last_sent}")
        except SubscriptionClosed:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"scheduler shutting down; resume with after_id={last_sent}")
        finally:
            sub.close()
