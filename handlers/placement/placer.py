"""The shell around the pure placement function.

Keeps, incrementally from the projections, what ``placement.place`` reads: the ``NodeInfo`` of
every node (rebuilt only for the node that changed), the allocation sums per node, the workload
counts for spread, the liveness set, and this replica's in-flight reservations.

Traced (a tracer, and the caller's span recorded), each decision is a ``placement.decide`` span
with the workload, its type, the node chosen (or why none) and how many nodes were visited.
"""

from __future__ import annotations

import time
from collections import ChainMap
from collections.abc import Mapping

from opentelemetry.trace import SpanKind, Tracer

from eventsource import tracing
from eventsource.clock import Clock
from eventsource.metrics import Metrics
from eventsource.records import Allocation, Node
from handlers.placement.decision import (
    NodeInfo,
    PlacementDecision,
    PlacementRequest,
    canonical_driver,
    canonical_type,
    place,
)
from handlers.placement.explanation import Explanation, explain
from handlers.placement.reservations import Reservations
from projections.cluster import ClusterProjection
from projections.prefix import Item


def node_info(node: Node) -> NodeInfo:
    drivers = {"local"} | {canonical_driver(d) for d in node.supported_storage_drivers}
    for key, value in node.labels.items():
        if key.startswith("storage.") and value.lower() == "true":
            drivers.add(canonical_driver(key[len("storage."):]))
    hypervisor = (node.extra or {}).get("hypervisor") or {}
    hv_ok = isinstance(hypervisor, dict) and (
        bool(hypervisor.get("type")) or str(hypervisor.get("status", "")).lower()
        in ("active", "ready")
    )
    return NodeInfo(
        node_id=node.node_id,
        status=node.status,
        cpu_total_m=round(node.total_cpu * 1000),
        mem_total_mb=int(node.total_memory),
        labels=dict(node.labels),
        taints=tuple((t.key, t.value, t.effect) for t in node.taints),
        workload_types=frozenset(canonical_type(t) for t in node.supported_workload_types),
        storage_drivers=frozenset(drivers),
        hypervisor_ok=hv_ok,
    )


class _NodeIndex:
    """NodeInfo by node id plus a stable list for the rotation."""

    def __init__(self) -> None:
        self.infos: dict[str, NodeInfo] = {}
        self._list: list[NodeInfo] | None = []

    def changed(self, item_id: str, old: Item[Node] | None, new: Item[Node] | None) -> None:
        if new is None:
            self.infos.pop(item_id, None)
        else:
            self.infos[item_id] = node_info(new.value)
        self._list = None

    def reset(self, items: dict[str, Item[Node]]) -> None:
        self.infos = {k: node_info(v.value) for k, v in items.items()}
        self._list = None

    def as_list(self) -> list[NodeInfo]:
        if self._list is None:
            self._list = [self.infos[k] for k in sorted(self.infos)]
        return self._list


class _AllocationSums(Mapping[str, tuple[int, int]]):
    def __init__(self) -> None:
        self.sums: dict[str, tuple[int, int]] = {}

    def changed(
        self, item_id: str, old: Item[Allocation] | None, new: Item[Allocation] | None
    ) -> None:
        if new is None:
            self.sums.pop(item_id, None)
        else:
            self.sums[item_id] = (new.value.cpu_millicores, new.value.memory_mb)

    def reset(self, items: dict[str, Item[Allocation]]) -> None:
        self.sums = {k: (v.value.cpu_millicores, v.value.memory_mb) for k, v in items.items()}

    def __getitem__(self, key: str) -> tuple[int, int]:
        return self.sums[key]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.sums)

    def __len__(self) -> int:
        return len(self.sums)


class _ConfirmHolds:
    """Allocation listener: a hold ends once the node's allocation counts its workload."""

    def __init__(self, reservations: Reservations) -> None:
        self.reservations = reservations

    def changed(
        self, item_id: str, old: Item[Allocation] | None, new: Item[Allocation] | None
    ) -> None:
        if new is not None:
            self.reservations.confirm_node(item_id, new.value.workloads)

    def reset(self, items: dict[str, Item[Allocation]]) -> None:
        for node_id, item in items.items():
            self.reservations.confirm_node(node_id, item.value.workloads)


