"""The cluster state every replica serves reads and placement from.

It composes one ``PrefixProjection`` per etcd prefix (nodes, workload specs, workload statuses,
allocations, liveness keys) and keeps the secondary indexes hot paths need, updated
incrementally as changes are folded, never rebuilt per request:

* workloads by node (for ListWorkloads by node, drain, reconcile and the spread score),
* unassigned workloads (reconcile places them),
* per-node counts of live workloads (spread factor) and their running maximum,
* per-node change stamps (reconcile skips re-checking nodes whose inputs did not change).

All of it lives on the event loop thread; a synchronous reader never sees half of a batch.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

from eventsource.errors import Compacted, StoreError, Unavailable, WatchCanceled
from eventsource.etcd import AsyncEtcd
from eventsource.keys import KeyLayout
from eventsource.metrics import DESIRED_STATES, NODE_STATUSES, WORKLOAD_STATUSES, Metrics
from eventsource.records import Allocation, Node, WorkloadSpec, WorkloadStatus, decode
from eventsource.watch import WatchBatch, WatchEvent, WatchStream
from projections.gauges import LabelGauge
from projections.prefix import Item, PrefixProjection

log = logging.getLogger("persys.projection")

#: statuses that no longer hold a node's capacity or count for spread
INACTIVE_STATUSES = frozenset({"completed", "deleted"})


def _decode_node(item_id: str, raw: bytes) -> Node | None:
    return decode(Node, raw)


def _decode_spec(item_id: str, raw: bytes) -> WorkloadSpec | None:
    return decode(WorkloadSpec, raw)


def _decode_status(item_id: str, raw: bytes) -> WorkloadStatus | None:
    return decode(WorkloadStatus, raw)


def _decode_allocation(item_id: str, raw: bytes) -> Allocation | None:
    return decode(Allocation, raw)


def _decode_alive(item_id: str, raw: bytes) -> bytes | None:
    return raw


def _decode_node_status(item_id: str, raw: bytes) -> bytes | None:
    return raw


def _is_node_record(item_id: str) -> bool:
    return "/" not in item_id


def _is_node_status(item_id: str) -> bool:
    node_id, _, leaf = item_id.partition("/")
    return bool(node_id) and leaf == "status"


def node_of(status: WorkloadStatus) -> str:
    return status.node_id or status.assigned_node


class WorkloadIndex:
    """Workloads by node, unassigned workloads, live counts per node, and per-node change stamps.

    Kept from status changes (and, for the stamps, spec changes) as they are folded. The stamps
    let a reconcile cycle tell that nothing planned for a node changed since the last cycle
    without looking at its workloads: every change of a status on a node or of the spec of a
    workload indexed on it gives the node a new stamp, and a re-list of either projection starts
    a new generation (``stamp`` includes it), so no stamp taken before a re-list matches after.
    """

    def __init__(self) -> None:
        self.by_node: dict[str, set[str]] = {}
        self.node_of: dict[str, str] = {}
        #: active workloads without a node, in the order they became so (placement order)
        self.unassigned: dict[str, None] = {}
        self.counts: Counter[str] = Counter()
        self._max_cache: int | None = 0
        self._stamps: dict[str, int] = {}
        self._clock = 0
        self._generation = 0

    def stamp(self, node_id: str) -> tuple[int, int]:
        """Equal across two reads only if nothing indexed on ``node_id`` changed in between."""
        return self._generation, self._stamps.get(node_id, 0)

    def touch(self, node_id: str) -> None:
        """Give ``node_id`` a new stamp. Only indexed nodes carry stamps (so they stay bounded
        by the nodes that hold workloads): a node without workloads answers stamp 0."""
        if node_id in self.by_node:
            self._clock += 1
            self._stamps[node_id] = self._clock

    def touch_workload(self, workload_id: str) -> None:
        """The spec of ``workload_id`` changed: its node (if it has one) has new inputs."""
        node = self.node_of.get(workload_id)
        if node is not None:
            self.touch(node)

    def _remove(self, workload_id: str) -> None:
        self.unassigned.pop(workload_id, None)
        node = self.node_of.pop(workload_id, None)
        if node is None:
            return
        members = self.by_node.get(node)
        if members is not None:
            members.discard(workload_id)
            if not members:
                del self.by_node[node]
                self._stamps.pop(node, None)  # a later touch takes a fresh (larger) clock value
        self.counts[node] -= 1
        if self.counts[node] <= 0:
            del self.counts[node]
        self._max_cache = None

    def _add(self, workload_id: str, status: WorkloadStatus) -> None:
        if status.status.lower() in INACTIVE_STATUSES:
            return
        node = node_of(status)
        if not node:
            self.unassigned[workload_id] = None
            return
        self.node_of[workload_id] = node
        self.by_node.setdefault(node, set()).add(workload_id)
        self.counts[node] += 1
        if self._max_cache is not None and self.counts[node] > self._max_cache:
            self._max_cache = self.counts[node]

    def changed(
        self,
        item_id: str,
        old: Item[WorkloadStatus] | None,
        new: Item[WorkloadStatus] | None,
    ) -> None:
        if old is not None:
            self.touch(node_of(old.value))  # while its old node still indexes it
        if (
            old is None
            or new is None
            or node_of(old.value) != node_of(new.value)
            or (old.value.status.lower() in INACTIVE_STATUSES)
            != (new.value.status.lower() in INACTIVE_STATUSES)
        ):
            self._remove(item_id)
            if new is not None:
                self._add(item_id, new.value)
        if new is not None:
            self.touch(node_of(new.value))  # once its new node indexes it

    def reset(self, items: dict[str, Item[WorkloadStatus]]) -> None:
        self.by_node.clear()
        self.node_of.clear()
        self.unassigned.clear()
        self.counts.clear()
        self._max_cache = None
        self.new_generation()
        for item_id, item in items.items():
            self._add(item_id, item.value)

    def new_generation(self) -> None:
        """Invalidate every stamp handed out so far (a projection was re-listed)."""
        self._generation += 1
        self._stamps.clear()

    @property
    def max_count(self) -> int:
        if self._max_cache is None:
            self._max_cache = max(self.counts.values(), default=0)
        return self._max_cache


class SpecChanges:
    """Listener on the specs projection: a changed spec gives its workload's node a new stamp."""

    def __init__(self, index: WorkloadIndex) -> None:
        self.index = index

    def changed(self, item_id: str, old: Item[WorkloadSpec] | None,
                new: Item[WorkloadSpec] | None) -> None:
        self.index.touch_workload(item_id)

    def reset(self, items: dict[str, Item[WorkloadSpec]]) -> None:
        self.index.new_generation()


