"""The outbox relay: the only writer of the event stream (ARCHITECTURE section 3).

Why it exists: events are committed to etcd as outbox keys in the same transaction as the state
change that caused them; this relay moves them to the Redis stream in commit order, exactly once
per stream id, and deletes what it moved. There is no "write etcd, then XADD" dual write.

How: the relay holds its own election at ``layout.relay_election`` (any replica, either HA
mode). As leader it checks the stream (foreign or lost data), lists the outbox at revision R
(every page pinned), relays it sorted by ``(mod_revision, seq)``, then follows a NODELETE watch
from R+1 (re-list after compaction, resume after a dropped watch). Each batch is one pipelined
XADD with explicit ids ``"<mod_revision>-<seq>"`` followed by fenced etcd transactions that
advance the high-water mark ``layout.relay_mark`` and delete the relayed outbox keys (at most
128 operations each, the mark put in every one). The marks are committed by one marker task
while the relay goes on appending: what is appended while a mark transaction is in flight is
owed and rides in the next one. An etcd write then costs the stream no latency (at hundreds of
events per second most of commit-to-delivery time was the relay waiting for its marks), and a
burst costs a few mark transactions instead of one per batch.

Invariants:

* Order: the stream receives outbox records in ``(revision, seq)`` order; a record is deleted
  from the outbox only in a fenced transaction that also moves the mark past it, after its XADD
  succeeded. A crash anywhere leaves the record in the outbox, and the re-append is idempotent
  (``RedisEventLog.append_batch``'s "equal or smaller" rule), so nothing is lost or duplicated.
  With marking pipelined, at most two batches are appended but not yet marked (past one batch
  the relay waits for the marker), which keeps them within the range ``_prepare`` reads back to
  find gaps already written.
* ``prev`` of every entry is the id of the entry before it in the stream.
* Gaps are explicit: Redis losing entries (stream top below the mark) and outbox overflow
  (``outbox_max`` exceeded while Redis is down; the oldest whole revisions are deleted and
  counted in ``events_dropped``) each produce ONE ``EventsGap`` entry before the next real
  event. Pending gaps live in the mark's JSON, so they survive a relay crash or failover.
  Details: ``from`` and ``to`` are the first and last stream ids that may be missing
  (inclusive), ``dropped`` the exact count when known (overflow).
* Gap ids (the scheme): a gap is written only at a revision boundary, i.e. when the next record
  to relay has a revision greater than that of the position P = max(stream top, mark), or when
  every record up to a revision >= P's has been relayed. It takes the id ``<P.rev>-<P.seq+1>``.
  This id is above everything in the stream, and no real event can ever take it: the feed is
  ordered, so at a boundary no record of revision P.rev is still to come, and real events of
  later revisions sort above it. Several gaps in a row take consecutive seqs. P includes the
  mark because records at or below it are gone from the outbox. A gap's ``eventId`` is stable
  (stored with the owed gap, or derived from the lost range), so re-appending it after a crash
  is recognised like any other entry.
* Foreign streams (top entry without ``eventId``, a key that is not a stream, or a top whose
  revision is ahead of etcd) are renamed aside with a warning and ``foreign_streams``, never
  appended to. An id conflict at append time is treated the same way.
* The relay stops relaying as soon as its lease is lost (the leadership work is cancelled and
  awaited), checks its renew deadline before every XADD (which etcd cannot fence), fences every
  etcd write with its election key, and re-campaigns with a new lease.
* Only the relay trims: MAXLEN ~ ``max_entries`` on XADD, and ``trim_by_age`` every
  ``trim_interval`` seconds while leading.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from eventsource.clock import Clock
from eventsource.election import Election, Leadership, Session
from eventsource.errors import (
    Compacted,
    Conflict,
    LeaseLost,
    NotLeader,
    StoreError,
    Unavailable,
    WatchCanceled,
)
from eventsource.etcd import AsyncEtcd, Compare, Delete, KeyValue, Put, b64
from eventsource.events import Event, entry_data
from eventsource.keys import KeyLayout, prefix_end
from eventsource.metrics import Metrics
from eventsource.racing import race
from eventsource.stream.entries import ZERO_ID, format_id, id_key, next_id
from eventsource.stream.errors import RedisUnavailable, StreamIdConflict, StreamWrongType
from eventsource.stream.eventlog import RedisEventLog
from eventsource.watch import WatchBatch, WatchStream

log = logging.getLogger("persys.relay")

__all__ = [
    "AppendPlan",
    "OutboxRecord",
    "PendingGap",
    "Relay",
    "RelayMark",
    "parse_record",
    "plan_append",
]

#: etcd's default --max-txn-ops; every relay txn holds the mark put plus at most 127 deletes
MAX_TXN_OPS = 128
MAX_DELETES_PER_TXN = MAX_TXN_OPS - 1
#: the least time between two mark transactions of the marker: at a steady rate the outbox
#: deletes cost a few etcd writes per second instead of one per append (a settle does not wait)
MARK_INTERVAL_S = 0.1
#: fixed namespace of the deterministic ids of "Redis lost data" gaps
_GAP_NAMESPACE = uuid.UUID("8d6f0c1e-2a47-4c59-9b3e-5f1e7a0c2d31")

CAUSE_LOST = "redis-lost-entries"
CAUSE_OVERFLOW = "outbox-overflow"
CAUSE_MOVED = "stream-moved-aside"

IdKey = tuple[int, int]


# -- pure parts ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutboxRecord:
    """One outbox key: an event committed at ``revision`` as the ``seq``-th of its txn."""

    key: str
    revision: int
    seq: int
    value: bytes
    #: the event's timestamp in epoch milliseconds (its decision), 0 if it has none
    ts_ms: int = 0

    @property
    def order(self) -> IdKey:
        return (self.revision, self.seq)

    @property
    def stream_id(self) -> str:
        return f"{self.revision}-{self.seq}"


def parse_record(kv: KeyValue) -> OutboxRecord | None:
    """The record of an outbox key, or None if its value is not an outbox record."""
    try:
        body = json.loads(kv.value)
        seq = int(body["seq"])
        event_id = body["eventId"]
    except (ValueError, TypeError, KeyError):
        return None
    if seq < 0 or not isinstance(event_id, str) or not event_id or kv.mod_revision <= 0:
        return None
    ts = body.get("ts")
    return OutboxRecord(key=kv.key, revision=kv.mod_revision, seq=seq, value=kv.value,
                        ts_ms=ts if isinstance(ts, int) and ts > 0 else 0)


@dataclass(frozen=True, slots=True)
class PendingGap:
    """An ``EventsGap`` the relay owes the stream (written before the next real event)."""

    event_id: str
    #: first stream id that may be missing (inclusive)
    first: str
    #: last stream id that may be missing (inclusive)
    last: str
    #: exact number of events dropped, when known
    dropped: int | None
    cause: str

    def details(self) -> dict[str, str]:
        out = {"from": self.first, "to": self.last}
        if self.dropped is not None:
            out["dropped"] = str(self.dropped)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "eventId": self.event_id,
            "from": self.first,
            "to": self.last,
            "dropped": self.dropped,
            "cause": self.cause,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PendingGap:
        dropped = raw.get("dropped")
        return cls(
            event_id=str(raw["eventId"]),
            first=str(raw.get("from", ZERO_ID)),
            last=str(raw.get("to", ZERO_ID)),
            dropped=int(dropped) if dropped is not None else None,
            cause=str(raw.get("cause", "")),
        )


def lost_gap(top: IdKey, mark: IdKey, *, stream_key: str, cause: str = CAUSE_LOST) -> PendingGap:
    """The gap for entries in ``(top, mark]`` that the stream no longer holds.

    Its event id is derived from the gap itself, so two relays (or two attempts) that see the
    same loss write the same event, which keeps the append idempotent.
    """
    first = next_id(format_id(top))
    last = format_id(mark)
    event_id = str(uuid.uuid5(_GAP_NAMESPACE, f"{stream_key}|{cause}|{first}|{last}"))
    return PendingGap(event_id=event_id, first=first, last=last, dropped=None, cause=cause)


@dataclass(frozen=True, slots=True)
class RelayMark:
    """The relay's high-water mark in etcd: the last stream id relayed, plus owed gaps."""

    last_id: str | None
    gaps: tuple[PendingGap, ...] = ()
    #: the mark key's mod revision (0 = absent), for compare-and-swap
    mod_revision: int = 0

    @classmethod
    def decode(cls, kv: KeyValue | None) -> RelayMark:
        if kv is None:
            return cls(last_id=None)
        body = json.loads(kv.value)
        last = body.get("lastId") or None
        gaps = tuple(PendingGap.from_json(g) for g in body.get("gaps", []))
        return cls(last_id=str(last) if last else None, gaps=gaps, mod_revision=kv.mod_revision)

    @staticmethod
    def encode(last_id: str | None, gaps: Sequence[PendingGap]) -> bytes:
        body: dict[str, Any] = {"lastId": last_id or ZERO_ID}
        if gaps:
            body["gaps"] = [g.to_json() for g in gaps]
        return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class AppendPlan:
    """What one batch appends, and where the mark stands after each record."""

    #: ``(stream id, data)`` in XADD order (records, and gaps at revision boundaries)
    entries: list[tuple[str, str]]
    #: for each record of the batch (same order): the mark once it is relayed
    marks: list[str]
    #: the stream's top once every entry is appended
    top: IdKey
    #: max(top, mark) once every entry is appended: the final mark
    position: IdKey
    #: gaps still owed (no revision boundary was reached)
    gaps_left: tuple[PendingGap, ...]
    #: ids given to the gaps written by this plan
    gap_ids: list[str] = field(default_factory=list)