class Placer:
    """Decides placements over this replica's projections."""

    def __init__(
        self,
        cluster: ClusterProjection,
        clock: Clock,
        metrics: Metrics,
        *,
        reservation_ttl: float,
        sample: int = 32,
        lane: tuple[int, int] = (0, 1),
        tracer: Tracer | None = None,
    ) -> None:
        #: None: traces are not exported, and decisions make no spans
        self.tracer = tracer
        self.cluster = cluster
        self.clock = clock
        self.metrics = metrics
        self.sample = sample
        #: (shard index, shard count): where this replica's sampling starts (placement.place)
        self.lane = lane
        self.nodes = _NodeIndex()
        self.allocated = _AllocationSums()
        cluster.nodes.listeners.append(self.nodes)
        cluster.allocations.listeners.append(self.allocated)
        self.reservations = Reservations(reservation_ttl, confirmed=self._allocation_has)
        cluster.allocations.listeners.append(_ConfirmHolds(self.reservations))

    def _allocation_has(self, node_id: str, workload_id: str) -> bool:
        item = self.cluster.allocations.get(node_id)
        return item is not None and workload_id in item.value.workloads

    def decide(self, req: PlacementRequest) -> PlacementDecision:
        if self.tracer is None or not tracing.recording():
            return self._decide(req)
        # no child spans: not made current
        span = self.tracer.start_span("placement.decide", kind=SpanKind.INTERNAL,
                                      attributes={tracing.WORKLOAD_ID: req.workload_id,
                                                  tracing.WORKLOAD_TYPE: req.workload_type})
        try:
            decision = self._decide(req)
            span.set_attribute("scheduler.nodes_visited", decision.visited)
            if decision.node_id is not None:
                span.set_attribute(tracing.NODE_ID, decision.node_id)
            else:
                span.set_attribute("scheduler.placement_refused", decision.reason[:1000])
            return decision
        finally:
            span.end()

    def _decide(self, req: PlacementRequest) -> PlacementDecision:
        self.reservations.prune(self.clock.monotonic())
        # thread CPU time: wall time here would mostly measure waits for the GIL
        started = time.thread_time()
        decision = place(
            req,
            self.nodes.as_list(),
            alive=self.cluster.alive.items,
            # the plain dicts: Mapping.get on a wrapper costs an exception per miss
            allocated=self.allocated.sums,
            reserved=self.reservations.by_node,
            counts=self.cluster.workloads.counts,
            max_count=self.cluster.workloads.max_count,
            sample=self.sample,
            lane=self.lane,
        )
        self.metrics.placement_decision_seconds.observe(time.thread_time() - started)
        return decision

    def explain(self, req: PlacementRequest, *, top: int,
                leave_out: tuple[str, int, int] | None = None) -> Explanation:
        """``decide``'s inputs, explained; ``leave_out`` = (node, cpu, mem) takes a placed
        workload off its node (its allocation and its count), so it is judged as it was when
        it was placed."""
        self.reservations.prune(self.clock.monotonic())
        allocated: Mapping[str, tuple[int, int]] = self.allocated.sums
        counts: Mapping[str, int] = self.cluster.workloads.counts
        max_count = self.cluster.workloads.max_count
        if leave_out is not None:
            node_id, cpu_m, mem_mb = leave_out
            cpu, mem = allocated.get(node_id, (0, 0))
            allocated = ChainMap({node_id: (max(0, cpu - cpu_m), max(0, mem - mem_mb))},
                                 self.allocated.sums)
            counts = ChainMap({node_id: max(0, counts.get(node_id, 0) - 1)}, dict(counts))
            max_count = max(counts.values(), default=0)
        return explain(
            req, self.nodes.as_list(), alive=self.cluster.alive.items, allocated=allocated,
            reserved=self.reservations.by_node, counts=counts, max_count=max_count,
            sample=self.sample, lane=self.lane, top=top)

    def reserve(self, workload_id: str, node_id: str, cpu_m: int, mem_mb: int) -> None:
        self.reservations.reserve(workload_id, node_id, cpu_m, mem_mb, self.clock.monotonic())

    def release(self, workload_id: str) -> None:
        self.reservations.release(workload_id)