class HostIndex:
    """Node ids by the host of their agent endpoint (``ip_address``, lower-cased): how many
    nodes one endpoint host holds, without a scan of every node per registration."""

    def __init__(self) -> None:
        self.by_host: dict[str, set[str]] = {}

    @staticmethod
    def key(host: str) -> str:
        """One spelling per host: an IP in its canonical form (an IPv4-mapped IPv6 address as
        its IPv4 address), a name lower-cased without a trailing dot."""
        text = host.strip().strip("[]").lower()
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            return text.rstrip(".")
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ip)

    def _remove(self, node_id: str, node: Node) -> None:
        ids = self.by_host.get(self.key(node.ip_address))
        if ids is not None:
            ids.discard(node_id)
            if not ids:
                del self.by_host[self.key(node.ip_address)]

    def changed(self, item_id: str, old: Item[Node] | None, new: Item[Node] | None) -> None:
        if old is not None:
            self._remove(item_id, old.value)
        if new is not None and new.value.ip_address:
            self.by_host.setdefault(self.key(new.value.ip_address), set()).add(item_id)

    def reset(self, items: dict[str, Item[Node]]) -> None:
        self.by_host = {}
        for item_id, item in items.items():
            self.changed(item_id, None, item)

    def at(self, host: str) -> set[str]:
        return set(self.by_host.get(self.key(host), ()))


