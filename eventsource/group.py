"""Group commit: concurrent CAS changes share one etcd transaction, each with its own outcome.

Why: one Python process reaches about 1,200 gateway transactions per second, and most writes
that happen at the same moment are independent CAS changes of different keys (a reconcile
cycle's Scheduled -> Running settles, heartbeats' status changes, placement batches, event
marks). etcd (3.3 and later) accepts nested transactions: an outer transaction without compares
whose success branch holds one sub-transaction per change. Each sub-transaction keeps its own
compares and succeeds or fails alone, so grouping changes nothing about what any one change
means; the group is applied at one revision, in one Raft entry and one gateway round trip.
A group is first sent flat (all compares, all writes: cheaper for etcd to decode), and nested
only when that fails on a compare (see ``AsyncEtcd.txn_group``).

Rules:

* a change is sent at once while fewer than ``max_inflight`` transactions are in flight;
  otherwise it waits and rides with the next one (no timer: grouping costs latency only when
  the store is already the queue);
* two changes that write the same key are never in flight together (etcd refuses a duplicate
  key in one transaction, and the later change must land after the earlier one): the later
  waits until the earlier has its answer;
* a change that deletes a prefix goes alone, when nothing else is in flight;
* a change that compares a whole prefix never shares a transaction with a change that writes
  under it: every compare of a group is evaluated before any of its writes, so two changes that
  each compare what the other writes (two creates checking that a name is still free) would
  both pass;
* a group is bounded by its number of changes, its bytes (etcd's request size limit) and
  etcd's operation limit, which a nested transaction shares with its parent: the number of
  changes plus the longest list of any of them stays within ``--max-txn-ops``;
* events get ``seq`` numbers unique across the whole transaction, so the stream ids
  ``"<revision>-<seq>"`` of two changes in one group never collide.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from eventsource.errors import LeaseLost, OutcomeUnknown, StoreError
from eventsource.etcd import MAX_TXN_OPS, AsyncEtcd, Compare, Delete, Put
from eventsource.events import Event
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.pump import BatchPump
from eventsource.tracing import CommitTiming

log = logging.getLogger("persys.commit")

#: an etcd request must stay below --max-request-bytes (1.5 MiB by default); values travel as
#: base64 inside JSON, so the raw bytes of a group are kept well under that
MAX_GROUP_BYTES = 512 * 1024
#: what one event's outbox record is counted as, before it is built
EVENT_BYTES = 400


def change_bytes(puts: list[Put], events: int) -> int:
    """The bytes a change adds to a request: its puts' keys and values, and its events."""
    return sum(len(p.key) + len(p.value) for p in puts) + EVENT_BYTES * events


