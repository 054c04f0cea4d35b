"""ApplyWorkload for a workload that exists: a new spec or a desired-state change, committed
with the workload's events in one CAS transaction on its spec and status.

Apart from the creation because an update keeps what the stored workload holds (its disks,
creation time, extra fields, node) and may re-book its allocation on the node it is on, or
place it again when it has none; the agent apply goes out from the commit itself.
"""

from __future__ import annotations

from dataclasses import replace

from eventsource.clock import Clock
from eventsource.commit import Change, Committer
from eventsource.errors import Conflict, OutcomeUnknown
from eventsource.etcd import Compare, Put
from eventsource.events import Event, rfc3339
from eventsource.keys import KeyLayout
from eventsource.records import WorkloadSpec, WorkloadStatus, copy_record
from handlers.specs.stored import compute_revision, request_of
from handlers.specs.validation import ParsedApply
from handlers.storage.attachments import FIELD as DISK_FIELD
from handlers.storage.attachments import disk_ids_in_spec, disk_ids_of
from handlers.workloads.assignment import Assigner
from handlers.workloads.delete import DeleteCommand
from handlers.workloads.desired_state import set_desired_state
from handlers.workloads.dispatch import Dispatcher
from handlers.workloads.outcome import Outcome, catch_up
from handlers.workloads.pending import mark_pending, pending_answer
from handlers.workloads.readback import ReadBack
from handlers.workloads.records import TERMINAL_KEYS, mark_apply_requested, stored_records
from handlers.workloads.relocation import Relocator
from handlers.workloads.retry import REAPPLY_KEYS
from handlers.workloads.volumes import add_volumes, disk_volumes, inline_volume_clash
from projections.cluster import ClusterProjection


