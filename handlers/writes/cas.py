"""Read-modify-write helpers over the projections, with CAS and bounded retry.

Every concurrent write path goes through here: read the record and its ``mod_revision`` from the
projection, let a mutator decide (returning False for "nothing to do", so nothing is written),
commit with a compare on the revision read, and on ``Conflict`` wait until the projection has
caught up with the write that won, then re-read and re-decide. A record is never written without
a compare, so a heartbeat on one replica and a reconcile on another cannot overwrite each other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from eventsource.commit import Change, Committed, Committer, retry_on_conflict
from eventsource.errors import Conflict, StoreError
from eventsource.etcd import Compare, Put
from eventsource.events import Event
from eventsource.keys import KeyLayout
from eventsource.records import Node, WorkloadStatus, copy_record, encode
from projections.cluster import ClusterProjection
from projections.prefix import PrefixProjection

R = TypeVar("R")

#: mutator result: None = no change; otherwise the events the change causes
Mutator = Callable[[R], list[Event] | None]


class NotFound(LookupError):
    """The record to update does not exist."""


class KeyedLocks:
    """One asyncio lock per key, dropped when nobody holds or waits for it (bounded memory)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class StateWriter:
    """CAS updates of node and workload-status records.

    Writers of one record inside this replica queue on a per-key lock instead of racing each
    other into CAS conflicts; CAS still decides between replicas.
    """

    def __init__(self, cluster: ClusterProjection, committer: Committer, layout: KeyLayout) -> None:
        self.cluster = cluster
        self.committer = committer
        self.layout = layout
        self.locks = KeyedLocks()

    async def _update(
        self,
        projection: PrefixProjection[R],
        item_id: str,
        key: str,
        category: str,
        mutate: Mutator[R],
        *,
        kind: str,
        extra_puts: Callable[[R], list[Put]] | None = None,
        also_compare: Sequence[Compare] = (),
        fenced: bool = False,
    ) -> tuple[R, Committed | None]:
        async def attempt(n: int) -> tuple[R, Committed | None]:
            item = await projection.get_fresh(item_id)
            if item is None:
                raise NotFound(item_id)
            record = copy_record(item.value)
            events = mutate(record)
            if events is None:
                return record, None
            puts = [Put(key, encode(record), category=category)]
            if extra_puts is not None:
                puts.extend(extra_puts(record))
            change = Change(
                kind=kind, compares=[Compare.mod(key, item.mod_revision), *also_compare],
                puts=puts,
                events=events,
            )
            try:
                committed = await self.committer.commit(change, fenced=fenced)
            except Conflict as exc:
                if exc.revision:
                    await projection.wait_for_revision(exc.revision)
                raise
            # the next writer of this key (queued on its lock) must read this write
            with contextlib.suppress(StoreError):
                await projection.wait_for_revision(committed.revision, timeout=2.0)
            return record, committed

        async with self.locks.hold(key):
            return await retry_on_conflict(attempt)

    async def update_status(
        self, workload_id: str, mutate: Mutator[WorkloadStatus], *, kind: str = "status",
        fenced: bool = False,
    ) -> tuple[WorkloadStatus, Committed | None]:
        return await self._update(
            self.cluster.statuses, workload_id, self.layout.status(workload_id), "status",
            mutate, kind=kind, fenced=fenced,
        )

    async def update_node(
        self, node_id: str, mutate: Mutator[Node], *, kind: str = "node", fenced: bool = False,
        also_compare: Sequence[Compare] = (),
    ) -> tuple[Node, Committed | None]:
        """CAS update of a node record; ``also_compare``: more keys the decision read."""
        def status_key(node: Node) -> list[Put]:
            # the Go version's status string, rewritten only when it differs: an unchanged put
            # would cost etcd a write and every root watcher an event per label or taint change
            stored = self.cluster.node_statuses.get(f"{node_id}/status")
            value = node.status.encode()
            if stored is not None and stored.value == value:
                return []
            return [Put(self.layout.node_status(node_id), value, category="node")]

        return await self._update(
            self.cluster.nodes, node_id, self.layout.node(node_id), "node", mutate,
            kind=kind, extra_puts=status_key, also_compare=also_compare, fenced=fenced,
        )