def _gap_data(gap: PendingGap, gap_id: IdKey, *, prev: str, now: datetime) -> str:
    event = Event(
        type="EventsGap",
        reason=gap.cause,
        details=gap.details(),
        event_id=gap.event_id,
        timestamp=now,
    )
    return entry_data(event.outbox_record(seq=gap_id[1]), revision=gap_id[0], prev=prev)


def plan_append(
    records: Sequence[OutboxRecord],
    *,
    top: IdKey,
    mark: IdKey,
    gaps: Sequence[PendingGap],
    caught_up: int | None,
    now: datetime,
) -> AppendPlan:
    """Plan one batch: entries with their ``prev`` chain, gaps placed at revision boundaries.

    Pure. ``records`` must be sorted by ``(revision, seq)`` and follow everything relayed
    before; ``top`` is the stream's newest id ((0, 0) if empty), ``mark`` the high-water mark;
    ``caught_up`` is a revision such that every record up to it is in this or an earlier batch
    (None if unknown). A record at or below ``top`` is planned again and will be recognised as
    already appended by ``append_batch``.
    """
    entries: list[tuple[str, str]] = []
    marks: list[str] = []
    gap_ids: list[str] = []
    pending = list(gaps)
    cur_top = top

    def write_gaps() -> None:
        nonlocal cur_top
        for gap in pending:
            pos = max(cur_top, mark)
            gap_id = (pos[0], pos[1] + 1)
            entries.append((format_id(gap_id), _gap_data(gap, gap_id, prev=format_id(cur_top),
                                                         now=now)))  # fmt: skip
            gap_ids.append(format_id(gap_id))
            cur_top = gap_id
        pending.clear()

    for record in records:
        if pending and record.revision > max(cur_top, mark)[0]:
            write_gaps()
        data = entry_data(record.value, revision=record.revision, prev=format_id(cur_top))
        entries.append((record.stream_id, data))
        cur_top = max(cur_top, record.order)
        marks.append(format_id(max(cur_top, mark)))
    if pending and caught_up is not None and caught_up >= max(cur_top, mark)[0]:
        write_gaps()
    return AppendPlan(
        entries=entries,
        marks=marks,
        top=cur_top,
        position=max(cur_top, mark),
        gaps_left=tuple(pending),
        gap_ids=gap_ids,
    )


