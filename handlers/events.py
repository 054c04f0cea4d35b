"""ListEvents and WatchEvents over the Redis stream (ARCHITECTURE 3).

* ListEvents: the newest ``limit`` entries that match the filters (filters before the limit), in
  ascending order; with ``after_id``, the first ``limit`` matching entries after that cursor.
* WatchEvents: subscribe to the process's one tailer first, then replay history up to the
  subscription's start id (the newest 100 matching entries, or everything after ``after_id``),
  then follow: the seam has no gap and no duplicate, because history ends exactly where the
  subscription begins.
* Gaps are explicit: when the first retained entry after a cursor says (``prev``) that its
  predecessor is newer than the cursor, entries were trimmed, and the client first receives one
  synthetic ``EventsGap`` view. ``EventsGap`` entries always pass the filters.
* A watch that ends because Redis went away or the client fell behind gets UNAVAILABLE or
  RESOURCE_EXHAUSTED naming the last id it was sent, to resume from.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from eventsource.events import StreamEntry, parse_stream_id
from eventsource.stream import (
    RedisEventLog,
    RedisUnavailable,
    StreamError,
    StreamReset,
    StreamTailer,
    Subscription,
    SubscriptionClosed,
    SubscriptionOverflow,
    id_key,
)
from handlers.convert import event_view
from projections.event_views import ViewFilter as EventFilter
from proto.persys.control.v1 import control_pb2

log = logging.getLogger("persys.events")

DEFAULT_LIMIT = 100
MAX_LIMIT = 10_000
WATCH_REPLAY = 100
PAGE = 500
#: how far back a filtered ListEvents may scan before it settles for fewer matches
MAX_SCAN = 200_000


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


class EventService:
    """Serves the event RPCs from one stream."""

    def __init__(self, log_: RedisEventLog, tailer: StreamTailer) -> None:
        self.log = log_
        self.tailer = tailer

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
                              *, upto: str | None = None
                              ) -> tuple[list[StreamEntry], StreamEntry | None]:
        out: list[StreamEntry] = []
        first: StreamEntry | None = None
        cursor = after_id
        scanned = 0
        while len(out) < limit and scanned < MAX_SCAN:
            page = await self.log.range(cursor, PAGE)
            if not page:
                break
            if first is None:
                first = page[0]
            for entry in page:
                if upto is not None and id_key(entry.stream_id) > id_key(upto):
                    return out, first
                if flt.matches(entry):
                    out.append(entry)
                    if len(out) >= limit:
                        break
            scanned += len(page)
            cursor = page[-1].stream_id
            if len(page) < PAGE:
                break
        return out, first

    async def list_events(self, req: control_pb2.ListEventsRequest,
                          context: grpc.aio.ServicerContext) -> control_pb2.ListEventsResponse:
        if req.limit < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit: must not be negative")
        limit = min(int(req.limit) or DEFAULT_LIMIT, MAX_LIMIT)
        flt = EventFilter(req.type.strip(), req.workload_id.strip(), req.node_id.strip())
        cursor = await self._cursor(req.after_id, context)
        resp = control_pb2.ListEventsResponse()
        try:
            if cursor is None:
                entries = await self._newest_matching(flt, limit)
            else:
                entries, first = await self._after_matching(flt, cursor, limit)
                if first is not None:
                    gap = gap_view(cursor, first)
                    if gap is not None:
                        resp.events.append(gap)
        except (RedisUnavailable, StreamError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"event stream unavailable: {exc}")
        resp.events.extend(event_view(e) for e in entries)
        return resp

    async def watch_events(self, req: control_pb2.WatchEventsRequest,
                           context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[control_pb2.SchedulerEventView]:
        flt = EventFilter(req.type.strip(), req.workload_id.strip(), req.node_id.strip())
        cursor = await self._cursor(req.after_id, context)
        last_sent = cursor or ""
        try:
            sub: Subscription = await self.tailer.subscribe(cursor, accept=flt.matches,
                                                            node_id=flt.node_id)
        except (RedisUnavailable, StreamError, RuntimeError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"event stream unavailable: {exc}")
            return
        try:
            # history up to where the subscription starts
            if cursor is None:
                history = await self._newest_matching(flt, WATCH_REPLAY, upto=None)
                history = [e for e in history if id_key(e.stream_id) <= id_key(sub.start_id)]
            else:
                history = []
                after = cursor
                first_seen = False
                while True:
                    page, first = await self._after_matching(flt, after, PAGE, upto=sub.start_id)
                    if not first_seen and first is not None:
                        first_seen = True
                        gap = gap_view(cursor, first)
                        if gap is not None:
                            yield gap
                    history.extend(page)
                    if len(page) < PAGE:
                        break
                    after = page[-1].stream_id
            for entry in history:
                last_sent = entry.stream_id
                yield event_view(entry)
            while True:
                entry = await sub.get()  # the subscription applies the filter
                last_sent = entry.stream_id
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