@dataclass(slots=True)
class Pending:
    """One change waiting for its transaction."""

    kind: str
    compares: list[Compare]
    puts: list[Put]
    deletes: list[Delete]
    events: list[Event]
    outbox: bool
    future: asyncio.Future[tuple[bool, int]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    #: called with the revision once the change is committed, even when its caller has
    #: stopped waiting (cancelled): what must follow a commit does not depend on the caller
    on_commit: Callable[[int], None] | None = None
    #: when its caller is traced: when it was queued, sent and answered (``eventsource.tracing``)
    timing: CommitTiming | None = None

    def committed(self, succeeded: bool, revision: int) -> None:
        """Settle the caller and run ``on_commit`` (a success only)."""
        if self.timing is not None:
            self.timing.answered()
        if succeeded:
            after_commit(self.on_commit, revision, what=f"kind={self.kind}")
        settle(self.future, result=(succeeded, revision))

    def written_keys(self) -> set[str]:
        return {p.key for p in self.puts} | {d.key for d in self.deletes}

    def exclusive(self) -> bool:
        return any(d.prefix for d in self.deletes)

    def guarded_prefixes(self) -> list[str]:
        """Prefixes this change compares as a whole (``Compare.unchanged_since``)."""
        return [c.key for c in self.compares if c.prefix]

    def width(self) -> int:
        """The longest list of this change's transaction."""
        ops = len(self.puts) + len(self.deletes) + (len(self.events) if self.outbox else 0)
        return max(len(self.compares), ops)

    def size(self) -> int:
        return change_bytes(self.puts, len(self.events))

    def ops(self, layout: KeyLayout, first_seq: int) -> list[Put | Delete]:
        """The writes of this change, its events as outbox keys numbered from ``first_seq``."""
        ops: list[Put | Delete] = list(self.puts)
        if self.outbox:
            for seq, event in enumerate(self.events, start=first_seq):
                ops.append(Put(layout.outbox(event.event_id), event.outbox_record(seq=seq),
                               category="outbox"))
        ops.extend(self.deletes)
        return ops


def _under(keys: set[str], prefixes: list[str]) -> bool:
    """Whether any of ``keys`` lies under any of ``prefixes``."""
    return any(key.startswith(prefix) for key in keys for prefix in prefixes)


T = TypeVar("T")


def after_commit(step: Callable[[int], None] | None, revision: int, *, what: str) -> None:
    """Run the step that must follow a commit. It runs inside the committer's own task, whose
    other callers must still be settled, so its failure is logged, never raised."""
    if step is None:
        return
    try:
        step(revision)
    except Exception:
        log.exception("after-commit step failed %s", what)


def settle(future: asyncio.Future[T], *, result: T | None = None,
           error: BaseException | None = None) -> None:
    """Resolve a waiting caller's future unless it is already done (its caller gave up)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)


class GroupCommit:
    """Queues changes and sends them as single or grouped etcd transactions."""

    def __init__(self, etcd: AsyncEtcd, layout: KeyLayout, metrics: Metrics, *,
                 max_inflight: int = 4, max_changes: int = 64) -> None:
        self.etcd = etcd
        self.layout = layout
        self.metrics = metrics
        self.max_changes = max_changes
        self._pump: BatchPump[Pending] = BatchPump(max_inflight=max_inflight, take=self._take,
                                                   send=self._send)
        #: keys written by the transactions in flight: a change writing one of them waits
        self._busy: set[str] = set()
        self._exclusive = False

    async def submit(self, pending: Pending) -> tuple[bool, int]:
        """Send ``pending``; returns (succeeded, revision) or raises ``StoreError``."""
        if self._pump.closed:
            raise StoreError("etcd writer closed")
        if pending.timing is not None:
            pending.timing.queued()
        self._pump.submit(pending)
        return await pending.future

    def _take(self, queue: deque[Pending]) -> list[Pending]:
        if self._exclusive:
            return []  # a prefix delete is in flight: it goes alone
        group: list[Pending] = []
        keys: set[str] = set(self._busy)
        #: what the group writes and which prefixes it compares as a whole
        group_written: set[str] = set()
        group_guarded: list[str] = []
        size = 0
        widest = 0
        kept: deque[Pending] = deque()
        blocked = False
        while queue:
            pending = queue.popleft()
            if pending.future.done():
                continue
            written = pending.written_keys()
            if pending.exclusive():
                if not blocked and not group and self._pump.inflight == 0:
                    self._exclusive = True
                    group.append(pending)
                    kept.extend(queue)
                    queue.clear()
                    break
                # everything behind a prefix delete waits for it
                blocked = True
                kept.append(pending)
                continue
            width = max(widest, pending.width())
            guarded = pending.guarded_prefixes()
            fits = (not blocked and len(group) < self.max_changes
                    and (not group or (size + pending.size() <= MAX_GROUP_BYTES
                                       and width + len(group) + 1 <= MAX_TXN_OPS))
                    and not (written & keys)
                    and not (group_guarded and _under(written, group_guarded))
                    and not (guarded and _under(group_written, guarded)))
            if fits:
                group.append(pending)
                size += pending.size()
                widest = width
                group_written |= written
                group_guarded += guarded
            else:
                kept.append(pending)
            # whatever writes a key that is waiting must wait behind it (order per key)
            keys |= written
        queue.extend(kept)
        for pending in group:
            self._busy |= pending.written_keys()
        return group

    async def _send(self, group: list[Pending]) -> None:
        try:
            if len(group) == 1:
                await self._send_one(group[0])
            else:
                await self._send_group(group)
        except StoreError as exc:
            refused = isinstance(exc, LeaseLost) or "duplicate key" in str(exc) or (
                "too many" in str(exc))
            if len(group) > 1 and refused and not isinstance(exc, OutcomeUnknown):
                # the whole transaction was refused, nothing applied: a dead lease in one
                # change (a node's liveness lease) must not fail the others; duplicate keys and
                # sizes are checked above and never expected, but stay correct anyway
                log.warning("group commit refused, sending one by one: %s", exc)
                for pending in group:
                    try:
                        await self._send_one(pending)
                    except StoreError as one:
                        settle(pending.future, error=one)
            else:
                for pending in group:
                    settle(pending.future, error=exc)
        finally:
            for pending in group:
                settle(pending.future, error=StoreError("transaction not sent"))
                self._busy -= pending.written_keys()
                if pending.exclusive():
                    self._exclusive = False

    async def _send_one(self, pending: Pending) -> None:
        self.metrics.etcd_txn_requests.labels("single").inc()
        if pending.timing is not None:
            pending.timing.sent(1, "single")
        result = await self.etcd.txn(pending.compares, pending.ops(self.layout, 0))
        pending.committed(result.succeeded, result.revision)

    async def _send_group(self, group: list[Pending]) -> None:
        self.metrics.etcd_txn_requests.labels("group").inc()
        subs: list[tuple[list[Compare], list[Put | Delete]]] = []
        seq = 0
        for pending in group:
            subs.append((pending.compares, pending.ops(self.layout, seq)))
            seq += len(pending.events)
            if pending.timing is not None:
                pending.timing.sent(len(group), "group")
        revision, outcomes, second_try = await self.etcd.txn_group(subs)
        if second_try:
            # sent flat first (unless too wide), then nested after a failed compare
            self.metrics.etcd_txn_requests.labels("group-nested").inc()
        for pending, succeeded in zip(group, outcomes, strict=True):
            pending.committed(succeeded, revision)

    async def aclose(self) -> None:
        await self._pump.aclose(
            lambda pending: settle(pending.future, error=StoreError("etcd writer closed")))
