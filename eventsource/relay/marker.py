"""The marker: commits the relay's marks in fenced etcd transactions while the pump appends on.

Why apart: what is appended is owed a mark. The marker task commits the owed marks (moving the
high-water mark and deleting the relayed outbox keys, at most 128 operations per transaction,
the mark put in every one), paced by ``mark_interval``; whatever is appended while one
transaction is in flight rides in the next. A failed transaction tells a lost leadership
(``NotLeader``) from a mark moved underneath (``Conflict``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from eventsource.election import Leadership
from eventsource.errors import Conflict, NotLeader, StoreError
from eventsource.etcd import MAX_TXN_OPS, AsyncEtcd, Compare, Delete, Put
from eventsource.metrics import Metrics
from eventsource.relay.marks import PendingGap, RelayMark
from eventsource.relay.outbox import IdKey, OutboxRecord
from eventsource.relay.view import StreamView
from eventsource.stream.entries import format_id, id_key

log = logging.getLogger("persys.relay")

#: every relay txn holds the mark put plus at most 127 deletes (etcd's default --max-txn-ops)
MAX_DELETES_PER_TXN = MAX_TXN_OPS - 1
#: the least time between two mark transactions of the marker: at a steady rate the outbox
#: deletes cost a few etcd writes per second instead of one per append (a settle does not wait)
MARK_INTERVAL_S = 0.1


class Marker:
    """The marks owed for what was appended, and the task that commits them."""

    def __init__(self, etcd: AsyncEtcd, mark_key: str, metrics: Metrics, view: StreamView, *,
                 batch: int, instance_id: str, mark_interval: float) -> None:
        self._etcd = etcd
        self._mark_key = mark_key
        self._metrics = metrics
        self._view = view
        self._batch = batch
        self._instance_id = instance_id
        #: the marker task: commits the marks owed (below), one transaction batch at a time
        self.task: asyncio.Task[None] | None = None
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

    async def owe(self, lead: Leadership, records: list[OutboxRecord], marks: list[str],
                  position: IdKey, gaps: tuple[PendingGap, ...]) -> None:
        """Owe the marks of records just appended (``marks``: the mark after each record;
        ``position`` and ``gaps``: where the plan left the mark and what it still owes), and
        have them committed: by the marker task, or at once when more than a batch is owed."""
        self._owed_records.extend(records)
        self._owed_marks.extend(marks)
        self._owed = (position, gaps)
        marker = self.task
        if marker is not None and marker.done():
            self.task = None
            marker.result()  # its failure (lost fence, etcd down) surfaces here
        if len(self._owed_records) + self._marking_records > self._batch:
            # bounded: at most two batches appended but unmarked (what take_over reads back)
            await self.settle(lead)
        elif self.task is None:
            self.task = asyncio.create_task(self._mark_owed(lead),
                                            name=f"relay-mark:{self._instance_id}")

    def raise_failure(self) -> None:
        """Raise the failure of the marker task, which has failed (the caller saw it done)."""
        failed, self.task = self.task, None
        assert failed is not None
        failed.result()

    async def settle(self, lead: Leadership) -> None:
        """Mark everything appended; a failure (lost fence, etcd down) is raised here."""
        task, self.task = self.task, None
        self._flush.set()
        try:
            if task is not None:
                await task
            if self._owed is not None:
                await self._mark_owed(lead)
        finally:
            self._flush.clear()

    async def end(self, lead: Leadership, *, cancel: bool) -> None:
        """Leaving the relay loop: mark what is appended (or, when the relay is being
        cancelled, cancel the marker), and always await the marker, so none outlives the loop.

        Why mark first: what is appended is in the stream, and an overflow check that follows
        (Redis failed) must not drop those records from the outbox as undelivered. Never
        raises a store error: ``take_over`` reads the mark back from etcd, and whatever stays
        unmarked is re-appended and recognised.
        """
        task, self.task = self.task, None
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
            # what is still owed stays in the outbox: the next take_over reads the mark back
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
            await self.put_mark(lead, position, gaps, [])
            return
        for start in range(0, len(records), MAX_DELETES_PER_TXN):
            part = records[start : start + MAX_DELETES_PER_TXN]
            end = start + len(part)
            mark = position if end >= len(records) else id_key(marks[end - 1])
            await self.put_mark(lead, mark, gaps, [r.key for r in part])

    async def put_mark(
        self,
        lead: Leadership,
        mark: IdKey,
        gaps: Sequence[PendingGap],
        deletes: Sequence[str],
    ) -> None:
        """One fenced transaction: the mark (never moved back) and ``deletes`` of outbox keys."""
        view = self._view
        mark = max(mark, view.mark)
        mark_key = self._mark_key
        value = RelayMark.encode(format_id(mark) if mark != (0, 0) else None, gaps)
        ops: list[Put | Delete] = [Put(mark_key, value, category="outbox")]
        ops.extend(Delete(key, category="outbox") for key in deletes)
        compares = [*lead.fence(), Compare.mod(mark_key, view.mark_mod)]
        result = await self._etcd.txn(compares, ops)
        if not result.succeeded:
            self._metrics.etcd_txns.labels("relay", "conflict").inc()
            await self._explain_failure(lead)
        self._metrics.etcd_txns.labels("relay", "committed").inc()
        for op in ops:
            self._metrics.etcd_writes.labels(op.category).inc()
        view.mark, view.mark_mod = mark, result.revision

    async def _explain_failure(self, lead: Leadership) -> None:
        """A failed relay txn: lost leadership (demote) or a moved mark (re-read)."""
        kv = await self._etcd.get(lead.key)
        if kv is None or kv.create_revision != lead.create_revision or kv.lease != lead.lease_id:
            raise NotLeader(f"relay election key {lead.key} is gone")
        raise Conflict("relay mark changed underneath")
