"""Assigning a workload to a node: the placer's decision turned into the CAS writes of the
assignment and the node's allocation, and the re-booking of a resized workload on its node.

Apart because ApplyWorkload, the relocator and the reconcile loop's placement all assign the
same way: the change compares the allocation's and the node's revisions, so two replicas, or
many concurrent handlers, cannot oversubscribe a node even when their projections are stale.
A lost compare re-decides on state that includes the winning write (``outcome.catch_up``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eventsource.clock import Clock
from eventsource.commit import Change
from eventsource.errors import Conflict
from eventsource.etcd import Compare, Put
from eventsource.events import Event, rfc3339
from eventsource.keys import KeyLayout
from eventsource.records import Allocation, Assignment, WorkloadSpec, WorkloadStatus, encode
from handlers.placement.decision import PlacementRequest, canonical_driver
from handlers.placement.placer import Placer
from handlers.specs.stored import request_of
from handlers.workloads.outcome import Outcome
from handlers.workloads.pending import clear_pending
from projections.cluster import ClusterProjection


@dataclass(slots=True)
class Placed:
    """A decided assignment: the change that books it and the status that shows it."""

    change: Change
    node_id: str
    reason: str
    spec: WorkloadSpec
    status: WorkloadStatus
    extra_events: list[Event] = field(default_factory=list)
    #: the chosen node's record revision the decision saw
    node_mod: int = 0


def required_drivers(spec: WorkloadSpec) -> frozenset[str]:
    volumes = list(spec.managed_volumes)
    if spec.vm:
        volumes.extend(spec.vm.get("managedVolumes", []) or [])
    return frozenset(canonical_driver(str(v.get("driver", ""))) for v in volumes)


def placement_request(spec: WorkloadSpec, *, exclude: frozenset[str] = frozenset(),
                      only: str = "") -> PlacementRequest:
    """What placement is asked for a stored spec (ApplyWorkload, the loops, explanations)."""
    cpu_m, mem_mb = request_of(spec)
    return PlacementRequest(
        workload_id=spec.id, workload_type=spec.type, cpu_m=cpu_m, mem_mb=mem_mb,
        selector=dict(spec.labels), required_drivers=required_drivers(spec), exclude=exclude,
        only=frozenset({only}) if only else frozenset(),
    )


class Assigner:
    """Decides a node for a workload on this replica's projections and books it."""

    def __init__(self, *, cluster: ClusterProjection, placer: Placer, clock: Clock,
                 layout: KeyLayout) -> None:
        self.cluster = cluster
        self.placer = placer
        self.clock = clock
        self.layout = layout

    def place(self, spec: WorkloadSpec, status: WorkloadStatus, *, exclude: frozenset[str]
              = frozenset(), only: str = "") -> Placed | Outcome:
        req = placement_request(spec, exclude=exclude, only=only)
        cpu_m, mem_mb = req.cpu_m, req.mem_mb
        decision = self.placer.decide(req)
        if decision.node_id is None:
            if only:
                return Outcome(False, "INSUFFICIENT_RESOURCES",
                               f"its local disk is on node {only!r}, which cannot take it: "
                               f"{decision.reason or 'node not found'}", unplaced=True)
            return Outcome(False, "INSUFFICIENT_RESOURCES", decision.reason, unplaced=True)
        node_id = decision.node_id
        node_item = self.cluster.nodes.get(node_id)
        alloc_item = self.cluster.allocations.get(node_id)
        if node_item is None:
            raise Conflict("chosen node vanished")
        allocation = alloc_item.value.clone() if alloc_item else Allocation(node_id=node_id)
        allocation.node_id = node_id
        allocation.add(spec.id, cpu_m, mem_mb)
        node = node_item.value
        if (allocation.cpu_millicores > round(node.total_cpu * 1000) and cpu_m > 0) or (
            allocation.memory_mb > node.total_memory and mem_mb > 0
        ):
            # the projection moved between decide and here; decide again
            raise Conflict("allocation changed under the decision")
        now = rfc3339(self.clock.now())
        status.node_id = node_id
        status.assigned_node = node_id
        status.status = "Scheduled"
        status.status_info.actual_state = "Pending"
        status.status_info.last_updated = now
        status.metadata["last_action"] = "Assigned"
        status.metadata["assignment_reason"] = decision.reason
        clear_pending(status)
        assignment = Assignment(workload_id=spec.id, node_id=node_id, reason=decision.reason,
                                created_at=now)
        change = Change(
            kind="placement",
            compares=[
                Compare.mod(self.layout.allocation(node_id),
                            alloc_item.mod_revision if alloc_item else 0),
                Compare.mod(self.layout.node(node_id), node_item.mod_revision),
            ],
            puts=[
                Put(self.layout.assignment(spec.id), encode(assignment), category="assignment"),
                Put(self.layout.allocation(node_id), encode(allocation), category="allocation"),
            ],
        )
        return Placed(change, node_id, decision.reason, spec, status,
                      node_mod=node_item.mod_revision)

    def resize(self, workload_id: str, node_id: str,
               new_req: tuple[int, int]) -> tuple[Compare, Put] | Outcome:
        alloc_item = self.cluster.allocations.get(node_id)
        node_item = self.cluster.nodes.get(node_id)
        allocation = alloc_item.value.clone() if alloc_item else Allocation(node_id=node_id)
        allocation.add(workload_id, *new_req)
        if node_item is not None:
            node = node_item.value
            if allocation.cpu_millicores > round(node.total_cpu * 1000) or (
                allocation.memory_mb > node.total_memory
            ):
                return Outcome(False, "INSUFFICIENT_RESOURCES",
                               f"{node_id}: the new resources do not fit on the assigned node")
        return (
            Compare.mod(self.layout.allocation(node_id),
                        alloc_item.mod_revision if alloc_item else 0),
            Put(self.layout.allocation(node_id), encode(allocation), category="allocation"),
        )

