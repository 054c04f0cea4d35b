"""Committing a decision: state changes and their events in one etcd transaction.

A handler decides a ``Change`` (puts, deletes, the compares its decision depends on, and the
events it causes) and ``commit`` applies it atomically. Events become outbox keys in the same
transaction, each carrying its ``seq``; the commit revision is the outbox key's ``mod_revision``,
so the stream id ``"<revision>-<seq>"`` is fixed at commit and every relay attempt computes the
same id. There is no "write etcd, then XADD" dual write anywhere.

``retry_on_conflict`` is the bounded, jittered re-read/re-decide loop every CAS writer uses.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from eventsource import tracing
from eventsource.errors import Conflict, StoreError
from eventsource.etcd import MAX_TXN_OPS, AsyncEtcd, Compare, Delete, Put
from eventsource.events import Event
from eventsource.group import GroupCommit, Pending
from eventsource.keys import KeyLayout
from eventsource.metrics import STATE_STORE_CATEGORIES, Metrics
from eventsource.tracing import CommitTiming


@dataclass(slots=True)
class Change:
    """What one decision writes. Empty changes are not committed."""

    kind: str
    compares: list[Compare] = field(default_factory=list)
    puts: list[Put] = field(default_factory=list)
    deletes: list[Delete] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.puts or self.deletes or self.events)

    def merge(self, other: Change) -> None:
        self.compares.extend(other.compares)
        self.puts.extend(other.puts)
        self.deletes.extend(other.deletes)
        self.events.extend(other.events)


@dataclass(frozen=True, slots=True)
class Committed:
    revision: int


class Committer:
    """Commits changes; owns the outbox switch and the transaction metrics."""

    def __init__(
        self,
        etcd: AsyncEtcd,
        layout: KeyLayout,
        metrics: Metrics,
        *,
        outbox_enabled: bool,
        fence: Callable[[], list[Compare]] | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.etcd = etcd
        self.layout = layout
        self.metrics = metrics
        self.outbox_enabled = outbox_enabled
        self._fence = fence
        #: None: traces are not exported, and commits make no spans at all
        self.tracer = tracer
        self._group = GroupCommit(etcd, layout, metrics)

    def set_fence(self, fence: Callable[[], list[Compare]] | None) -> None:
        self._fence = fence

    async def commit(self, change: Change, *, fenced: bool = False,
                     on_commit: Callable[[int], None] | None = None,
                     timing: CommitTiming | None = None) -> Committed:
        """Apply ``change`` atomically or raise ``Conflict``.

        ``fenced`` adds the leader fence (the compare on this replica's election key), used by
        every leader-only write. ``on_commit(revision)`` runs once the change is committed,
        also when the caller was cancelled meanwhile (a client that gave up at its deadline
        while the transaction was on its way): the step that must follow a commit (an agent
        call) is not lost with the caller.

        Traced (a tracer, and a recorded span current): an ``etcd.commit`` span (the wait for
        the group commit as an attribute, the transaction as a child span), the change's events
        carry its context, and ``on_commit`` runs in the caller's context
        (``eventsource.tracing``). ``timing``, when
        given, is filled in for a caller that draws those spans in traces of its own (the
        placement batcher's callers).
        """
        if self.tracer is None or not tracing.recording():
            return await self._commit(change, fenced, on_commit, timing, None)
        on_commit = tracing.in_context(otel_context.get_current(), on_commit)
        # not made current: nothing below makes spans in this task
        span = self.tracer.start_span("etcd.commit", kind=SpanKind.INTERNAL,
                                      attributes={tracing.COMMIT_KIND: change.kind})
        try:
            return await self._commit(change, fenced, on_commit, timing, span)
        except BaseException as exc:
            if not isinstance(exc, Conflict | StoreError):
                span.set_status(Status(StatusCode.ERROR, repr(exc)))
            raise
        finally:
            span.end()

    async def _commit(self, change: Change, fenced: bool,
                      on_commit: Callable[[int], None] | None, timing: CommitTiming | None,
                      span: Span | None) -> Committed:
        compares = list(change.compares)
        if fenced:
            if self._fence is None:
                raise Conflict("leader fence requested without leadership")
            compares.extend(self._fence())
        events = change.events if self.outbox_enabled else []
        if not (change.puts or change.deletes or events):
            self._count_unrecorded(change)
            if on_commit is not None:
                on_commit(0)
            return Committed(revision=0)
        ops = len(change.puts) + len(change.deletes) + len(events)
        if ops > MAX_TXN_OPS or len(compares) > MAX_TXN_OPS:
            # etcd's --max-txn-ops bounds each list of a transaction separately
            raise ValueError(f"transaction too large: {ops} ops, {len(compares)} compares")
        if span is not None:
            events = tracing.stamp(events, tracing.traceparent_of(span.get_span_context()))
            if timing is None:
                timing = CommitTiming()
        pending = Pending(kind=change.kind, compares=compares, puts=list(change.puts),
                          deletes=list(change.deletes), events=list(events),
                          outbox=self.outbox_enabled, on_commit=on_commit, timing=timing)
        try:
            succeeded, revision = await self._group.submit(pending)
        except StoreError as exc:
            if span is not None:
                self._trace_outcome(span, pending, "error", 0, error=str(exc))
            raise
        if span is not None:
            self._trace_outcome(span, pending, "committed" if succeeded else "conflict",
                                revision)
        if not succeeded:
            self.metrics.etcd_txns.labels(change.kind, "conflict").inc()
            raise Conflict(f"{change.kind}: a compared key changed", revision=revision)
        self.metrics.etcd_txns.labels(change.kind, "committed").inc()
        for put in change.puts:
            self.metrics.etcd_writes.labels(put.category).inc()
            if put.category in STATE_STORE_CATEGORIES:
                self.metrics.state_store_writes.labels(put.category).inc()
        for delete in change.deletes:
            self.metrics.etcd_writes.labels(delete.category).inc()
        if events:
            self.metrics.etcd_writes.labels("outbox").inc(len(events))
        else:
            self._count_unrecorded(change)
        return Committed(revision=revision)

    def _trace_outcome(self, span: Span, pending: Pending, outcome: str, revision: int, *,
                       error: str = "") -> None:
        assert self.tracer is not None
        assert pending.timing is not None
        tracing.draw_commit(self.tracer, span, pending.timing)
        span.set_attribute(tracing.COMMIT_OUTCOME, outcome)
        if revision:
            span.set_attribute(tracing.COMMIT_REVISION, revision)
        if pending.events:
            span.set_attribute("scheduler.events", len(pending.events))
        if error:
            span.set_status(Status(StatusCode.ERROR, error))

    def _count_unrecorded(self, change: Change) -> None:
        """Without Redis there is no outbox: a change's events are recorded nowhere, which the
        Go version (whose events went to Redis only) counted as dropped."""
        if change.events and not self.outbox_enabled:
            self.metrics.state_store_writes.labels("event_dropped").inc(len(change.events))

    async def aclose(self) -> None:
        """Fail what is still queued and stop the transactions in flight."""
        await self._group.aclose()


T = TypeVar("T")


async def retry_on_conflict(
    attempt: Callable[[int], Awaitable[T]],
    *,
    attempts: int = 6,
    base_delay: float = 0.005,
    max_delay: float = 0.2,
    rng: random.Random | None = None,
) -> T:
    """Run ``attempt(n)`` until it does not raise ``Conflict``, at most ``attempts`` times.

    Each attempt must re-read and re-decide. The delay is full jitter over an exponential cap.
    The last ``Conflict`` propagates.
    """
    rand = rng
    for n in range(attempts):
        try:
            return await attempt(n)
        except Conflict:
            if n == attempts - 1:
                raise
            if rand is None:
                # seeded only when needed: seeding from the OS costs more than most attempts
                rand = random.Random()
            cap = min(max_delay, base_delay * (2**n))
            await asyncio.sleep(rand.uniform(0, cap))
    raise AssertionError("unreachable")
