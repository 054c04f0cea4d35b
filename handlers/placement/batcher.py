"""Group commit of placements: many new workloads per etcd transaction.

Why: one Python process reaches about a thousand single-key CAS transactions per second through
the etcd gateway, while a transaction of 64 keys costs little more than one of one key
(docs/benchmark.md). Like Nomad's plan applier, placements decided concurrently are queued and
committed together. Correctness does not depend on the batching:

* the allocation of each node in a batch is recomputed at flush time from the newest known
  allocation (the projection, or this batcher's own last commit if that is newer) plus the
  batch's additions, and the fit is re-checked there; an intent that no longer fits is sent
  back to its caller as a ``Conflict`` (it re-decides);
* an intent whose node record changed since the decision (drained, tainted, NotReady) goes
  back to its caller as a ``Conflict``, so the flush never commits a decision the node no
  longer allows;
* the transaction compares each touched allocation's and node's revision, and each new
  workload's absence, so a batch built on stale state fails as a whole;
* a failed batch is rebuilt once on fresh state; if it fails again every intent goes back to
  its caller as a ``Conflict``;
* a node is in at most one batch in flight, so two batches never race for one allocation.

Each caller awaits its own future: it learns the commit revision or the reason.

Traced (a tracer, and the caller's span recorded), a caller's trace shows a
``placement.commit`` span with, from timestamps taken on the way, the wait for its batch and the
group commit's wait as attributes and the etcd transaction as a child span; its events carry
that span's context, and its ``on_commit`` (the agent apply) runs in the caller's context, so the
agent call joins the caller's trace although a batch task of this batcher starts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from eventsource import tracing
from eventsource.commit import Change, Committer
from eventsource.errors import Conflict, StoreError
from eventsource.etcd import MAX_TXN_OPS, Compare, Put
from eventsource.events import Event
from eventsource.group import MAX_GROUP_BYTES, after_commit, change_bytes, settle
from eventsource.keys import KeyLayout
from eventsource.pump import BatchPump
from eventsource.records import Allocation, encode
from eventsource.tracing import CommitTiming
from projections.cluster import ClusterProjection

log = logging.getLogger("persys.batcher")

#: puts per node (allocation); an intent costs its own puts and events
NODE_OPS = 1
#: room left in a batch's bytes for its allocation records (one per node, a few KB each)
ALLOCATION_MARGIN = 64 * 1024


@dataclass(slots=True)
class Intent:
    """One decided placement of a new workload, waiting to be committed."""

    workload_id: str
    node_id: str
    cpu_m: int
    mem_mb: int
    compares: list[Compare]
    puts: list[Put]
    events: list[Event]
    #: the node record's mod revision the decision saw: a drain, taint or status change that
    #: lands before the flush sends the intent back to be decided again
    node_mod: int = 0
    #: committed in a transaction of its own: it compares keys other workloads' intents may
    #: also compare (a disk), and one of those failing would fail every intent batched with it
    alone: bool = False
    #: called with the revision once committed, even if the caller stopped waiting (its
    #: client's deadline) after the intent went into a batch: the agent apply that follows
    #: a placement must not be lost with the caller
    on_commit: Callable[[int], None] | None = None
    future: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    #: set by ``submit`` when the caller is traced
    trace: IntentTrace | None = None

    def size(self) -> int:
        """Bytes this intent adds to a transaction (counted as GroupCommit counts a change)."""
        return change_bytes(self.puts, len(self.events))

    def ops(self) -> int:
        """Writes this intent adds to a transaction (each event is an outbox put)."""
        return len(self.puts) + len(self.events)

    def keys(self) -> set[str]:
        """The keys it compares: two intents comparing one key (a disk two workloads want)
        never share a transaction, where both compares would pass before either write."""
        return {c.key for c in self.compares}


@dataclass(slots=True)
class IntentTrace:
    """When a traced intent was queued and taken, and how its last commit attempt went."""

    submitted_ns: int = field(default_factory=time.time_ns)
    taken_ns: int = 0
    batch_size: int = 0
    commit: CommitTiming | None = None


class PlacementBatcher:
    def __init__(self, committer: Committer, cluster: ClusterProjection, layout: KeyLayout, *,
                 max_inflight: int = 4, max_intents: int = 24,
                 tracer: Tracer | None = None) -> None:
        self.committer = committer
        #: None: traces are not exported (no spans, no timestamps)
        self.tracer = tracer
        self.cluster = cluster
        self.layout = layout
        self.max_intents = max_intents
        self._pump: BatchPump[Intent] = BatchPump(max_inflight=max_inflight, take=self._take,
                                                  send=self._flush)
        self._busy: set[str] = set()
        #: keys compared by intents of batches in flight (see ``Intent.keys``)
        self._busy_keys: set[str] = set()
        #: node id -> (allocation, mod revision) of this batcher's newest commit
        self._committed: dict[str, tuple[Allocation, int]] = {}
        #: batches committed and intents per batch (for metrics and tests)
        self.batches = 0
        self.intents_committed = 0

    async def submit(self, intent: Intent) -> int:
        """Queue ``intent``; returns the commit revision or raises ``Conflict``/``StoreError``."""
        if self._pump.closed:
            raise StoreError("scheduler shutting down")
        if self.tracer is None or not tracing.recording():
            self._pump.submit(intent)
            return await intent.future
        return await self._submit_traced(intent, self.tracer)

    async def _submit_traced(self, intent: Intent, tracer: Tracer) -> int:
        # the span is not made current: nothing below makes spans in this task
        span = tracer.start_span("placement.commit", kind=SpanKind.INTERNAL,
                                 attributes={tracing.WORKLOAD_ID: intent.workload_id,
                                             tracing.NODE_ID: intent.node_id})
        intent.events = tracing.stamp(intent.events,
                                      tracing.traceparent_of(span.get_span_context()))
        intent.on_commit = tracing.in_context(otel_context.get_current(), intent.on_commit)
        trace = intent.trace = IntentTrace()
        outcome = "error"
        try:
            revision = await self._submit_untraced(intent)
            outcome = "committed"
            span.set_attribute(tracing.COMMIT_REVISION, revision)
            return revision
        except Conflict:
            outcome = "conflict"
            raise
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, repr(exc)))
            raise
        finally:
            span.set_attribute(tracing.COMMIT_OUTCOME, outcome)
            self._draw(tracer, span, trace)
            span.end()

    async def _submit_untraced(self, intent: Intent) -> int:
        self._pump.submit(intent)
        return await intent.future

    @staticmethod
    def _draw(tracer: Tracer, span: Span, trace: IntentTrace) -> None:
        """The wait for a batch and the batch's way through the group commit, on the
        caller's commit span."""
        taken = trace.taken_ns or time.time_ns()
        span.set_attribute(tracing.BATCH_WAIT_MS, (taken - trace.submitted_ns) / 1e6)
        span.set_attribute("scheduler.batch_size", trace.batch_size)
        if trace.commit is not None:
            tracing.draw_commit(tracer, span, trace.commit)

    def _take(self, queue: deque[Intent]) -> list[Intent]:
        batch: list[Intent] = []
        nodes: set[str] = set()
        workloads: set[str] = set()
        keys: set[str] = set()
        ops = 0
        size = 0
        kept: deque[Intent] = deque()
        while queue:
            intent = queue.popleft()
            if intent.future.done():
                continue
            intent_keys = intent.keys()
            if (batch and (intent.alone or batch[0].alone)) or intent.node_id in self._busy \
                    or intent.workload_id in workloads or (intent_keys & keys) \
                    or (intent_keys & self._busy_keys):
                # a duplicate id (a client retry) would put the same keys twice in one txn
                kept.append(intent)
                continue
            cost = intent.ops() + (0 if intent.node_id in nodes else NODE_OPS)
            intent_bytes = intent.size()
            # an etcd request has a size limit: large specs go in smaller batches (a single
            # intent always goes, ApplyWorkload bounds its spec)
            too_big = bool(batch) and size + intent_bytes > MAX_GROUP_BYTES - ALLOCATION_MARGIN
            if len(batch) >= self.max_intents or ops + cost > MAX_TXN_OPS or too_big:
                kept.append(intent)
                continue
            batch.append(intent)
            nodes.add(intent.node_id)
            workloads.add(intent.workload_id)
            keys |= intent_keys
            ops += cost
            size += intent_bytes
        queue.extend(kept)
        self._busy |= nodes
        self._busy_keys |= keys
        traced = [i.trace for i in batch if i.trace is not None]
        if traced:
            taken = time.time_ns()
            for trace in traced:
                trace.taken_ns = taken
                trace.batch_size = len(batch)
        return batch

    def _base(self, node_id: str) -> tuple[Allocation, int]:
        item = self.cluster.allocations.get(node_id)
        mine = self._committed.get(node_id)
        # our own commit counts only while the projection has not reached it; afterwards the
        # projection is the truth (the key may have been rewritten or deleted since)
        if mine is not None and mine[1] > self.cluster.allocations.revision:
            return mine[0].clone(), mine[1]
        self._committed.pop(node_id, None)
        if item is None:
            return Allocation(node_id=node_id), 0
        return item.value.clone(), item.mod_revision

    def _build(self, batch: list[Intent]) -> tuple[Change, list[Intent], dict[str, Allocation]]:
        change = Change(kind="placement")
        accepted: list[Intent] = []
        allocations: dict[str, tuple[Allocation, int]] = {}
        for intent in batch:
            if intent.future.done():
                continue  # the caller gave up (cancelled): do not commit on its behalf
            node_item = self.cluster.nodes.get(intent.node_id)
            if node_item is None:
                settle(intent.future, error=Conflict("node vanished"))
                continue
            if intent.node_mod and node_item.mod_revision != intent.node_mod:
                # the flush compares the node as it is now; a decision taken on an older
                # record (before a drain or a NoSchedule taint) must not ride on that compare
                settle(intent.future, error=Conflict(f"{intent.node_id} changed after the "
                                                     "decision"))
                continue
            if intent.node_id not in allocations:
                allocations[intent.node_id] = self._base(intent.node_id)
            allocation = allocations[intent.node_id][0]
            trial = allocation.clone()
            trial.add(intent.workload_id, intent.cpu_m, intent.mem_mb)
            node = node_item.value
            cpu_total = round(node.total_cpu * 1000)
            if (intent.cpu_m > 0 and trial.cpu_millicores > cpu_total) or (
                intent.mem_mb > 0 and trial.memory_mb > node.total_memory
            ):
                settle(intent.future, error=Conflict(f"{intent.node_id} filled up meanwhile"))
                continue
            allocations[intent.node_id] = (trial, allocations[intent.node_id][1])
            change.compares.extend(intent.compares)
            change.puts.extend(intent.puts)
            change.events.extend(intent.events)
            accepted.append(intent)
        final: dict[str, Allocation] = {}
        for node_id, (allocation, mod) in allocations.items():
            node_item = self.cluster.nodes.get(node_id)
            if node_item is None or not any(i.node_id == node_id for i in accepted):
                continue
            change.compares.append(Compare.mod(self.layout.allocation(node_id), mod))
            change.compares.append(Compare.mod(self.layout.node(node_id),
                                               node_item.mod_revision))
            change.puts.append(Put(self.layout.allocation(node_id), encode(allocation),
                                   category="allocation"))
            final[node_id] = allocation
        return change, accepted, final

    async def _flush(self, batch: list[Intent]) -> None:
        nodes = {i.node_id for i in batch}
        original = list(batch)
        try:
            for attempt in (1, 2):
                change, accepted, final = self._build(batch)
                if not accepted:
                    return
                timing = None
                if any(i.trace is not None for i in accepted):
                    timing = CommitTiming()
                    for intent in accepted:
                        if intent.trace is not None:
                            intent.trace.commit = timing
                try:
                    committed = await self.committer.commit(change, timing=timing)
                except Conflict as exc:
                    batch = accepted
                    for node_id in final:
                        self._committed.pop(node_id, None)
                    if attempt == 2:
                        for intent in accepted:
                            settle(intent.future,
                                    error=Conflict(str(exc), revision=exc.revision))
                        return
                    if exc.revision:
                        await self.cluster.wait_for(exc.revision,
                                                    which=("nodes", "allocations", "specs"))
                    continue
                for node_id, allocation in final.items():
                    self._committed[node_id] = (allocation, committed.revision)
                self.batches += 1
                self.intents_committed += len(accepted)
                for intent in accepted:
                    after_commit(intent.on_commit, committed.revision,
                                 what=f"workload_id={intent.workload_id}")
                    settle(intent.future, result=committed.revision)
                return
        except (StoreError, ValueError) as exc:
            for intent in original:
                settle(intent.future, error=exc)
        finally:
            # cancelled (shutdown) or failed in an unexpected way: nobody may wait forever
            for intent in original:
                settle(intent.future, error=StoreError("placement not committed"))
            self._busy -= nodes
            for intent in original:
                self._busy_keys -= intent.keys()
            self._forget_stale()

    def _forget_stale(self) -> None:
        """Drop remembered commits the projection has caught up with (bounded memory)."""
        if len(self._committed) < 4096:
            return
        for node_id, (_, mod) in list(self._committed.items()):
            if self.cluster.allocations.revision >= mod:
                del self._committed[node_id]

    async def aclose(self) -> None:
        await self._pump.aclose(
            lambda intent: settle(intent.future, error=StoreError("scheduler shutting down")))
