"""A projection of one etcd prefix: list at revision R, then watch from R+1.

Why: every replica needs a current, in-memory view of nodes, workloads and allocations without
scanning etcd per request. The projection is a fold over an ordered change feed: it lists the
prefix with every page pinned to one revision, then applies watch batches in order. After a
compaction it re-lists; after a dropped connection it resumes from the last revision it reported.

Invariants:
* ``revision`` is the etcd revision the items reflect: every change with a revision <= it has
  been applied, none above it.
* listeners see every change exactly once, in revision order, and a ``reset`` after a re-list
  (with the full new contents) instead of per-key changes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from eventsource.errors import Compacted, StoreError, Unavailable, WatchCanceled
from eventsource.etcd import AsyncEtcd, KeyValue
from eventsource.metrics import Metrics
from eventsource.watch import WatchBatch, WatchStream

log = logging.getLogger("persys.projection")

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Item(Generic[R]):
    """A decoded value with the revisions CAS writers compare against."""

    value: R
    mod_revision: int
    create_revision: int
    lease: int


class Listener(Protocol[R]):
    def changed(self, item_id: str, old: Item[R] | None, new: Item[R] | None) -> None: ...

    def reset(self, items: dict[str, Item[R]]) -> None: ...


class PrefixProjection(Generic[R]):
    """The items under one prefix, keyed by the key's remainder after the prefix."""

    def __init__(
        self,
        etcd: AsyncEtcd,
        prefix: str,
        decode: Callable[[str, bytes], R | None],
        *,
        name: str,
        metrics: Metrics,
        key_filter: Callable[[str], bool] | None = None,
        watch_read_timeout: float = 5.0,
    ) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.name = name
        self._decode = decode
        self._key_filter = key_filter
        self._metrics = metrics
        self._watch_read_timeout = watch_read_timeout
        #: decoded items by id
        self.items: dict[str, Item[R]] = {}
        #: the same values without their revisions, kept in step with ``items``: a reconcile
        #: cycle snapshots 100,000 of them with one C-level ``dict.copy()`` (``snapshot``); a
        #: comprehension over ``items`` was, after the plan itself, the largest part of a
        #: 5,000-node cycle's plan phase in a profile
        self._values: dict[str, R] = {}
        #: the revision the items reflect
        self.revision = 0
        self.ready = asyncio.Event()
        self.listeners: list[Listener[R]] = []
        # a heap of (revision, sequence, future): a watch batch wakes the due waiters without
        # looking at the others (a registration burst waits with thousands at once)
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._waiter_seq = itertools.count()
        self.restarts = 0

    # -- reading ----------------------------------------------------------------------------
    def get(self, item_id: str) -> Item[R] | None:
        return self.items.get(item_id)

    async def get_fresh(self, item_id: str, timeout: float = 3.0) -> Item[R] | None:
        """``get``, but a miss is checked against etcd's current revision first.

        A record written a moment ago (by another RPC or another replica) may not have reached
        this projection yet; "not found" is only answered once the projection has caught up.
        """
        item = self.items.get(item_id)
        if item is not None:
            return item
        revision = await self.etcd.current_revision()
        try:
            await self.wait_for_revision(revision, timeout)
        except Unavailable:
            pass
        return self.items.get(item_id)

    def values(self) -> list[R]:
        return list(self._values.values())

    def snapshot(self) -> dict[str, R]:
        """A plain dict of every value as of now (a copy: later watch batches leave it be)."""
        return self._values.copy()

    async def wait_for_revision(self, revision: int, timeout: float = 5.0) -> None:
        """Wait until the projection reflects ``revision`` (read-your-writes)."""
        if self.revision >= revision:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (revision, next(self._waiter_seq), future))
        try:
            async with asyncio.timeout(timeout):  # not wait_for: one loop iteration less
                await future
        except TimeoutError as exc:
            # the cancelled future stays in the heap until its revision comes: _wake skips it
            raise Unavailable(
                f"projection {self.name} at revision {self.revision}, "
                f"did not reach {revision} within {timeout}s"
            ) from exc

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= self.revision:
            future = heapq.heappop(waiters)[2]
            if not future.done():
                future.set_result(None)

    # -- folding ----------------------------------------------------------------------------
    def _id_of(self, key: str) -> str | None:
        if not key.startswith(self.prefix):
            return None
        item_id = key[len(self.prefix) :]
        if not item_id or (self._key_filter is not None and not self._key_filter(item_id)):
            return None
        return item_id

    def _decode_kv(self, item_id: str, kv: KeyValue) -> Item[R] | None:
        try:
            value = self._decode(item_id, kv.value)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("projection %s: undecodable key %s: %s", self.name, kv.key, exc)
            return None
        if value is None:
            return None
        return Item(value, kv.mod_revision, kv.create_revision, kv.lease)

    def load(self, kvs: list[KeyValue], revision: int) -> None:
        """Replace the contents with a listing taken at ``revision``."""
        items: dict[str, Item[R]] = {}
        for kv in kvs:
            item_id = self._id_of(kv.key)
            if item_id is None:
                continue
            item = self._decode_kv(item_id, kv)
            if item is not None:
                items[item_id] = item
        self.items = items
        self._values = {item_id: item.value for item_id, item in items.items()}
        self.revision = revision
        for listener in self.listeners:
            listener.reset(items)
        self.ready.set()
        self._wake()

    def apply(self, batch: WatchBatch) -> None:
        """Fold one watch batch (already in revision order)."""
        for event in batch.events:
            if event.kv.mod_revision and event.kv.mod_revision <= self.revision:
                continue
            item_id = self._id_of(event.kv.key)
            if item_id is None:
                continue
            old = self.items.get(item_id)
            if event.deleted:
                if old is None:
                    continue
                del self.items[item_id]
                del self._values[item_id]
                new: Item[R] | None = None
            else:
                new = self._decode_kv(item_id, event.kv)
                if new is None:
                    self.items.pop(item_id, None)
                    self._values.pop(item_id, None)
                else:
                    self.items[item_id] = new
                    self._values[item_id] = new.value
            for listener in self.listeners:
                listener.changed(item_id, old, new)
        if batch.revision > self.revision:
            self.revision = batch.revision
        self._wake()

    async def relist(self) -> None:
        kvs, revision = await self.etcd.list_prefix(self.prefix)
        self.load(kvs, revision)

    async def run(self) -> None:
        """List, then follow; never returns unless cancelled."""
        await self._follow(need_list=True)

    async def run_from(self, revision: int) -> None:
        """Follow from ``revision + 1`` after a ``load`` taken at ``revision`` (replay, tests)."""
        self.revision = revision
        await self._follow(need_list=False)

    async def _follow(self, *, need_list: bool) -> None:
        backoff = 0.2
        while True:
            try:
                if need_list:
                    await self.relist()
                    need_list = False
                stream = WatchStream(
                    self.etcd.base_url,
                    self.prefix,
                    self.revision + 1,
                    read_timeout=self._watch_read_timeout,
                    tls=self.etcd.tls,
                )
                try:
                    async for batch in stream:
                        self.apply(batch)
                        backoff = 0.2
                finally:
                    stream.close()
            except Compacted:
                self.restarts += 1
                self._metrics.watch_restarts.labels("compacted").inc()
                log.info("projection %s: compacted, re-listing", self.name)
                need_list = True
            except (WatchCanceled, Unavailable, StoreError) as exc:
                self.restarts += 1
                self._metrics.watch_restarts.labels("unavailable").inc()
                log.info("projection %s: watch interrupted (%s), resuming", self.name, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
