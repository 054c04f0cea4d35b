"""Workload commands: apply, delete, retry, desired-state changes and automation suggestions.

Each command validates, decides on this replica's projections, and commits the state change with
its events in one CAS transaction (``eventsource.commit``). ApplyWorkload answers once the
placement is committed; the agent apply is dispatched afterwards and its outcome shows in the
workload's status and events (ARCHITECTURE 5).

A placement commits the spec, the status, the assignment and the node's allocation together,
comparing the allocation's and the node's revisions: two replicas, or many concurrent handlers,
cannot oversubscribe a node even when their projections are stale. A lost compare re-decides on
state that includes the winning write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from eventsource.clock import Clock
from eventsource.commit import Change, Committer, retry_on_conflict
from eventsource.errors import Conflict, OutcomeUnknown, StoreError
from eventsource.etcd import Compare, Put
from eventsource.events import Event, rfc3339
from eventsource.keys import KeyLayout
from eventsource.records import (
    Allocation,
    Assignment,
    RetryState,
    StatusInfo,
    WorkloadSpec,
    WorkloadStatus,
    copy_record,
    encode,
)
from handlers.cluster.modes import ModeState
from handlers.placement.batcher import Intent, PlacementBatcher
from handlers.placement.decision import PlacementRequest, canonical_driver
from handlers.placement.placer import Placer
from handlers.specs.validation import InvalidSpec, ParsedApply, compute_revision, request_of
from handlers.storage.attachments import FIELD as DISK_FIELD
from handlers.storage.attachments import (
    Found,
    disk_ids_in_spec,
    disk_ids_of,
    load_disks,
    moved,
    plan_attach,
    rewrite,
    used_by,
)
from handlers.workloads.dispatch import Dispatcher
from handlers.workloads.metadata import METADATA_MAX_KEYS
from handlers.workloads.persistence import is_node_local, managed_volumes_of, persistence_class
from handlers.writes.cas import NotFound, StateWriter
from projections.cluster import ClusterProjection

log = logging.getLogger("persys.workloads")

#: how often, and how many times, a write whose outcome is unknown is read back while etcd
#: does not answer (then the reconcile loop's re-apply guard takes over)
RESOLVE_INTERVAL_S = 1.0
RESOLVE_ATTEMPTS = 60
#: a write not found once etcd answers is read once more after this: longer than etcd's own
#: request timeout (5 s + 2 election timeouts by default), within which a request still
#: inside etcd is applied or dropped
RESOLVE_SETTLE_S = 10.0

def mark_apply_requested(status: WorkloadStatus, spec: WorkloadSpec, now: str) -> None:
    """Record, in the transaction that commits a placement or change, the apply that follows.

    The re-apply guard of the reconcile loop measures from this time, and the dispatcher's
    successful apply then costs no extra write.
    """
    status.metadata["lastApplyRequestAt"] = now
    status.metadata["lastApplyRevision"] = spec.revision_id


REAPPLY_KEYS = ("lastApplyRequestAt", "lastApplyRevision", "lastLaunchTime", "reapplyAttempts",
                "reapplyNextAt")
#: what marks a workload failed for good (``reconcile.halted`` reads the first and
#: ``failure_reason``, the agent's answer merged into the status): a retry or a new spec clears
#: them, or the workload would be marked Failed again while it runs
TERMINAL_KEYS = ("retry_terminal", "retry_terminal_reason", "terminal_failure_reason",
                 "failure_reason", "failureObservedAt", "failureGraceUntil")


@dataclass(frozen=True, slots=True)
class Outcome:
    """An in-band answer: ``failure`` is a FailureReason name or ''."""

    ok: bool
    failure: str = ""
    message: str = ""
    node_id: str = ""


@dataclass(slots=True)
class _Placed:
    change: Change
    node_id: str
    reason: str
    spec: WorkloadSpec
    status: WorkloadStatus
    extra_events: list[Event] = field(default_factory=list)
    #: the chosen node's record revision the decision saw
    node_mod: int = 0


#: what one workload's spec and status may take once stored (JSON, which escapes control
#: characters sixfold): etcd refuses a request over 1.5 MiB, and the transaction carries the
#: workload's events and its node's allocation too
RECORD_MAX_BYTES = 1024 * 1024


def stored_records(spec: WorkloadSpec, status: WorkloadStatus) -> tuple[bytes, bytes] | Outcome:
    """The spec and status as stored, or INVALID_SPEC when they would not fit etcd."""
    if len(status.metadata) > METADATA_MAX_KEYS:
        return Outcome(False, "INVALID_SPEC",
                       f"spec.metadata: the workload would carry {len(status.metadata)} "
                       f"metadata keys (at most {METADATA_MAX_KEYS})")
    spec_bytes, status_bytes = encode(spec), encode(status)
    size = len(spec_bytes) + len(status_bytes)
    if size > RECORD_MAX_BYTES:
        return Outcome(False, "INVALID_SPEC",
                       f"spec: {size} bytes once stored (its JSON, with the status), at most "
                       f"{RECORD_MAX_BYTES}: shorten the environment, compose YAML or metadata")
    return spec_bytes, status_bytes


def required_drivers(spec: WorkloadSpec) -> frozenset[str]:
    volumes = list(spec.managed_volumes)
    if spec.vm:
        volumes.extend(spec.vm.get("managedVolumes", []) or [])
    return frozenset(canonical_driver(str(v.get("driver", ""))) for v in volumes)


class WorkloadCommands:
    """The workload aggregate's command handlers."""

    def __init__(
        self,
        *,
        cluster: ClusterProjection,
        committer: Committer,
        writer: StateWriter,
        placer: Placer,
        dispatcher: Dispatcher,
        batcher: PlacementBatcher,
        mode: ModeState,
        clock: Clock,
        layout: KeyLayout,
    ) -> None:
        self.batcher = batcher
        self.cluster = cluster
        self.committer = committer
        self.writer = writer
        self.placer = placer
        self.dispatcher = dispatcher
        self.mode = mode
        self.clock = clock
        self.layout = layout

    def _now(self) -> str:
        return rfc3339(self.clock.now())

    def _frozen(self) -> Outcome | None:
        if self.mode.writable:
            return None
        return Outcome(False, "RUNTIME_ERROR",
                       f"control plane frozen: scheduler {self.mode.mode} ({self.mode.reason})")

    # -- ApplyWorkload ----------------------------------------------------------------------
    async def apply(self, parsed: ParsedApply) -> Outcome:
        frozen = self._frozen()
        if frozen is not None:
            return frozen

        async def attempt(n: int) -> Outcome:
            existing = self.cluster.specs.get(parsed.workload_id)
            if existing is None:
                if parsed.spec is None:
                    return Outcome(False, "INVALID_SPEC",
                                   "spec: required for a workload that does not exist")
                return await self._create(parsed)
            return await self._update(parsed)

        try:
            outcome = await retry_on_conflict(attempt, attempts=8)
            if outcome.failure == "INSUFFICIENT_RESOURCES" and await self._caught_up():
                # the refusal may come from a view older than a node registered a moment ago
                # (on another replica): decide once more on a view as new as etcd's
                outcome = await retry_on_conflict(attempt, attempts=8)
            return outcome
        except Conflict:
            return Outcome(False, "INSUFFICIENT_RESOURCES",
                           "placement kept conflicting with concurrent writers; retry")

    async def _caught_up(self) -> bool:
        """Bring the placement views up to etcd's current revision; False if they already
        were (nothing new to decide on) or etcd cannot tell."""
        try:
            revision = await self.committer.etcd.current_revision()
        except StoreError:
            return False
        if self.cluster.nodes.revision >= revision:
            return False
        try:
            await self.cluster.wait_for(revision, timeout=3.0,
                                        which=("nodes", "allocations", "alive", "specs"))
        except StoreError:
            return False
        return True

    def _place(self, spec: WorkloadSpec, status: WorkloadStatus, *, exclude: frozenset[str]
               = frozenset(), only: str = "") -> _Placed | Outcome:
        cpu_m, mem_mb = request_of(spec)
        req = PlacementRequest(
            workload_id=spec.id, workload_type=spec.type, cpu_m=cpu_m, mem_mb=mem_mb,
            selector=dict(spec.labels), required_drivers=required_drivers(spec), exclude=exclude,
            only=frozenset({only}) if only else frozenset(),
        )
        decision = self.placer.decide(req)
        if decision.node_id is None:
            if only:
                return Outcome(False, "INSUFFICIENT_RESOURCES",
                               f"its local disk is on node {only!r}, which cannot take it: "
                               f"{decision.reason or 'node not found'}")
            return Outcome(False, "INSUFFICIENT_RESOURCES", decision.reason)
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
        now = self._now()
        status.node_id = node_id
        status.assigned_node = node_id
        status.status = "Scheduled"
        status.status_info.actual_state = "Pending"
        status.status_info.last_updated = now
        status.metadata["last_action"] = "Assigned"
        status.metadata["assignment_reason"] = decision.reason
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
        return _Placed(change, node_id, decision.reason, spec, status,
                       node_mod=node_item.mod_revision)

    async def _inline_volume_clash(self, spec: WorkloadSpec) -> Outcome | None:
        """INVALID_SPEC when an inline managed volume takes a standalone disk's driver and
        name: the agent knows a volume by those two, so it would be that disk, shared past the
        disk's access mode. A disk is attached with ``persys.disk.ids`` instead."""
        inline = {(str(v.get("driver")), str(v.get("name"))): i
                  for i, v in enumerate(managed_volumes_of(spec))
                  if isinstance(v, dict) and not v.get("disk_id")}
        if not inline:
            return None
        kvs, _ = await self.committer.etcd.list_prefix(self.layout.volumes_prefix)
        for kv in kvs:
            try:
                disk = json.loads(kv.value)
            except ValueError:
                continue
            if not isinstance(disk, dict):
                continue
            index = inline.get((str(disk.get("driver") or "local"), str(disk.get("name"))))
            if index is not None:
                return Outcome(False, "INVALID_SPEC",
                               f"spec.managed_volumes[{index}].name: {disk.get('name')!r} "
                               f"({disk.get('driver') or 'local'}) is disk "
                               f"{disk.get('id') or kv.key.rsplit('/', 1)[-1]!r}; attach "
                               f"it with {DISK_FIELD} instead")
        return None

    async def _create(self, parsed: ParsedApply) -> Outcome:
        assert parsed.spec is not None
        spec = copy_record(parsed.spec)
        clash = await self._inline_volume_clash(spec)
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
            _add_volumes(spec, disks.volumes())
        if not spec.revision_id:
            spec.revision_id = compute_revision(spec)
        now = self._now()
        status = WorkloadStatus(
            id=spec.id, status="Pending", retry=RetryState(attempts=0, max_attempts=5),
            status_info=StatusInfo(actual_state="Pending", last_updated=now),
            metadata={**parsed.metadata, "created_at": now, "last_action": "Created"},
        )
        placed = self._place(spec, status, only=disks.node_id if disks else "")
        if isinstance(placed, Outcome):
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
            await self._catch_up(exc)
            raise
        except OutcomeUnknown:
            self.placer.release(spec.id)
            # etcd may have applied it (its answer was lost): read back before answering
            status_key = self.layout.status(spec.id)
            assert intent.on_commit is not None
            revision = await self._resolve(lambda: self._created(status_key, status_bytes),
                                           intent.on_commit, what=f"placement of {spec.id}")
            if not revision:
                raise
        except BaseException:
            self.placer.release(spec.id)
            raise
        log.debug("workload placed workload_id=%s node_id=%s revision=%d reason=%r",
                  spec.id, placed.node_id, revision, placed.reason)
        return Outcome(True, node_id=placed.node_id, message=placed.reason)

    async def _created(self, key: str, value: bytes) -> int:
        """The revision at which ``key`` was created holding ``value`` (a new status record,
        unique to its attempt by its timestamps), or 0; raises ``StoreError`` while etcd
        cannot tell."""
        etcd = self.committer.etcd
        kv = await etcd.get(key)
        if kv is None:
            return 0
        first = kv if kv.version == 1 else await etcd.get(key, revision=kv.create_revision)
        return kv.create_revision if first is not None and first.value == value else 0

    async def _holds(self, key: str, value: bytes, *, after: int) -> int:
        """The revision at which ``key`` was written holding ``value`` after ``after``, or
        0; raises ``StoreError`` while etcd cannot tell."""
        kv = await self.committer.etcd.get(key)
        return kv.mod_revision if kv is not None and kv.value == value and (
            kv.mod_revision > after) else 0

    async def _resolve(self, landed: Callable[[], Awaitable[int]],
                       then: Callable[[int], None], *, what: str) -> int:
        """After an unknown outcome: the commit revision when ``landed`` reads the write back
        (``then`` has run), else 0. A miss is not final: the request may still be inside
        etcd and be applied after the read (seen with etcd stopped and resumed), so the
        write is read again in a task the dispatcher owns, which runs ``then`` if it shows
        up; a committed change whose answer was lost is not left for the reconcile loop's
        re-apply guard."""
        try:
            revision = await landed()
        except StoreError as exc:
            log.info("outcome of the %s unknown; asking etcd again later: %s", what, exc)
            revision = 0
        if revision:
            log.warning("outcome of the %s was unknown; read back as committed at %d", what,
                        revision)
            then(revision)
        else:
            self.dispatcher.spawn(self._resolve_later(landed, then, what=what))
        return revision

    async def _resolve_later(self, landed: Callable[[], Awaitable[int]],
                             then: Callable[[int], None], *, what: str) -> None:
        answered = 0
        for _ in range(RESOLVE_ATTEMPTS):
            await asyncio.sleep(RESOLVE_INTERVAL_S if not answered else RESOLVE_SETTLE_S)
            try:
                revision = await landed()
            except StoreError:
                continue
            if revision:
                log.warning("outcome of the %s was unknown; read back as committed at %d",
                            what, revision)
                then(revision)
                return
            answered += 1
            if answered > 1:
                return  # absent once etcd answered, and still after etcd's request timeout
        log.warning("outcome of the %s still unknown; the reconcile loop settles it", what)

    async def _catch_up(self, exc: Conflict) -> None:
        if exc.revision:
            await self.cluster.wait_for(
                exc.revision, which=("specs", "statuses", "allocations", "nodes"))

    async def _update(self, parsed: ParsedApply) -> Outcome:
        spec_item = self.cluster.specs.get(parsed.workload_id)
        status_item = self.cluster.statuses.get(parsed.workload_id)
        if spec_item is None or status_item is None:
            raise Conflict("workload changed while updating")
        old_spec = spec_item.value
        spec = copy_record(old_spec)
        status = copy_record(status_item.value)
        now = self._now()
        events: list[Event] = []
        compares = [Compare.mod(self.layout.spec(spec.id), spec_item.mod_revision),
                    Compare.mod(self.layout.status(spec.id), status_item.mod_revision)]
        puts: list[Put] = []
        if parsed.spec is None:
            if parsed.desired_state == old_spec.desired_state:
                return Outcome(True, message="desired state unchanged",
                               node_id=status.node_id)
            if parsed.desired_state == "Deleted":
                return await self.delete(spec.id)
            spec.desired_state = parsed.desired_state
            for key in REAPPLY_KEYS:
                status.metadata.pop(key, None)
            status.metadata["last_action"] = "DesiredStateUpdated"
            events.append(Event(type="WorkloadScheduled", workload_id=spec.id,
                                node_id=status.node_id, reason="Desired state updated",
                                details={"desired_state": spec.desired_state},
                                timestamp=self.clock.now()))
        else:
            new = copy_record(parsed.spec)
            clash = await self._inline_volume_clash(new)
            if clash is not None:
                return clash
            kept_disks = _disk_volumes(old_spec)
            # a workload stored before disks were attached here (or by the Go version) names
            # them in its metadata only: unchanged if it names the same ones
            attached_ids = set(disk_ids_in_spec(kept_disks)) or set(
                disk_ids_of(status.metadata, old_spec.vm))
            if set(disk_ids_of(parsed.metadata, new.vm)) != attached_ids:
                return Outcome(False, "INVALID_SPEC",
                               f"{DISK_FIELD}: the disks of an existing workload cannot change "
                               "(apply a new workload)")
            _add_volumes(new, kept_disks)
            new.created_at = old_spec.created_at or new.created_at
            new.extra = dict(old_spec.extra or {})
            if not new.revision_id:
                new.revision_id = compute_revision(new)
            if new.revision_id == old_spec.revision_id and new.desired_state == (
                old_spec.desired_state
            ) and status.node_id:
                return Outcome(True, message="no change (same revision)", node_id=status.node_id)
            old_req = request_of(old_spec)
            new_req = request_of(new)
            spec = new
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
            events.append(Event(type="WorkloadScheduled", workload_id=spec.id,
                                node_id=status.node_id, reason="Workload updated",
                                details={"revision_id": spec.revision_id},
                                timestamp=self.clock.now()))
            node_id = status.node_id
            if node_id and new_req != old_req:
                resized = self._resize(spec.id, node_id, new_req)
                if isinstance(resized, Outcome):
                    return resized
                compares.append(resized[0])
                puts.append(resized[1])
        if not status.node_id and spec.desired_state != "Deleted":
            # its disks decide where it may go, and follow it (as in the reconcile placement)
            relocator = Relocator(self)
            disks, pin = await relocator.disks_for_placement(spec, spec.id)
            if pin is None:
                return Outcome(False, "INSUFFICIENT_RESOURCES",
                               "its local disks are on different nodes")
            placed = self._place(spec, status, only=pin)
            if isinstance(placed, Outcome):
                return placed
            compares += placed.change.compares
            puts += placed.change.puts
            disk_compares, disk_puts = relocator.move_disks(
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
            await self.committer.commit(Change(kind="workload", compares=compares, puts=puts,
                                               events=events), on_commit=dispatch)
        except Conflict as exc:
            await self._catch_up(exc)
            raise
        except OutcomeUnknown:
            # etcd may have applied it (its answer was lost): read back before answering
            spec_key, spec_bytes, before = (self.layout.spec(spec.id), stored[0],
                                            spec_item.mod_revision)
            if not await self._resolve(lambda: self._holds(spec_key, spec_bytes, after=before),
                                       dispatch, what=f"update of {spec.id}"):
                raise
        return Outcome(True, node_id=status.node_id, message="updated")

    def _resize(self, workload_id: str, node_id: str,
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

    # -- DeleteWorkload ---------------------------------------------------------------------
    async def delete(self, workload_id: str) -> Outcome:
        frozen = self._frozen()
        if frozen is not None:
            return frozen

        async def attempt(n: int) -> Outcome:
            spec_item = self.cluster.specs.get(workload_id)
            status_item = self.cluster.statuses.get(workload_id)
            if spec_item is None:
                return Outcome(False, "", f"workload {workload_id} not found")
            spec = copy_record(spec_item.value)
            status = copy_record(status_item.value) if status_item else WorkloadStatus(
                id=workload_id)
            if spec.desired_state == "Deleted" and status.status == "Deleting":
                self.dispatcher.delete(workload_id, status.node_id)
                return Outcome(True, message="delete already in progress")
            spec.desired_state = "Deleted"
            status.status = "Deleting"
            status.metadata["last_action"] = "MarkedDeleted"
            status.status_info.last_updated = self._now()
            change = Change(
                kind="workload",
                compares=[Compare.mod(self.layout.spec(workload_id), spec_item.mod_revision),
                          Compare.mod(self.layout.status(workload_id),
                                      status_item.mod_revision if status_item else 0)],
                puts=[Put(self.layout.spec(workload_id), encode(spec), category="spec"),
                      Put(self.layout.status(workload_id), encode(status), category="status")],
            )
            try:
                committed = await self.committer.commit(change)
            except Conflict as exc:
                await self._catch_up(exc)
                raise
            self.dispatcher.delete(workload_id, status.node_id, after=committed.revision)
            return Outcome(True, message="delete requested")

        return await retry_on_conflict(attempt)

    # -- RetryWorkload ----------------------------------------------------------------------
    async def retry(self, workload_id: str) -> Outcome:
        frozen = self._frozen()
        if frozen is not None:
            return frozen
        now = self._now()

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            status.retry.attempts = 0
            status.retry.next_retry_at = now
            if status.retry.max_attempts <= 0:
                status.retry.max_attempts = 5
            for key in REAPPLY_KEYS + TERMINAL_KEYS:
                status.metadata.pop(key, None)
            spec_now = self.cluster.specs.get(workload_id)
            if spec_now is not None and status.node_id and (
                spec_now.value.desired_state != "Deleted"
            ):
                mark_apply_requested(status, spec_now.value, now)
            status.metadata["last_action"] = "RetryTriggered"
            if status.status in ("Failed", "RetryPending"):
                status.status = "Pending"
            return [Event(type="RetryTriggered", workload_id=workload_id, node_id=status.node_id,
                          reason="retry requested",
                          details={"attempts": "0", "next_retry_at": now},
                          timestamp=self.clock.now())]

        try:
            status, committed = await self.writer.update_status(workload_id, mutate,
                                                                kind="workload")
        except NotFound:
            return Outcome(False, "", f"workload {workload_id} not found")
        spec_item = self.cluster.specs.get(workload_id)
        if spec_item is not None and status.node_id and spec_item.value.desired_state != "Deleted":
            self.dispatcher.apply(spec_item.value, status.metadata, status.node_id,
                                  spec_item.value.desired_state,
                                  after=committed.revision if committed else 0)
        return Outcome(True, node_id=status.node_id)


def _disk_volumes(spec: WorkloadSpec) -> list[dict[str, Any]]:
    """The managed volumes a stored spec got from standalone disks."""
    return [v for v in managed_volumes_of(spec) if isinstance(v, dict) and v.get("disk_id")]


def _add_volumes(spec: WorkloadSpec, volumes: list[dict[str, Any]]) -> None:
    """Append managed volumes where the agent request takes them from (a VM's own list)."""
    if not volumes:
        return
    if spec.type in ("vm", "microvm"):
        vm = dict(spec.vm or {})
        vm["managedVolumes"] = [*(vm.get("managedVolumes") or []), *volumes]
        spec.vm = vm
    else:
        spec.managed_volumes = [*spec.managed_volumes, *volumes]


def release_allocation(change: Change, cluster: ClusterProjection, layout: KeyLayout,
                       node_id: str, workload_id: str) -> None:
    """Add to ``change`` the CAS rewrite of ``node_id``'s allocation without ``workload_id``
    (nothing when the allocation does not hold it)."""
    held = cluster.allocations.get(node_id)
    if held is None or workload_id not in held.value.workloads:
        return
    record = held.value.clone()
    record.remove(workload_id)
    change.compares.append(Compare.mod(layout.allocation(node_id), held.mod_revision))
    change.puts.append(Put(layout.allocation(node_id), encode(record), category="allocation"))


class Relocator:
    """Moves workloads off a node (drain, failover), each move one CAS transaction."""

    def __init__(self, commands: WorkloadCommands) -> None:
        self.c = commands

    async def relocate(self, workload_id: str, *, from_node: str, event_type: str,
                       fenced: bool = False, report_skip: bool = True) -> str:
        """Move one workload; returns 'moved', 'skipped', 'no-target' or 'gone'."""
        c = self.c

        async def attempt(n: int) -> str:
            spec_item = c.cluster.specs.get(workload_id)
            status_item = c.cluster.statuses.get(workload_id)
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
                await c.committer.commit(Change(kind="relocate", events=[Event(
                    type="RescheduleSkipped", workload_id=workload_id, node_id=from_node,
                    reason="node-local workload is not moved",
                    details={"persistence_class": pclass}, timestamp=c.clock.now())]),
                    fenced=fenced)
                return "skipped"
            # read before deciding: no await between the decision and its reservation
            disks = await self._disks_of(spec)
            placed = c._place(spec, status, exclude=frozenset({from_node}))
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
            mark_apply_requested(new_status, spec, rfc3339(c.clock.now()))
            change = placed.change
            change.compares.append(Compare.mod(c.layout.status(workload_id),
                                               status_item.mod_revision))
            change.puts.append(Put(c.layout.status(workload_id), encode(new_status),
                                   category="status"))
            release_allocation(change, c.cluster, c.layout, from_node, workload_id)
            disk_compares, disk_puts = self.move_disks(
                disks, workload_id, from_node=from_node, to_node=placed.node_id)
            change.compares.extend(disk_compares)
            change.puts.extend(disk_puts)
            change.events.append(Event(
                type=event_type, workload_id=workload_id, node_id=placed.node_id,
                reason=placed.reason, details={"previous_node": from_node},
                timestamp=c.clock.now()))
            cpu_m, mem_mb = request_of(spec)
            c.placer.reserve(workload_id, placed.node_id, cpu_m, mem_mb)
            try:
                committed = await c.committer.commit(change, fenced=fenced)
            except Conflict as exc:
                c.placer.release(workload_id)
                await c._catch_up(exc)
                raise
            except BaseException:
                c.placer.release(workload_id)
                raise
            # a fenced move is a leader loop's: its agent calls go out only while it leads
            c.dispatcher.apply(spec, new_status.metadata, placed.node_id, spec.desired_state,
                               after=committed.revision, leader_only=fenced)
            c.dispatcher.forget_on(workload_id, from_node, leader_only=fenced)
            # the next move off this node reads the allocation this one wrote
            with contextlib.suppress(StoreError):
                await c.cluster.wait_for(committed.revision, timeout=2.0,
                                         which=("allocations", "statuses"))
            return "moved"

        # every move off one node rewrites that node's allocation: moves of one replica from
        # one node go one at a time instead of failing each other's compares (a failover of 30
        # workloads once lost two thirds of its moves to conflicts, left to later cycles)
        async with c.writer.locks.hold(c.layout.allocation(from_node)):
            return await retry_on_conflict(attempt)

    async def _disks_of(self, spec: WorkloadSpec) -> dict[str, Found]:
        """The records of the standalone disks the workload uses (read from etcd)."""
        disk_ids = disk_ids_in_spec(_disk_volumes(spec))
        if not disk_ids:
            return {}
        return await load_disks(self.c.committer.etcd, self.c.layout, disk_ids)

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
        c = self.c
        compares: list[Compare] = []
        puts: list[Put] = []
        now = rfc3339(c.clock.now())
        for disk_id, record, mod in used_by(disks, workload_id):
            node_of = {str(ref): item.value.node_id for ref in record.get("workloadRefs") or []
                       if (item := c.cluster.statuses.get(str(ref))) is not None}
            compare, put = rewrite(c.layout, disk_id, mod, moved(
                record, workload_id, from_node=from_node, to_node=to_node, node_of=node_of,
                now=now))
            compares.append(compare)
            puts.append(put)
        return compares, puts