class ClusterProjection:
    """Nodes, workloads, allocations and liveness of the whole cluster, on every replica."""

    def __init__(self, etcd: AsyncEtcd, layout: KeyLayout, metrics: Metrics) -> None:
        self.etcd = etcd
        self.metrics = metrics
        self.layout = layout
        self.nodes: PrefixProjection[Node] = PrefixProjection(
            etcd, layout.nodes_prefix, _decode_node, name="nodes", metrics=metrics,
            key_filter=_is_node_record,
        )
        #: the Go version's ``/nodes/<id>/status`` strings (item id ``<id>/status``), so a node
        #: update rewrites that key only when it differs from the record's status
        self.node_statuses: PrefixProjection[bytes] = PrefixProjection(
            etcd, layout.nodes_prefix, _decode_node_status, name="node_statuses",
            metrics=metrics, key_filter=_is_node_status,
        )
        self.specs: PrefixProjection[WorkloadSpec] = PrefixProjection(
            etcd, layout.specs_prefix, _decode_spec, name="specs", metrics=metrics,
        )
        self.statuses: PrefixProjection[WorkloadStatus] = PrefixProjection(
            etcd, layout.statuses_prefix, _decode_status, name="statuses", metrics=metrics,
        )
        self.allocations: PrefixProjection[Allocation] = PrefixProjection(
            etcd, layout.allocations_prefix, _decode_allocation, name="allocations",
            metrics=metrics,
        )
        self.alive: PrefixProjection[bytes] = PrefixProjection(
            etcd, layout.alive_prefix, _decode_alive, name="alive", metrics=metrics,
        )
        self.hosts = HostIndex()
        self.nodes.listeners.append(self.hosts)
        self.workloads = WorkloadIndex()
        self.statuses.listeners.append(self.workloads)
        self.specs.listeners.append(SpecChanges(self.workloads))
        # the Go state gauges, on every replica (projections/gauges.py)
        self.nodes.listeners.append(LabelGauge(
            metrics.nodes_status, lambda node: node.status, seeded=NODE_STATUSES))
        self.statuses.listeners.append(LabelGauge(
            metrics.workloads_status, lambda status: status.status, seeded=WORKLOAD_STATUSES))
        self.specs.listeners.append(LabelGauge(
            metrics.workloads_desired_state, lambda spec: spec.desired_state,
            seeded=DESIRED_STATES))

    @property
    def projections(self) -> list[PrefixProjection[object]]:
        every: list[Any] = [self.nodes, self.node_statuses, self.specs, self.statuses,
                            self.allocations, self.alive]
        return every

    def report_lag(self, current: int) -> None:
        """Set ``projection_lag_revisions`` from etcd's ``current`` revision: how far each
        projection is behind (0 while it keeps up; the watch's progress notifications advance
        an idle one)."""
        for projection in self.projections:
            self.metrics.projection_lag.labels(projection.name).set(
                max(0, current - projection.revision))

    def is_ready(self) -> bool:
        return all(p.ready.is_set() for p in self.projections)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(
            asyncio.gather(*(p.ready.wait() for p in self.projections)), timeout
        )

    async def wait_for(
        self, revision: int, *, timeout: float = 5.0, which: Iterable[str] = ()
    ) -> None:
        """Wait until the named projections (all by default) reflect ``revision``.

        One after another within one deadline, not gathered: the projections share one watch
        feed, so once the first shows the revision the others almost always do too, and a
        gather would cost a task per projection on every call (each command answer waits
        here)."""
        wanted = frozenset(which)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for p in self.projections:
            if (wanted and p.name not in wanted) or p.revision >= revision:
                continue
            await p.wait_for_revision(revision, max(deadline - loop.time(), 0.0))

    def workload_ids_on(self, node_id: str) -> set[str]:
        return set(self.workloads.by_node.get(node_id, ()))

    # -- one feed for every prefix --------------------------------------------------------
    async def relist(self) -> None:
        """List every prefix at one revision, so all projections start from the same state."""
        first = self.projections[0]
        kvs, revision = await self.etcd.list_prefix(first.prefix)
        listed = {first.prefix: kvs}
        loaded = [(first, kvs)]
        for projection in self.projections[1:]:
            if projection.prefix not in listed:
                listed[projection.prefix], _ = await self.etcd.list_prefix(
                    projection.prefix, revision=revision)
            loaded.append((projection, listed[projection.prefix]))
        for projection, items in loaded:
            projection.load(items, revision)

    def apply(self, batch: WatchBatch) -> None:
        """Fold one batch of the root watch into the projections it concerns.

        Every projection advances to the batch's revision, whether or not the batch touched
        it: they all reflect the same revision, and a transaction that spans prefixes (a
        placement writes spec, status and allocation) is never seen half-applied.
        """
        routed: dict[str, list[WatchEvent]] = {}
        projections = self.projections
        for event in batch.events:
            key = event.kv.key
            for projection in projections:
                # two projections share /nodes/ (records and status strings), so no break
                if key.startswith(projection.prefix):
                    routed.setdefault(projection.name, []).append(event)
        for projection in projections:
            projection.apply(WatchBatch(batch.revision, routed.get(projection.name, [])))

    async def run(self) -> None:
        """List all prefixes at R, then follow one watch over the root from R+1."""
        backoff = 0.2
        need_list = True
        root = self.layout.root + "/"
        while True:
            try:
                if need_list:
                    await self.relist()
                    need_list = False
                revision = min(p.revision for p in self.projections)
                stream = WatchStream(self.etcd.base_url, root, revision + 1, tls=self.etcd.tls)
                try:
                    async for batch in stream:
                        self.apply(batch)
                        backoff = 0.2
                finally:
                    stream.close()
            except Compacted:
                self.metrics.watch_restarts.labels("compacted").inc()
                log.info("cluster projection: compacted, re-listing")
                need_list = True
            except (WatchCanceled, Unavailable, StoreError) as exc:
                self.metrics.watch_restarts.labels("unavailable").inc()
                log.info("cluster projection: watch interrupted (%s), resuming", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