# -- the relay ----------------------------------------------------------------------------------


AfterAppend = Callable[[Sequence[str]], Awaitable[None]]


class Relay:
    """Relays the etcd outbox to the Redis stream while it holds the relay election."""

    def __init__(
        self,
        etcd: AsyncEtcd,
        layout: KeyLayout,
        log: RedisEventLog,
        metrics: Metrics,
        clock: Clock,
        *,
        max_entries: int,
        ttl_ms: int,
        outbox_max: int,
        batch: int = 500,
        instance_id: str,
        lease_ttl: int = 15,
        renew_deadline: float | None = None,
        trim_interval: float = 5.0,
        retry_min: float = 0.5,
        retry_max: float = 5.0,
        election_poll: float = 1.0,
        mark_interval: float = MARK_INTERVAL_S,
        after_append: AfterAppend | None = None,
    ) -> None:
        if batch < 1 or outbox_max < 1:
            raise ValueError("batch and outbox_max must be positive")
        self._etcd = etcd
        self._layout = layout
        self._log = log
        self._metrics = metrics
        self._clock = clock
        self._max_entries = max_entries
        self._ttl_ms = ttl_ms
        self._outbox_max = outbox_max
        self._batch = batch
        self.instance_id = instance_id
        self._lease_ttl = lease_ttl
        self._renew_deadline = renew_deadline if renew_deadline is not None else lease_ttl * 2 / 3
        if not 0 < self._renew_deadline < lease_ttl:
            raise ValueError("renew_deadline must be between 0 and the lease TTL")
        self._trim_interval = trim_interval
        self._retry_min = retry_min
        self._retry_max = retry_max
        self._election_poll = election_poll
        #: test hook: awaited after each XADD batch (the batches before it are marked by then),
        #: before the etcd txn that records it
        self._after_append = after_append
        self._status = "stopped"
        self._closing = asyncio.Event()
        self._done = asyncio.Event()
        self._running = False
        self._led = False
        #: the term (election key create revision) while leading, else 0
        self.term = 0
        # per-leadership view of the stream and the mark (rebuilt by _prepare)
        self._top: IdKey = (0, 0)
        self._mark: IdKey = (0, 0)
        self._mark_mod = 0
        self._gaps: tuple[PendingGap, ...] = ()
        self._force_aside: str | None = None
        #: the overflow gap of the current Redis outage (merged into; None: start a new one)
        self._open_overflow: str | None = None
        #: the marker: commits the marks owed (below), one transaction batch at a time
        self._marking: asyncio.Task[None] | None = None
        #: appended but not yet marked: the records (in order), the mark after each, and the
        #: position and owed gaps of the newest plan (None: nothing owed)
        self._owed_records: list[OutboxRecord] = []
        self._owed_marks: list[str] = []
        self._owed: tuple[IdKey, tuple[PendingGap, ...]] | None = None
        #: records the marker has taken and not yet committed
        self._marking_records = 0
        self._mark_interval = mark_interval
        #: loop time of the last mark transaction; set: the marker stops pacing (a settle)
        self._marked_at = float("-inf")
        self._flush = asyncio.Event()

    @property
    def status(self) -> str:
        """``leader``, ``standby`` or ``stopped`` (for /health)."""
        return self._status

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Campaign, relay while leading, re-campaign after a loss; returns after ``aclose``.

        Store failures (etcd, Redis, lost lease or fence) are handled here and never end the
        loop; anything else is a bug and propagates to the owner's task guard.
        """
        if self._running or self._closing.is_set():
            raise RuntimeError("relay already running or closed")
        self._running = True
        self._status = "standby"
        delay = self._retry_min
        try:
            while not self._closing.is_set():
                self._led = False
                try:
                    finished, _ = await race(self._term(), self._closing)
                except StoreError as exc:
                    log.warning("relay %s: term ended: %r", self.instance_id, exc)
                    finished = True
                if not finished:
                    break
                # a term that led ended by a loss: campaign again promptly; else back off
                delay = self._retry_min if self._led else min(delay * 2, self._retry_max)
                await race(asyncio.sleep(delay), self._closing)
        finally:
            self._status = "stopped"
            self.term = 0
            self._done.set()

    async def aclose(self) -> None:
        """Stop relaying, resign, revoke the lease, and wait for ``run()`` to return."""
        self._closing.set()
        if self._running:
            await self._done.wait()
        self._status = "stopped"

    async def _term(self) -> None:
        """One lease: campaign, lead until the lease or the leadership is lost."""
        session = Session(self._etcd, ttl=self._lease_ttl, clock=self._clock,
                          renew_deadline=self._renew_deadline)
        await session.start()
        try:
            election = Election(
                self._etcd,
                session,
                self._layout.relay_election,
                self.instance_id,
                poll_interval=self._election_poll,
            )
            lead = await election.campaign()
            self._status, self.term, self._led = "leader", lead.term, True
            log.info("relay %s leads (term %d)", self.instance_id, lead.term)
            try:
                led_to_the_end, _ = await race(self._lead(lead), session.lost)
                if not led_to_the_end:
                    raise LeaseLost(f"relay lease lost: {session.lost_reason}")
            finally:
                self._status, self.term = "standby", 0
                log.info("relay %s stopped leading", self.instance_id)
                if not session.lost.is_set():
                    try:
                        async with asyncio.timeout(2.0):
                            await election.resign()
                    except (StoreError, TimeoutError) as exc:
                        log.info("relay resign failed (the lease revoke follows): %s", exc)
        finally:
            await session.close()

    async def _lead(self, lead: Leadership) -> None:
        trim = asyncio.create_task(self._trim_loop(), name=f"relay-trim:{self.instance_id}")
        try:
            await self._relay_loop(lead)
        finally:
            trim.cancel()
            await asyncio.wait({trim})
            if not trim.cancelled() and trim.exception() is not None:
                log.error("relay trim task failed", exc_info=trim.exception())

    # -- the relay loop -------------------------------------------------------------------------
    async def _relay_loop(self, lead: Leadership) -> None:
        delay = self._retry_min
        while True:
            try:
                try:
                    await self._prepare(lead)
                    while True:
                        records, poison, revision = await self._list_outbox()
                        await self._relay(lead, records, poison, caught_up=revision)
                        delay = self._retry_min
                        await self._follow(lead, revision)
                except BaseException as exc:
                    # whatever ended the loop, the mark in flight ends before it is read again
                    await self._end_marking(lead, cancel=isinstance(exc, asyncio.CancelledError))
                    raise
            except RedisUnavailable as exc:
                log.warning("relay: Redis unavailable, outbox kept: %s", exc)
                await self._check_overflow_safely(lead)
            except (StreamIdConflict, StreamWrongType) as exc:
                log.warning("relay: stream %s cannot take our ids: %s", self._log.key, exc)
                self._force_aside = str(exc)
                delay = self._retry_min
            except Conflict as exc:
                log.info("relay: mark changed underneath, re-reading: %s", exc)
            except (Unavailable, Compacted, WatchCanceled) as exc:
                log.warning("relay: etcd unavailable: %s", exc)
            except (LeaseLost, NotLeader):
                raise
            except StoreError:
                log.exception("relay: unexpected store error, retrying")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._retry_max)

    async def _prepare(self, lead: Leadership) -> None:
        """Read the stream's top and the mark; move a foreign stream aside; derive gaps."""
        reason = self._force_aside
        self._force_aside = None
        try:
            top = await self._log.top()
        except StreamWrongType as exc:
            reason, top = str(exc), None
        # Redis answers: owed gaps may be written from now on, so none is merged into
        self._open_overflow = None
        if reason is None and top is not None and not top.is_ours:
            reason = f"foreign stream: top entry {top.stream_id} carries no eventId"
        mark = RelayMark.decode(await self._etcd.get(self._layout.relay_mark))
        if reason is None and top is not None:
            current = await self._etcd.current_revision()
            if id_key(top.stream_id)[0] > current:
                reason = f"stream top {top.stream_id} is ahead of etcd revision {current}"
        moved = False
        if reason is not None:
            new_name = await self._log.move_aside(reason)
            self._metrics.foreign_streams.inc()
            log.warning("relay: moved stream %s aside to %s: %s", self._log.key, new_name, reason)
            top, moved = None, True
        self._top = id_key(top.stream_id) if top is not None else (0, 0)
        self._mark = id_key(mark.last_id) if mark.last_id else (0, 0)
        self._mark_mod = mark.mod_revision
        gaps = list(mark.gaps)
        if self._mark > self._top:
            cause = CAUSE_MOVED if moved else CAUSE_LOST
            gap = lost_gap(self._top, self._mark, stream_key=self._log.key, cause=cause)
            if all(g.event_id != gap.event_id and g.last != gap.last for g in gaps):
                log.error(
                    "relay: stream %s ends at %s but %s was relayed: writing an EventsGap",
                    self._log.key, format_id(self._top), format_id(self._mark),
                )  # fmt: skip
                gaps.append(gap)
        if gaps and self._top > self._mark:
            # a crash between XADD and the mark update may have written owed gaps already
            after = await self._log.range(format_id(self._mark), 2 * self._batch + 16)
            present = {entry.event_id for entry in after}
            gaps = [g for g in gaps if g.event_id not in present]
        self._gaps = tuple(gaps)

    async def _list_outbox(self) -> tuple[list[OutboxRecord], list[str], int]:
        kvs, revision = await self._etcd.list_prefix(self._layout.outbox_prefix)
        records, poison = _parse_all(kvs)
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
                        failed, self._marking = self._marking, None
                        assert failed is not None
                        failed.result()  # raises its failure: the relay loop re-prepares
                        continue
                    # coalesce whatever else already arrived: one append and one etcd txn
                    # for many commits instead of one round trip per commit
                    batches = [batch, *watch.take_ready()]
                    kvs = [e.kv for b in batches for e in b.events if not e.deleted]
                    records, poison = _parse_all(kvs)
                    newest = max(b.revision for b in batches)
                    await self._relay(lead, records, poison, caught_up=newest)
                    after = max(after, newest)
            finally:
                watch.close()
            await asyncio.sleep(self._retry_min)

    async def _next_batch(self, iterator: AsyncIterator[WatchBatch]) -> WatchBatch | None:
        """The next watch batch, or None when the marker fails first (its error is for the
        caller to raise outside the watch's own error handling)."""
        marker = self._marking
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
            await self._settle_marking(lead)
            await self._drop_poison(lead, poison)
        records.sort(key=lambda r: r.order)
        for start in range(0, len(records), self._batch):
            chunk = records[start : start + self._batch]
            last = start + self._batch >= len(records)
            await self._append(lead, chunk, caught_up=caught_up if last else None)
        if not records and self._gaps:
            await self._append(lead, [], caught_up=caught_up)

    async def _append(
        self, lead: Leadership, chunk: list[OutboxRecord], *, caught_up: int | None
    ) -> None:
        plan = plan_append(
            chunk,
            top=self._top,
            mark=self._mark,
            gaps=self._gaps,
            caught_up=caught_up,
            now=self._clock.now(),
        )
        if not plan.entries:
            return
        if not lead.held(self._renew_deadline):
            raise NotLeader("relay lease renewal overdue: not appending")
        await self._log.append_batch(plan.entries, maxlen=self._max_entries)
        self._top = max(self._top, plan.top)
        self._gaps = plan.gaps_left
        if chunk:
            self._metrics.events_relayed.inc(len(chunk))
            self._metrics.state_store_writes.labels("event").inc(len(chunk))
            self._observe_delay(chunk)
        if plan.gap_ids:
            log.warning("relay: wrote EventsGap %s", ", ".join(plan.gap_ids))
        if self._after_append is not None:
            # the test hook sees every earlier batch marked and this one not yet
            await self._settle_marking(lead)
            await self._after_append([stream_id for stream_id, _ in plan.entries])
        self._owed_records.extend(chunk)
        self._owed_marks.extend(plan.marks)
        self._owed = (plan.position, plan.gaps_left)
        marker = self._marking
        if marker is not None and marker.done():
            self._marking = None
            marker.result()  # its failure (lost fence, etcd down) surfaces here
        if len(self._owed_records) + self._marking_records > self._batch:
            # bounded: at most two batches appended but unmarked (what _prepare reads back)
            await self._settle_marking(lead)
        elif self._marking is None:
            self._marking = asyncio.create_task(self._mark_owed(lead),
                                                name=f"relay-mark:{self.instance_id}")

    def _observe_delay(self, appended: list[OutboxRecord]) -> None:
        """Each event's decision-to-append time (``event_relay_delay_seconds``)."""
        now_ms = self._clock.now().timestamp() * 1000.0
        observe = self._metrics.event_relay_delay.observe
        for record in appended:
            if record.ts_ms:
                observe(max(0.0, now_ms - record.ts_ms) / 1000.0)

    async def _settle_marking(self, lead: Leadership) -> None:
        """Mark everything appended; a failure (lost fence, etcd down) is raised here."""
        task, self._marking = self._marking, None
        self._flush.set()
        try:
            if task is not None:
                await task
            if self._owed is not None:
                await self._mark_owed(lead)
        finally:
            self._flush.clear()

    async def _end_marking(self, lead: Leadership, *, cancel: bool) -> None:
        """Leaving the relay loop: mark what is appended (or, when the relay is being
        cancelled, cancel the marker), and always await the marker, so none outlives the loop.

        Why mark first: what is appended is in the stream, and an overflow check that follows
        (Redis failed) must not drop those records from the outbox as undelivered. Never
        raises a store error: ``_prepare`` reads the mark back from etcd, and whatever stays
        unmarked is re-appended and recognised.
        """
        task, self._marking = self._marking, None
        try:
            if cancel:
                if task is not None:
                    task.cancel()
                    await asyncio.wait({task})
                return
            # what was appended is in the stream: mark it now (unpaced) if etcd lets us, so
            # an overflow check that follows never takes it for undelivered
            self._flush.set()
            try:
                if task is not None:
                    await task  # a cancellation of ours reaches the marker too
                if self._owed is not None:
                    await self._mark_owed(lead)
            except StoreError as exc:
                log.info("relay: the marking in flight did not finish: %r", exc)
            finally:
                self._flush.clear()
        finally:
            # what is still owed stays in the outbox: the next _prepare reads the mark back
            # and the re-append of anything unmarked is recognised
            self._owed_records, self._owed_marks, self._owed = [], [], None
            self._marking_records = 0

    async def _mark_owed(self, lead: Leadership) -> None:
        """Commit the owed marks until none is owed: whatever was appended while one
        transaction was in flight rides in the next, so a burst costs a few etcd writes and
        the appends never wait for etcd."""
        loop = asyncio.get_running_loop()
        while self._owed is not None:
            pause = self._marked_at + self._mark_interval - loop.time()
            if pause > 0 and not self._flush.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await self._flush.wait()
                continue  # more may be owed by now
            records, marks, (position, gaps) = self._owed_records, self._owed_marks, self._owed
            self._owed_records, self._owed_marks, self._owed = [], [], None
            self._marking_records = len(records)
            try:
                await self._commit(lead, records, marks, position, gaps)
            finally:
                self._marking_records = 0
                self._marked_at = loop.time()

    async def _commit(self, lead: Leadership, records: list[OutboxRecord], marks: list[str],
                      position: IdKey, gaps: tuple[PendingGap, ...]) -> None:
        """Advance the mark and delete the relayed keys: fenced, <= 128 ops per txn."""
        if not records:
            await self._put_mark(lead, position, gaps, [])
            return
        for start in range(0, len(records), MAX_DELETES_PER_TXN):
            part = records[start : start + MAX_DELETES_PER_TXN]
            end = start + len(part)
            mark = position if end >= len(records) else id_key(marks[end - 1])
            await self._put_mark(lead, mark, gaps, [r.key for r in part])

    async def _put_mark(
        self,
        lead: Leadership,
        mark: IdKey,
        gaps: Sequence[PendingGap],
        deletes: Sequence[str],
    ) -> None:
        mark = max(mark, self._mark)
        mark_key = self._layout.relay_mark
        value = RelayMark.encode(format_id(mark) if mark != (0, 0) else None, gaps)
        ops: list[Put | Delete] = [Put(mark_key, value, category="outbox")]
        ops.extend(Delete(key, category="outbox") for key in deletes)
        compares = [*lead.fence(), Compare.mod(mark_key, self._mark_mod)]
        result = await self._etcd.txn(compares, ops)
        if not result.succeeded:
            self._metrics.etcd_txns.labels("relay", "conflict").inc()
            await self._explain_failure(lead)
        self._metrics.etcd_txns.labels("relay", "committed").inc()
        for op in ops:
            self._metrics.etcd_writes.labels(op.category).inc()
        self._mark, self._mark_mod = mark, result.revision

    async def _explain_failure(self, lead: Leadership) -> None:
        """A failed relay txn: lost leadership (demote) or a moved mark (re-read)."""
        kv = await self._etcd.get(lead.key)
        if kv is None or kv.create_revision != lead.create_revision or kv.lease != lead.lease_id:
            raise NotLeader(f"relay election key {lead.key} is gone")
        raise Conflict("relay mark changed underneath")

    # -- overflow and poison --------------------------------------------------------------------
    async def _check_overflow_safely(self, lead: Leadership) -> None:
        try:
            await self._check_overflow(lead)
        except (Unavailable, Conflict, Compacted) as exc:
            log.warning("relay: outbox overflow check failed: %s", exc)

    async def _check_overflow(self, lead: Leadership) -> None:
        """Drop the oldest whole revisions beyond ``outbox_max`` and owe one EventsGap."""
        page = await self._etcd.range_prefix(self._layout.outbox_prefix, count_only=True)
        excess = page.count - self._outbox_max
        if excess <= 0:
            return
        # the oldest keys by mod revision; +MAX_TXN_OPS so the last revision is complete
        body: dict[str, Any] = {
            "key": b64(self._layout.outbox_prefix),
            "range_end": b64(prefix_end(self._layout.outbox_prefix.encode())),
            "sort_order": "ASCEND",
            "sort_target": "MOD",
            "limit": str(excess + MAX_TXN_OPS),
        }
        result = await self._etcd.post("/kv/range", body)
        kvs = [KeyValue.from_json(kv) for kv in result.get("kvs", [])]
        records, poison = _parse_all(kvs)
        records.sort(key=lambda r: r.order)
        take = records[:excess]
        if not take:
            return
        last_revision = take[-1].revision
        take.extend(r for r in records[excess:] if r.revision == last_revision)
        mark = RelayMark.decode(await self._etcd.get(self._layout.relay_mark))
        self._mark = id_key(mark.last_id) if mark.last_id else (0, 0)
        self._mark_mod = mark.mod_revision
        gaps = list(mark.gaps)
        dropped = 0
        for start in range(0, len(take), MAX_DELETES_PER_TXN):
            part = take[start : start + MAX_DELETES_PER_TXN]
            dropped += len(part)
            gaps = _merge_overflow(gaps, part, open_id=self._open_overflow)
            self._open_overflow = gaps[-1].event_id
            await self._put_mark(lead, self._mark, gaps, [r.key for r in part])
        self._gaps = tuple(gaps)
        self._metrics.events_dropped.inc(dropped)
        self._metrics.state_store_writes.labels("event_dropped").inc(dropped)
        log.error(
            "relay: outbox over %d records while Redis is unreachable: dropped the %d oldest "
            "(%s .. %s); an EventsGap will mark the place",
            self._outbox_max, dropped, take[0].stream_id, take[-1].stream_id,
        )  # fmt: skip
        if poison:
            await self._drop_poison(lead, poison)

    async def _drop_poison(self, lead: Leadership, keys: list[str]) -> None:
        """Outbox keys that are not outbox records can never be relayed: delete them."""
        log.error("relay: deleting %d undecodable outbox keys: %s", len(keys), keys[:5])
        for start in range(0, len(keys), MAX_DELETES_PER_TXN):
            part = keys[start : start + MAX_DELETES_PER_TXN]
            await self._put_mark(lead, self._mark, self._gaps, part)
            self._metrics.events_dropped.inc(len(part))
            self._metrics.state_store_writes.labels("event_dropped").inc(len(part))

    # -- retention ------------------------------------------------------------------------------
    async def _trim_loop(self) -> None:
        if self._ttl_ms <= 0:
            return
        while True:
            await asyncio.sleep(self._trim_interval)
            now_ms = int(self._clock.now().timestamp() * 1000)
            try:
                removed = await self._log.trim_by_age(self._ttl_ms, now_ms)
            except StoreError as exc:
                log.info("relay: trim failed (retrying later): %s", exc)
                continue
            if removed:
                log.debug("relay: trimmed %d entries older than %d ms", removed, self._ttl_ms)


def _parse_all(kvs: Sequence[KeyValue]) -> tuple[list[OutboxRecord], list[str]]:
    records: list[OutboxRecord] = []
    poison: list[str] = []
    for kv in kvs:
        record = parse_record(kv)
        if record is None:
            poison.append(kv.key)
        else:
            records.append(record)
    return records, poison


def _merge_overflow(gaps: list[PendingGap], dropped: Sequence[OutboxRecord], *,
                    open_id: str | None) -> list[PendingGap]:
    """Add ``dropped`` to the owed overflow gap (still contiguous if still owed) or add one."""
    first, last = dropped[0].stream_id, dropped[-1].stream_id
    if gaps and gaps[-1].cause == CAUSE_OVERFLOW and gaps[-1].event_id == open_id:
        owed = gaps[-1]
        merged = PendingGap(
            event_id=owed.event_id,
            first=owed.first,
            last=last,
            dropped=(owed.dropped or 0) + len(dropped),
            cause=CAUSE_OVERFLOW,
        )
        return [*gaps[:-1], merged]
    gap = PendingGap(
        event_id=str(uuid.uuid4()),
        first=first,
        last=last,
        dropped=len(dropped),
        cause=CAUSE_OVERFLOW,
    )
    return [*gaps, gap]