class UpdateCommand:
    """ApplyWorkload's update of an existing workload."""

    def __init__(self, *, cluster: ClusterProjection, committer: Committer, assigner: Assigner,
                 relocator: Relocator, delete: DeleteCommand, dispatcher: Dispatcher,
                 readback: ReadBack, clock: Clock, layout: KeyLayout) -> None:
        self.cluster = cluster
        self.committer = committer
        self.assigner = assigner
        self.relocator = relocator
        self.delete = delete
        self.dispatcher = dispatcher
        self.readback = readback
        self.clock = clock
        self.layout = layout

    async def run(self, parsed: ParsedApply, *, store_pending: bool = False) -> Outcome:
        """Update the workload; with ``store_pending``, an unassigned one that still fits
        nowhere keeps (or becomes) Pending with the update stored."""
        spec_item = self.cluster.specs.get(parsed.workload_id)
        status_item = self.cluster.statuses.get(parsed.workload_id)
        if spec_item is None or status_item is None:
            raise Conflict("workload changed while updating")
        old_spec = spec_item.value
        spec = copy_record(old_spec)
        status = copy_record(status_item.value)
        now = rfc3339(self.clock.now())
        events: list[Event] = []
        pending: Outcome | None = None
        compares = [Compare.mod(self.layout.spec(spec.id), spec_item.mod_revision),
                    Compare.mod(self.layout.status(spec.id), status_item.mod_revision)]
        puts: list[Put] = []
        if parsed.spec is None:
            if parsed.desired_state == old_spec.desired_state:
                return Outcome(True, message="desired state unchanged",
                               node_id=status.node_id)
            if parsed.desired_state == "Deleted":
                return await self.delete.run(spec.id)
            events.append(set_desired_state(spec, status, parsed.desired_state,
                                            self.clock.now()))
        else:
            new = await self._take_new_spec(parsed, old_spec, status, now)
            if isinstance(new, Outcome):
                return new
            spec = new
            events.append(Event(type="WorkloadScheduled", workload_id=spec.id,
                                node_id=status.node_id, reason="Workload updated",
                                details={"revision_id": spec.revision_id},
                                timestamp=self.clock.now()))
            node_id = status.node_id
            new_req = request_of(spec)
            if node_id and new_req != request_of(old_spec):
                resized = self.assigner.resize(spec.id, node_id, new_req)
                if isinstance(resized, Outcome):
                    return resized
                compares.append(resized[0])
                puts.append(resized[1])
        if not status.node_id and spec.desired_state != "Deleted":
            # its disks decide where it may go, and follow it (as in the reconcile placement)
            disks, pin = await self.relocator.disks_for_placement(spec, spec.id)
            if pin is None:
                return Outcome(False, "INSUFFICIENT_RESOURCES",
                               "its local disks are on different nodes")
            placed = self.assigner.place(spec, status, only=pin)
            if isinstance(placed, Outcome):
                if not (placed.unplaced and store_pending):
                    return placed
                unchanged = (spec.revision_id == old_spec.revision_id
                             and spec.desired_state == old_spec.desired_state)
                status = copy_record(status_item.value) if unchanged else status
                news = mark_pending(status, spec.id, placed.message, self.clock.now())
                if unchanged and news is None:
                    return pending_answer(placed.message)  # nothing new to store
                if news is not None:
                    events.append(news)
                pending = pending_answer(placed.message)
            else:
                compares += placed.change.compares
                puts += placed.change.puts
                disk_compares, disk_puts = self.relocator.move_disks(
                    disks, spec.id, from_node=str(status.metadata.get("previous_node") or ""),
                    to_node=placed.node_id)
                compares += disk_compares
                puts += disk_puts
                status = placed.status
        if status.node_id and spec.desired_state != "Deleted":
            mark_apply_requested(status, spec, now)
        stored = stored_records(spec, status)
        if isinstance(stored, Outcome):
            return stored
        puts += [Put(self.layout.spec(spec.id), stored[0], category="spec"),
                 Put(self.layout.status(spec.id), stored[1], category="status")]

        def dispatch(revision: int) -> None:
            # run by the commit itself: a caller cancelled at its deadline while the
            # transaction was in flight would otherwise take the apply with it
            if status.node_id:
                self.dispatcher.apply(spec, status.metadata, status.node_id,
                                      spec.desired_state, after=revision)

        try:
            revision = (await self.committer.commit(
                Change(kind="workload", compares=compares, puts=puts, events=events),
                on_commit=dispatch)).revision
        except Conflict as exc:
            await catch_up(self.cluster, exc)
            raise
        except OutcomeUnknown:
            # etcd may have applied it (its answer was lost): read back before answering
            spec_key, spec_bytes, before = (self.layout.spec(spec.id), stored[0],
                                            spec_item.mod_revision)
            revision = await self.readback.resolve(
                lambda: self.readback.holds(spec_key, spec_bytes, after=before),
                dispatch, what=f"update of {spec.id}")
            if not revision:
                raise
        if pending is not None:
            return replace(pending, revision=revision)
        return Outcome(True, node_id=status.node_id, message="updated", revision=revision)

    async def _take_new_spec(self, parsed: ParsedApply, old_spec: WorkloadSpec,
                             status: WorkloadStatus, now: str) -> WorkloadSpec | Outcome:
        """The new spec, with what the stored one keeps (its disks, creation time, extra
        fields) and the status reset for a new start; or the refusal, or the answer that
        nothing changed."""
        assert parsed.spec is not None
        new = copy_record(parsed.spec)
        clash = await inline_volume_clash(self.committer.etcd, self.layout, new)
        if clash is not None:
            return clash
        kept_disks = disk_volumes(old_spec)
        # a workload stored before disks were attached here (or by the Go version) names
        # them in its metadata only: unchanged if it names the same ones
        attached_ids = set(disk_ids_in_spec(kept_disks)) or set(
            disk_ids_of(status.metadata, old_spec.vm))
        if set(disk_ids_of(parsed.metadata, new.vm)) != attached_ids:
            return Outcome(False, "INVALID_SPEC",
                           f"{DISK_FIELD}: the disks of an existing workload cannot change "
                           "(apply a new workload)")
        add_volumes(new, kept_disks)
        new.created_at = old_spec.created_at or new.created_at
        new.extra = dict(old_spec.extra or {})
        if not new.revision_id:
            new.revision_id = compute_revision(new)
        if new.revision_id == old_spec.revision_id and new.desired_state == (
            old_spec.desired_state
        ) and status.node_id:
            return Outcome(True, message="no change (same revision)", node_id=status.node_id)
        status.metadata.update(parsed.metadata)
        status.metadata["last_action"] = "Updated"
        status.status = "Updating"
        status.status_info.actual_state = "Pending"
        status.status_info.last_updated = now
        # a new spec is a new start: the old one's failures (an invalid image, a spent
        # retry budget) must not halt it
        for key in REAPPLY_KEYS + TERMINAL_KEYS:
            status.metadata.pop(key, None)
        status.retry.attempts = 0
        status.retry.next_retry_at = ""
        return new
