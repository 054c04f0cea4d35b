"""Moving workloads off a node (drain, failover), each move one CAS transaction, and the disk
records that follow a workload to its new node.

Apart because the node commands (drain), the reconcile loop (failover, placing an unassigned
workload) and ApplyWorkload (placing an unassigned workload again) all move workloads and
their disks, each under its own fencing.
"""

from __future__ import annotations

import contextlib

from eventsource.clock import Clock
from eventsource.commit import Change, Committer, retry_on_conflict
from eventsource.errors import Conflict, StoreError
from eventsource.etcd import Compare, Put
from eventsource.events import Event, rfc3339
from eventsource.keys import KeyLayout
from eventsource.records import WorkloadSpec, copy_record, encode
from handlers.placement.placer import Placer
from handlers.specs.stored import request_of
from handlers.storage.attachments import (
    Found,
    disk_ids_in_spec,
    load_disks,
    moved,
    rewrite,
    used_by,
)
from handlers.workloads.assignment import Assigner
from handlers.workloads.dispatch import Dispatcher
from handlers.workloads.outcome import Outcome, catch_up
from handlers.workloads.persistence import is_node_local, persistence_class
from handlers.workloads.records import mark_apply_requested, release_allocation
from handlers.workloads.retry import REAPPLY_KEYS
from handlers.workloads.volumes import disk_volumes
from handlers.writes.cas import StateWriter
from projections.cluster import ClusterProjection


class Relocator:
    """Moves workloads off a node (drain, failover), each move one CAS transaction."""

    def __init__(self, *, cluster: ClusterProjection, committer: Committer, writer: StateWriter,
                 placer: Placer, assigner: Assigner, dispatcher: Dispatcher, clock: Clock,
                 layout: KeyLayout) -> None:
        self.cluster = cluster
        self.committer = committer
        self.writer = writer
        self.placer = placer
        self.assigner = assigner
        self.dispatcher = dispatcher
        self.clock = clock
        self.layout = layout

    async def relocate(self, workload_id: str, *, from_node: str, event_type: str,
                       fenced: bool = False, report_skip: bool = True) -> str:
        """Move one workload; returns 'moved', 'skipped', 'no-target' or 'gone'."""

        async def attempt(n: int) -> str:
            spec_item = self.cluster.specs.get(workload_id)
            status_item = self.cluster.statuses.get(workload_id)
            if spec_item is None or status_item is None:
                return "gone"
            status = copy_record(status_item.value)
            if status.node_id != from_node or spec_item.value.desired_state == "Deleted":
                return "gone"
            spec = spec_item.value
            if is_node_local(spec, status.metadata):
                if not report_skip:
                    return "skipped"
                pclass = persistence_class(spec, status.metadata)
                await self.committer.commit(Change(kind="relocate", events=[Event(
                    type="RescheduleSkipped", workload_id=workload_id, node_id=from_node,
                    reason="node-local workload is not moved",
                    details={"persistence_class": pclass}, timestamp=self.clock.now())]),
                    fenced=fenced)
                return "skipped"
            # read before deciding: no await between the decision and its reservation
            disks = await self._disks_of(spec)
            placed = self.assigner.place(spec, status, exclude=frozenset({from_node}))
            if isinstance(placed, Outcome):
                return "no-target"
            new_status = placed.status
            new_status.metadata["previous_node"] = from_node
            new_status.metadata["last_action"] = (
                "Relocated" if event_type == "Relocated" else "Rescheduled")
            new_status.status = "Scheduled"
            new_status.retry.attempts = 0
            for key in REAPPLY_KEYS:
                new_status.metadata.pop(key, None)
            mark_apply_requested(new_status, spec, rfc3339(self.clock.now()))
            change = placed.change
            change.compares.append(Compare.mod(self.layout.status(workload_id),
                                               status_item.mod_revision))
            change.puts.append(Put(self.layout.status(workload_id), encode(new_status),
                                   category="status"))
            release_allocation(change, self.cluster, self.layout, from_node, workload_id)
            disk_compares, disk_puts = self.move_disks(
                disks, workload_id, from_node=from_node, to_node=placed.node_id)
            change.compares.extend(disk_compares)
            change.puts.extend(disk_puts)
            change.events.append(Event(
                type=event_type, workload_id=workload_id, node_id=placed.node_id,
                reason=placed.reason, details={"previous_node": from_node},
                timestamp=self.clock.now()))
            cpu_m, mem_mb = request_of(spec)
            self.placer.reserve(workload_id, placed.node_id, cpu_m, mem_mb)
            try:
                committed = await self.committer.commit(change, fenced=fenced)
            except Conflict as exc:
                self.placer.release(workload_id)
                await catch_up(self.cluster, exc)
                raise
            except BaseException:
                self.placer.release(workload_id)
                raise
            # a fenced move is a leader loop's: its agent calls go out only while it leads
            self.dispatcher.apply(spec, new_status.metadata, placed.node_id, spec.desired_state,
                                  after=committed.revision, leader_only=fenced)
            self.dispatcher.forget_on(workload_id, from_node, leader_only=fenced)
            # the next move off this node reads the allocation this one wrote
            with contextlib.suppress(StoreError):
                await self.cluster.wait_for(committed.revision, timeout=2.0,
                                            which=("allocations", "statuses"))
            return "moved"

        # every move off one node rewrites that node's allocation: moves of one replica from
        # one node go one at a time instead of failing each other's compares (a failover of 30
        # workloads once lost two thirds of its moves to conflicts, left to later cycles)
        async with self.writer.locks.hold(self.layout.allocation(from_node)):
            return await retry_on_conflict(attempt)

    async def _disks_of(self, spec: WorkloadSpec) -> dict[str, Found]:
        """The records of the standalone disks the workload uses (read from etcd)."""
        disk_ids = disk_ids_in_spec(disk_volumes(spec))
        if not disk_ids:
            return {}
        return await load_disks(self.committer.etcd, self.layout, disk_ids)

    async def disks_for_placement(self, spec: WorkloadSpec, workload_id: str
                                  ) -> tuple[dict[str, Found], str | None]:
        """For placing an unassigned workload again: its disks as read, and the node its
        local disks pin it to ("" when none; None when they are on different nodes)."""
        disks = await self._disks_of(spec)
        pins = {str(record["nodeId"]) for _, record, _ in used_by(disks, workload_id)
                if record.get("driver") == "local" and record.get("nodeId")}
        if len(pins) > 1:
            return disks, None
        return disks, next(iter(pins), "")

    def move_disks(self, disks: dict[str, Found], workload_id: str, *, from_node: str,
                   to_node: str) -> tuple[list[Compare], list[Put]]:
        """The writes that move the workload's disks to ``to_node`` (compared, so a disk
        changed since it was read makes the move retry)."""
        compares: list[Compare] = []
        puts: list[Put] = []
        now = rfc3339(self.clock.now())
        for disk_id, record, mod in used_by(disks, workload_id):
            node_of = {str(ref): item.value.node_id for ref in record.get("workloadRefs") or []
                       if (item := self.cluster.statuses.get(str(ref))) is not None}
            compare, put = rewrite(self.layout, disk_id, mod, moved(
                record, workload_id, from_node=from_node, to_node=to_node, node_of=node_of,
                now=now))
            compares.append(compare)
            puts.append(put)
        return compares, puts
