"""The pump: moves the outbox to the stream, in commit order, while the relay leads.

Why apart: this is the relay's work proper. Each pass takes over (``takeover``), lists the
outbox at revision R (every page pinned) and relays it sorted by ``(mod_revision, seq)``, then
follows a NODELETE watch from R+1 (re-list after compaction, resume after a dropped watch).
Each batch is planned (``plan``), checked against the renew deadline (etcd cannot fence an
XADD), appended in one pipelined XADD with explicit ids, and its marks handed to the marker.
Store failures start a new pass; Redis down leaves the outbox to the pruning's overflow check.

Under Sentinel (``master``, ``eventsource.stream.sentinel``) each pass first pins the log's
client to the master Sentinel names, so the take-over checks the stream it will append to; a
failover seen while the pass runs (the watch names another master, a connection error, a
READONLY reply) ends the pass, and the next one checks the new master's stream and appends
again, in order, whatever it lacks (``events_reappended``): those records are still in the
outbox, because an append counts as done, and its keys are deleted, only once ``replicas``
(``WAIT``) confirmed enough replicas hold it. A back-off is cut short by a failover.

Traced (a tracer given), each appended event whose outbox record carries the context of the
span that committed it gets a ``relay.append`` span in that trace, as that span's child, timed
by the batch's XADD (``eventsource.tracing``); untraced records cost nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from opentelemetry.trace import SpanKind, Tracer

from eventsource import tracing
from eventsource.clock import Clock
from eventsource.election import Leadership
from eventsource.errors import (
    Compacted,
    Conflict,
    LeaseLost,
    NotLeader,
    StoreError,
    Unavailable,
    WatchCanceled,
)
from eventsource.etcd import AsyncEtcd
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.racing import race
from eventsource.relay.marker import Marker
from eventsource.relay.outbox import OutboxRecord, parse_all
from eventsource.relay.plan import plan_append
from eventsource.relay.pruning import OutboxPruner
from eventsource.relay.takeover import take_over
from eventsource.relay.view import StreamView
from eventsource.stream.errors import (
    NothingSent,
    RedisUnavailable,
    ReplicasBehind,
    StreamIdConflict,
    StreamWrongType,
)
from eventsource.stream.eventlog import RedisEventLog
from eventsource.stream.replicas import ReplicaWait
from eventsource.stream.sentinel import MasterPin
from eventsource.watch import WatchBatch, WatchStream

log = logging.getLogger("persys.relay")

#: test hook: awaited after each XADD batch with its stream ids
AfterAppend = Callable[[Sequence[str]], Awaitable[None]]


class OutboxPump:
    """Relays the outbox to the stream for one leadership at a time (``run``)."""

    def __init__(
        self,
        etcd: AsyncEtcd,
        layout: KeyLayout,
        stream: RedisEventLog,
        metrics: Metrics,
        clock: Clock,
        view: StreamView,
        marker: Marker,
        pruner: OutboxPruner,
        *,
        batch: int,
        max_entries: int,
        renew_deadline: float,
        retry_min: float,
        retry_max: float,
        after_append: AfterAppend | None,
        master: MasterPin | None = None,
        replicas: ReplicaWait | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self._tracer = tracer
        self._etcd = etcd
        self._layout = layout
        self._stream = stream
        self._metrics = metrics
        self._clock = clock
        self._view = view
        self._marker = marker
        self._pruner = pruner
        self._batch = batch
        self._max_entries = max_entries
        self._renew_deadline = renew_deadline
        self._retry_min = retry_min
        self._retry_max = retry_max
        #: test hook: awaited after each XADD batch (the batches before it are marked by then),
        #: before the etcd txn that records it
        self._after_append = after_append
        #: the Sentinel master this relay appends to (None: one Redis at one address)
        self._master = master
        #: the replicas an append waits for before it counts (None: the master's word)
        self._replicas = replicas
        #: the newest id this relay sent to Redis: a record at or below it that a later pass
        #: finds missing and appends is sent again (``events_reappended``): lost with a
        #: master that had not passed it to a replica, or never received
        self._appended_high: tuple[int, int] = (0, 0)
        #: the master address of the last pass (a change is logged)
        self._master_address = ""
        #: the back-off before the next pass (reset once a pass relayed the outbox listing)
        self._delay = retry_min

    async def run(self, lead: Leadership) -> None:
        """Relay until cancelled or the leadership is lost (``LeaseLost``, ``NotLeader``)."""
        self._delay = self._retry_min
        while True:
            try:
                if self._master is None:
                    await self._pass(lead)
                else:
                    await self._pin_master()
                    moved = self._master.moved
                    finished, _ = await race(self._pass(lead), moved)
                    if not finished:
                        raise RedisUnavailable(
                            f"the Redis master moved from {self._master.address}")
            except ReplicasBehind as exc:
                log.warning("relay: %s", exc)
                await self._pruner.check_overflow_safely(lead)
            except RedisUnavailable as exc:
                log.warning("relay: Redis unavailable, outbox kept: %s", exc)
                await self._pruner.check_overflow_safely(lead)
            except (StreamIdConflict, StreamWrongType) as exc:
                log.warning("relay: stream %s cannot take our ids: %s", self._stream.key, exc)
                self._view.force_aside = str(exc)
                self._delay = self._retry_min
            except Conflict as exc:
                log.info("relay: mark changed underneath, re-reading: %s", exc)
            except (Unavailable, Compacted, WatchCanceled) as exc:
                log.warning("relay: etcd unavailable: %s", exc)
            except (LeaseLost, NotLeader):
                raise
            except StoreError:
                log.exception("relay: unexpected store error, retrying")
            await self._pause(self._delay)
            self._delay = min(self._delay * 2, self._retry_max)

    async def _pass(self, lead: Leadership) -> None:
        """One pass: the take-over checks, then list and follow the outbox until a failure."""
        try:
            await take_over(self._view, stream=self._stream, etcd=self._etcd,
                            mark_key=self._layout.relay_mark, metrics=self._metrics,
                            batch=self._batch)
            while True:
                records, poison, revision = await self._list_outbox()
                await self._relay(lead, records, poison, caught_up=revision)
                self._delay = self._retry_min
                await self._follow(lead, revision)
        except BaseException as exc:
            # whatever ended the loop, the mark in flight ends before it is read again
            await self._marker.end(lead, cancel=isinstance(exc, asyncio.CancelledError))
            raise

    async def _pin_master(self) -> None:
        """Pin the log's client to the master Sentinel names now (before the take-over)."""
        assert self._master is not None
        address = await self._master.pin()
        if address != self._master_address:
            if self._master_address:
                log.warning("relay: Redis master is now %s (was %s): checking its stream "
                            "against the outbox", address, self._master_address)
            else:
                log.info("relay: appending to Redis master %s", address)
            self._master_address = address

    async def _pause(self, delay: float) -> None:
        """The back-off between passes; a failover cuts it short (a new master to try)."""
        if self._master is None:
            await asyncio.sleep(delay)
        else:
            await self._master.sleep(delay)

    async def _list_outbox(self) -> tuple[list[OutboxRecord], list[str], int]:
        kvs, revision = await self._etcd.list_prefix(self._layout.outbox_prefix)
        records, poison = parse_all(kvs)
        return records, poison, revision

    async def _follow(self, lead: Leadership, listed: int) -> None:
        """Relay watch batches from ``listed + 1``; return when a re-list is needed."""
        after = listed
        while True:
            watch = WatchStream(
                self._etcd.base_url, self._layout.outbox_prefix, after + 1, no_delete=True,
                tls=self._etcd.tls,
            )
            try:
                iterator = aiter(watch)
                while True:
                    try:
                        batch = await self._next_batch(iterator)
                    except Compacted:
                        self._metrics.watch_restarts.labels("compacted").inc()
                        return
                    except (Unavailable, WatchCanceled) as exc:
                        reason = "canceled" if isinstance(exc, WatchCanceled) else "unavailable"
                        self._metrics.watch_restarts.labels(reason).inc()
                        log.info("relay watch ended (%s), resuming from %d", exc, after + 1)
                        break
                    if batch is None:  # the marker failed while the relay waited
                        self._marker.raise_failure()  # the relay loop re-prepares
                        continue
                    # coalesce whatever else already arrived: one append and one etcd txn
                    # for many commits instead of one round trip per commit
                    batches = [batch, *watch.take_ready()]
                    kvs = [e.kv for b in batches for e in b.events if not e.deleted]
                    records, poison = parse_all(kvs)
                    newest = max(b.revision for b in batches)
                    await self._relay(lead, records, poison, caught_up=newest)
                    after = max(after, newest)
            finally:
                watch.close()
            await asyncio.sleep(self._retry_min)

    async def _next_batch(self, iterator: AsyncIterator[WatchBatch]) -> WatchBatch | None:
        """The next watch batch, or None when the marker fails first (its error is for the
        caller to raise outside the watch's own error handling)."""
        marker = self._marker.task
        if marker is None or marker.done():
            if marker is not None and marker.exception() is not None:
                return None
            return await anext(iterator)
        nxt = asyncio.ensure_future(anext(iterator))
        try:
            await asyncio.wait({nxt, marker}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done() and marker.exception() is not None:
                return None
            return await nxt
        finally:
            if not nxt.done():
                nxt.cancel()
                await asyncio.wait({nxt})

    async def _relay(
        self,
        lead: Leadership,
        records: list[OutboxRecord],
        poison: list[str],
        *,
        caught_up: int,
    ) -> None:
        if poison:
            await self._marker.settle(lead)
            await self._pruner.drop_poison(lead, poison)
        records.sort(key=lambda r: r.order)
        for start in range(0, len(records), self._batch):
            chunk = records[start : start + self._batch]
            last = start + self._batch >= len(records)
            await self._append(lead, chunk, caught_up=caught_up if last else None)
        if not records and self._view.gaps:
            await self._append(lead, [], caught_up=caught_up)

    async def _append(
        self, lead: Leadership, chunk: list[OutboxRecord], *, caught_up: int | None
    ) -> None:
        view = self._view
        plan = plan_append(
            chunk,
            top=view.top,
            mark=view.mark,
            gaps=view.gaps,
            caught_up=caught_up,
            now=self._clock.now(),
        )
        if not plan.entries:
            return
        if not lead.held(self._renew_deadline):
            raise NotLeader("relay lease renewal overdue: not appending")
        if self._master is not None:
            self._master.check()
        # sent from here on: a later pass that finds them missing sends them again
        high, self._appended_high = self._appended_high, max(self._appended_high, plan.top)
        began = time.time_ns() if self._tracer is not None else 0
        try:
            result = await self._stream.append_batch(plan.entries, maxlen=self._max_entries,
                                                     wait=self._replicas)
        except NothingSent:
            self._appended_high = high  # never reached Redis: the next attempt is the first
            raise
        if self._tracer is not None:
            self._trace_append(self._tracer, chunk, len(plan.entries), began)
        again = sum(1 for r in chunk if r.order <= high and r.stream_id not in result.present)
        if again:
            self._metrics.events_reappended.inc(again)
            log.warning("relay: appended %d events again that the stream had lost (%s ..)",
                        again, chunk[0].stream_id)
        view.top = max(view.top, plan.top)
        view.gaps = plan.gaps_left
        if chunk:
            self._metrics.events_relayed.inc(len(chunk))
            self._metrics.state_store_writes.labels("event").inc(len(chunk))
            self._observe_delay(chunk)
        if plan.gap_ids:
            log.warning("relay: wrote EventsGap %s", ", ".join(plan.gap_ids))
        if self._after_append is not None:
            # the test hook sees every earlier batch marked and this one not yet
            await self._marker.settle(lead)
            await self._after_append([stream_id for stream_id, _ in plan.entries])
        await self._marker.owe(lead, chunk, plan.marks, plan.position, plan.gaps_left)

    def _trace_append(self, tracer: Tracer, chunk: list[OutboxRecord], entries: int,
                      began_ns: int) -> None:
        """One ``relay.append`` span per traced record, under the span that committed it."""
        ended_ns = time.time_ns()
        now_ms = self._clock.now().timestamp() * 1000.0
        for record in chunk:
            if not record.traceparent:
                continue
            parent = tracing.parent_of(record.traceparent)
            if parent is None:
                continue
            attributes: dict[str, str | int | float] = {
                tracing.STREAM_ID: record.stream_id, tracing.EVENT_TYPE: record.event_type,
                "scheduler.batch_size": entries, "messaging.system": "redis",
                "messaging.destination.name": self._stream.key}
            if record.ts_ms:
                attributes["scheduler.relay_delay_ms"] = max(0.0, now_ms - record.ts_ms)
            span = tracer.start_span("relay.append", context=parent, kind=SpanKind.PRODUCER,
                                     start_time=began_ns, attributes=attributes)
            span.end(end_time=ended_ns)

    def _observe_delay(self, appended: list[OutboxRecord]) -> None:
        """Each event's decision-to-append time (``event_relay_delay_seconds``)."""
        now_ms = self._clock.now().timestamp() * 1000.0
        observe = self._metrics.event_relay_delay.observe
        for record in appended:
            if record.ts_ms:
                observe(max(0.0, now_ms - record.ts_ms) / 1000.0)
