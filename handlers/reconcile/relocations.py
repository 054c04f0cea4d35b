"""The reconcile actions that move a workload between nodes: place an unassigned one, fail
one over from an unavailable node, and unassign one from a node that lacks its runtime.

Why apart: each of these is a commit that changes where a workload is (its status, its
assignment, the allocations, its disks), with the placer's in-flight hold taken and given back
around it; agent calls (``handlers.reconcile.agentcalls``) and status writes
(``handlers.reconcile.statuswrites``) change nothing of that.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from eventsource.commit import Change, retry_on_conflict
from eventsource.errors import Conflict, StoreError
from eventsource.etcd import Compare, Delete, Put
from eventsource.events import Event, rfc3339
from eventsource.records import copy_record, encode
from handlers.placement.decision import canonical_type
from handlers.reconcile.planner.inputs import node_of
from handlers.reconcile.planner.workload import Action
from handlers.reconcile.shell import LoopShell
from handlers.reconcile.statuswrites import StatusWrites
from handlers.specs.stored import normalize_desired_state, request_of
from handlers.workloads.outcome import Outcome, catch_up
from handlers.workloads.records import mark_apply_requested, release_allocation
from handlers.workloads.retry import REAPPLY_KEYS

log = logging.getLogger("persys.loops")

#: the types a node without a list is taken to support (legacy nodes; docs/compatibility.md,
#: "Runtime unsupported")
LEGACY_WORKLOAD_TYPES = ("container", "compose")
#: an agent message kept on a status
MESSAGE_CHARS = 1024


@dataclass(frozen=True, slots=True)
class Placement:
    """What a placement attempt did: ``placed``, or why no node fits (``refused``; "" when
    the workload was not one to place: gone, deleted, placed meanwhile, disks split)."""

    placed: bool
    refused: str = ""


PLACED = Placement(True)
NOT_ELIGIBLE = Placement(False)


class Relocations:
    """Placement, failover and the runtime-unsupported unassignment of the reconcile cycle."""

    def __init__(self, shell: LoopShell, status_writes: StatusWrites) -> None:
        self.cluster = shell.cluster
        self.committer = shell.committer
        self.dispatcher = shell.dispatcher
        self.layout = shell.layout
        self.relocator = shell.relocator
        self.workloads = shell.workloads
        self.status_writes = status_writes

    async def place(self, workload_id: str, now: datetime) -> Placement:
        """Place an unassigned workload (its disks follow it) and dispatch its apply."""
        c = self.workloads

        async def attempt(n: int) -> Placement:
            spec_item = self.cluster.specs.get(workload_id)
            status_item = self.cluster.statuses.get(workload_id)
            if spec_item is None or status_item is None or node_of(status_item.value):
                return NOT_ELIGIBLE
            spec = spec_item.value
            if normalize_desired_state(spec.desired_state) == "Deleted":
                return NOT_ELIGIBLE
            status = copy_record(status_item.value)
            # its local disks pin it to their node, and its disks follow it; read before
            # deciding: no await between the decision and its reservation
            disks, pin = await self.relocator.disks_for_placement(spec, workload_id)
            if pin is None:
                log.debug("reconcile: workload_id=%s has local disks on different nodes",
                          workload_id)
                return NOT_ELIGIBLE
            placed = c.assigner.place(spec, status, only=pin)
            if isinstance(placed, Outcome):
                log.debug("reconcile: no node fits workload_id=%s: %s", workload_id,
                          placed.message)
                return Placement(False, placed.message if placed.unplaced else "")
            mark_apply_requested(placed.status, spec, rfc3339(now))
            change = placed.change
            change.kind = "reconcile"
            disk_compares, disk_puts = self.relocator.move_disks(
                disks, workload_id, from_node=str(status.metadata.get("previous_node") or ""),
                to_node=placed.node_id)
            change.compares.extend(disk_compares)
            change.puts.extend(disk_puts)
            change.compares.append(Compare.mod(self.layout.status(workload_id),
                                               status_item.mod_revision))
            change.puts.append(Put(self.layout.status(workload_id), encode(placed.status),
                                   category="status"))
            change.events.append(Event(
                type="WorkloadScheduled", workload_id=workload_id, node_id=placed.node_id,
                reason=placed.reason, details={"revision_id": spec.revision_id}, timestamp=now))
            cpu_m, mem_mb = request_of(spec)
            c.placer.reserve(workload_id, placed.node_id, cpu_m, mem_mb)
            try:
                committed = await self.committer.commit(change, fenced=True)
            except Conflict as exc:
                c.placer.release(workload_id)
                await catch_up(self.cluster, exc)
                raise
            except BaseException:
                # etcd unavailable, a timeout, the cycle cancelled at a lost leadership: as
                # ApplyWorkload's and the relocator's placements, never leave the hold behind
                # (a commit that did land shows in the allocation, which counts it)
                c.placer.release(workload_id)
                raise
            # a failed apply is recorded on the status record: let this replica's projection
            # show the placement first, or that record would find nothing to update
            await self.cluster.wait_for(committed.revision, which=("statuses",))
            self.dispatcher.apply(spec, placed.status.metadata, placed.node_id,
                                  spec.desired_state, after=committed.revision,
                                  leader_only=True)
            return PLACED

        return await retry_on_conflict(attempt)

    async def failover(self, action: Action, now: datetime) -> bool:
        """Move a workload off its unavailable node (``Rescheduled``)."""
        outcome = await self.relocator.relocate(action.workload_id, from_node=action.node_id,
                                                event_type="Rescheduled", fenced=True)
        if outcome == "no-target":
            # Go's AwaitFailover (docs/compatibility.md, "Node lifecycle"): wait under the retry
            # budget, so attempts back off and end Failed
            await self.status_writes.count_failure(
                action.workload_id, action.node_id,
                reason=f"no failover target: node {action.node_id} unavailable", now=now,
                once=False)
            return False
        return True

    async def runtime_unsupported(self, workload_id: str, node_id: str, message: str,
                                  now: datetime) -> bool:
        """The node cannot run this type after all (docs/compatibility.md, "Runtime unsupported").
        Its type is taken off the node (so placement stops choosing it) and the workload is
        unassigned, Pending, its allocation released, in one fenced transaction; the next cycle
        places it elsewhere. Returns False: nothing runs yet."""

        async def attempt(n: int) -> bool:
            spec_item = self.cluster.specs.get(workload_id)
            status_item = self.cluster.statuses.get(workload_id)
            node_item = self.cluster.nodes.get(node_id)
            if spec_item is None or status_item is None or node_item is None:
                return False
            if node_of(status_item.value) != node_id:
                return False
            wtype = canonical_type(spec_item.value.type)
            node = copy_record(node_item.value)
            offered = node.supported_workload_types or list(LEGACY_WORKLOAD_TYPES)
            node.supported_workload_types = [t for t in offered if canonical_type(t) != wtype]
            status = copy_record(status_item.value)
            status.node_id = ""
            status.assigned_node = ""
            status.status = "Pending"
            status.status_info.actual_state = "Pending"
            status.status_info.last_updated = rfc3339(now)
            for key in REAPPLY_KEYS:
                status.metadata.pop(key, None)
            status.metadata["previous_node"] = node_id
            status.metadata["last_action"] = "RuntimeUnsupportedReschedulePending"
            status.metadata["scheduler_last_error"] = message[:MESSAGE_CHARS]
            change = Change(
                kind="reconcile",
                compares=[Compare.mod(self.layout.node(node_id), node_item.mod_revision),
                          Compare.mod(self.layout.status(workload_id), status_item.mod_revision)],
                puts=[Put(self.layout.node(node_id), encode(node), category="node"),
                      Put(self.layout.status(workload_id), encode(status), category="status")],
                deletes=[Delete(self.layout.assignment(workload_id), category="assignment")],
                events=[Event(type="Rescheduled", workload_id=workload_id, node_id=node_id,
                              reason=f"runtime {wtype} not available on {node_id}",
                              details={"previous_node": node_id}, timestamp=now)])
            release_allocation(change, self.cluster, self.layout, node_id, workload_id)
            try:
                await self.committer.commit(change, fenced=True)
            except Conflict as exc:
                if exc.revision:
                    await self.cluster.wait_for(exc.revision, timeout=2.0)
                raise
            log.warning("runtime %s not available on node_id=%s: workload_id=%s unassigned to "
                        "be placed elsewhere", wtype, node_id, workload_id)
            return False

        try:
            return await retry_on_conflict(attempt)
        except (Conflict, StoreError) as exc:
            log.info("runtime-unsupported reschedule not recorded workload_id=%s: %s",
                     workload_id, exc)
            return False
