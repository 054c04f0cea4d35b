"""ApplyWorkload for a workload that does not exist yet: place it, and commit its spec,
status, assignment, allocation and disk attachments through the placement batcher.

Apart because a new workload is the hot path of ApplyWorkload: it answers once the placement
is committed, and the agent apply goes out from the commit itself (its outcome shows in the
workload's status and events), so a caller cancelled at its deadline does not take it along.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from eventsource.clock import Clock
from eventsource.commit import Change, Committer
from eventsource.errors import Conflict, OutcomeUnknown
from eventsource.etcd import Compare, Put
from eventsource.events import Event, rfc3339
from eventsource.keys import KeyLayout
from eventsource.records import RetryState, StatusInfo, WorkloadSpec, WorkloadStatus, copy_record
from handlers.placement.batcher import Intent, PlacementBatcher
from handlers.placement.placer import Placer
from handlers.specs.fields import InvalidSpec
from handlers.specs.stored import compute_revision, request_of
from handlers.specs.validation import ParsedApply
from handlers.storage.attachments import FIELD as DISK_FIELD
from handlers.storage.attachments import disk_ids_of, load_disks, plan_attach
from handlers.workloads.assignment import Assigner
from handlers.workloads.dispatch import Dispatcher
from handlers.workloads.outcome import Outcome, catch_up
from handlers.workloads.pending import PendingPolicy, mark_pending, pending_answer
from handlers.workloads.readback import ReadBack
from handlers.workloads.records import mark_apply_requested, stored_records
from handlers.workloads.volumes import add_volumes, inline_volume_clash
from projections.cluster import ClusterProjection

log = logging.getLogger("persys.workloads")


class CreateCommand:
    """ApplyWorkload's creation of a new workload."""

    def __init__(self, *, cluster: ClusterProjection, committer: Committer, placer: Placer,
                 assigner: Assigner, batcher: PlacementBatcher, dispatcher: Dispatcher,
                 readback: ReadBack, clock: Clock, layout: KeyLayout,
                 pending: PendingPolicy) -> None:
        self.pending = pending
        self.cluster = cluster
        self.committer = committer
        self.placer = placer
        self.assigner = assigner
        self.batcher = batcher
        self.dispatcher = dispatcher
        self.readback = readback
        self.clock = clock
        self.layout = layout

    async def run(self, parsed: ParsedApply, *, store_pending: bool = False) -> Outcome:
        """Place and store the new workload; with ``store_pending``, one that fits nowhere is
        stored Pending (``handlers.workloads.pending``) unless the policy refuses it."""
        assert parsed.spec is not None
        spec = copy_record(parsed.spec)
        clash = await inline_volume_clash(self.committer.etcd, self.layout, spec)
        if clash is not None:
            return clash
        disk_ids = disk_ids_of(parsed.metadata, spec.vm)
        disks = None
        if disk_ids:
            if spec.type == "compose":
                return Outcome(False, "INVALID_SPEC", f"{DISK_FIELD}: compose workloads cannot "
                               "use disks (the agent takes only the compose YAML)")
            try:
                disks = plan_attach(spec.id, disk_ids, await load_disks(
                    self.committer.etcd, self.layout, disk_ids))
            except InvalidSpec as exc:
                return Outcome(False, "INVALID_SPEC", str(exc))
            add_volumes(spec, disks.volumes())
        if not spec.revision_id:
            spec.revision_id = compute_revision(spec)
        now = rfc3339(self.clock.now())
        status = WorkloadStatus(
            id=spec.id, status="Pending", retry=RetryState(attempts=0, max_attempts=5),
            status_info=StatusInfo(actual_state="Pending", last_updated=now),
            metadata={**parsed.metadata, "created_at": now, "last_action": "Created"},
        )
        placed = self.assigner.place(spec, status, only=disks.node_id if disks else "")
        if isinstance(placed, Outcome):
            if placed.unplaced and store_pending:
                return await self._store_pending(spec, status, placed, with_disks=bool(disks))
            return placed
        mark_apply_requested(placed.status, spec, now)
        stored = stored_records(spec, placed.status)
        if isinstance(stored, Outcome):
            return stored
        spec_bytes, status_bytes = stored
        cpu_m, mem_mb = request_of(spec)
        disk_compares, disk_puts = (disks.writes(self.layout, spec.id, placed.node_id, now)
                                    if disks else ([], []))
        intent = Intent(
            workload_id=spec.id, node_id=placed.node_id, cpu_m=cpu_m, mem_mb=mem_mb,
            node_mod=placed.node_mod,
            compares=[Compare.absent(self.layout.spec(spec.id)),
                      Compare.absent(self.layout.status(spec.id)), *disk_compares],
            puts=[Put(self.layout.spec(spec.id), spec_bytes, category="spec"),
                  Put(self.layout.status(spec.id), status_bytes, category="status"),
                  *(p for p in placed.change.puts if p.category == "assignment"), *disk_puts],
            alone=bool(disk_compares),
            # dispatched from the commit, not from this task: a caller cancelled at its
            # deadline while the batch was in flight would take the apply with it
            on_commit=lambda revision: self.dispatcher.apply(
                spec, placed.status.metadata, placed.node_id, spec.desired_state,
                after=revision),
            events=[Event(type="WorkloadScheduled", workload_id=spec.id,
                          node_id=placed.node_id, reason="Workload created",
                          details={"revision_id": spec.revision_id},
                          timestamp=self.clock.now())],
        )
        self.placer.reserve(spec.id, placed.node_id, cpu_m, mem_mb)
        try:
            revision = await self.batcher.submit(intent)
        except Conflict as exc:
            self.placer.release(spec.id)
            await catch_up(self.cluster, exc)
            raise
        except OutcomeUnknown:
            self.placer.release(spec.id)
            # etcd may have applied it (its answer was lost): read back before answering
            status_key = self.layout.status(spec.id)
            assert intent.on_commit is not None
            revision = await self.readback.resolve(
                lambda: self.readback.created(status_key, status_bytes), intent.on_commit,
                what=f"placement of {spec.id}")
            if not revision:
                raise
        except BaseException:
            self.placer.release(spec.id)
            raise
        log.debug("workload placed workload_id=%s node_id=%s revision=%d reason=%r",
                  spec.id, placed.node_id, revision, placed.reason)
        return Outcome(True, node_id=placed.node_id, message=placed.reason, revision=revision)

    async def _store_pending(self, spec: WorkloadSpec, status: WorkloadStatus,
                             refused: Outcome, *, with_disks: bool) -> Outcome:
        """Store the spec and a Pending status (no node, no allocation) in one create-only
        transaction with its ``WorkloadPending`` event."""
        why_not = ("its disks are attached at placement (apply it when its node has room)"
                   if with_disks else self.pending.refusal(len(self.cluster.workloads.unassigned)))
        if why_not:
            return Outcome(False, refused.failure, f"{refused.message} (not stored: {why_not})",
                           unplaced=True)
        event = mark_pending(status, spec.id, refused.message, self.clock.now())
        stored = stored_records(spec, status)
        if isinstance(stored, Outcome):
            return stored
        spec_bytes, status_bytes = stored
        change = Change(
            kind="workload",
            compares=[Compare.absent(self.layout.spec(spec.id)),
                      Compare.absent(self.layout.status(spec.id))],
            puts=[Put(self.layout.spec(spec.id), spec_bytes, category="spec"),
                  Put(self.layout.status(spec.id), status_bytes, category="status")],
            events=[event] if event is not None else [])
        try:
            revision = (await self.committer.commit(change)).revision
        except Conflict as exc:
            await catch_up(self.cluster, exc)
            raise
        except OutcomeUnknown:
            status_key = self.layout.status(spec.id)
            revision = await self.readback.resolve(
                lambda: self.readback.created(status_key, status_bytes),
                lambda revision: None, what=f"pending store of {spec.id}")
            if not revision:
                raise
        log.info("workload stored pending workload_id=%s reason=%r", spec.id, refused.message)
        return replace(pending_answer(refused.message), revision=revision)
