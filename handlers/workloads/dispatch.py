"""Agent calls that follow a commit: the apply after a placement, the delete after a
delete request, and the finalisation that removes a deleted workload's state.

Commands answer once their state is committed; the agent call runs afterwards in a task this
dispatcher owns, with bounded concurrency. If this process dies in between, nothing is lost: the
committed state says what should run, and the leader's reconcile loop drives it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from eventsource.clock import Clock
from eventsource.commit import Change, Committer, retry_on_conflict
from eventsource.errors import Conflict, NotLeader, StoreError
from eventsource.events import Event, rfc3339
from eventsource.keys import KeyLayout
from eventsource.records import WorkloadSpec, WorkloadStatus, copy_record
from handlers.agents.pool import AgentError, AgentPool
from handlers.specs.agent_request import CONVERSION_ERRORS, agent_apply_request
from handlers.specs.stored import being_deleted, normalize_desired_state
from handlers.storage.attachments import (
    detached,
    disk_ids_in_spec,
    disk_ids_of,
    load_disks,
    rewrite,
    used_by,
)
from handlers.workloads.changes import delete_workload_change
from handlers.workloads.evidence import AgentEvidence
from handlers.workloads.metadata import agent_metadata, merge_metadata, metadata_news
from handlers.workloads.retry import is_vm
from handlers.writes.cas import NotFound, StateWriter
from projections.cluster import ClusterProjection, node_of
from proto.persys.agent.v1 import agent_pb2

log = logging.getLogger("persys.dispatch")

#: how long a queued apply waits for this replica's projection to show the commit behind it
PROJECTION_WAIT_S = 10.0
#: agent calls to one node at once: the shared slots are held across each call, and calls
#: stuck on one hung agent (until their deadline: 45 s, 240 s for a VM) would otherwise take
#: every slot and hold up the calls to healthy nodes
PER_NODE_CALLS = 16


def refused(answer: Any) -> bool:
    """An agent's DeleteWorkloadResponse that says no (success=false), whatever its message.

    Its text is no evidence that the workload is gone: "not found" may be about anything else
    (Docker's "network persys-net not found"), and the Go scheduler, which took it for
    "gone", removed the state of workloads its agents still ran (docs/compatibility.md,
    "Not-found deletes"). Whether the workload is there is asked of the agent
    (``handlers.workloads.evidence``) or read from its next listing (the reconcile loop).
    """
    return not answer.success


@dataclass
class _NodeGate:
    sem: asyncio.Semaphore
    users: int = 0


class Dispatcher:
    """Runs post-commit agent calls in owned, bounded tasks."""

    def __init__(
        self,
        *,
        pool: AgentPool,
        cluster: ClusterProjection,
        committer: Committer,
        writer: StateWriter,
        clock: Clock,
        layout: KeyLayout,
        concurrency: int = 64,
        apply_timeout: float = 45.0,
        vm_apply_timeout: float = 240.0,
        delete_confirm_s: float = 60.0,
        delete_poll_s: float = 1.0,
    ) -> None:
        self.pool = pool
        self.gone = AgentEvidence(pool, clock=clock, wait_s=delete_confirm_s,
                                  poll_s=delete_poll_s)
        self.cluster = cluster
        self.committer = committer
        self.writer = writer
        self.clock = clock
        self.layout = layout
        self.apply_timeout = apply_timeout
        #: a VM's first apply creates and boots it: the reconcile loop's VM deadline
        self.vm_apply_timeout = vm_apply_timeout
        self._sem = asyncio.Semaphore(concurrency)
        self._per_node = min(PER_NODE_CALLS, concurrency)
        #: node id -> its gate, while calls to it wait or run (removed when none does)
        self._node_gates: dict[str, _NodeGate] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @contextlib.asynccontextmanager
    async def _slot(self, node_id: str) -> AsyncIterator[None]:
        """One of the node's slots (``PER_NODE_CALLS``), then one of the shared ones."""
        gate = self._node_gates.get(node_id)
        if gate is None:
            gate = self._node_gates[node_id] = _NodeGate(asyncio.Semaphore(self._per_node))
        gate.users += 1
        try:
            async with gate.sem, self._sem:
                yield
        finally:
            gate.users -= 1
            if gate.users == 0:
                del self._node_gates[node_id]

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` in a task this dispatcher owns (cancelled and awaited at close)."""
        self._spawn(coro)

    async def etcd_revision(self) -> int:
        return await self.committer.etcd.current_revision()

    def endpoint(self, node_id: str) -> str | None:
        item = self.cluster.nodes.get(node_id)
        return item.value.endpoint if item is not None else None

    # -- apply ------------------------------------------------------------------------------
    def apply(self, spec: WorkloadSpec, metadata: dict[str, Any], node_id: str,
              desired: str, *, after: int = 0, leader_only: bool = False) -> None:
        """Send the apply in an owned task.

        ``after``: the revision that committed this apply. Just before the call the projection
        is brought to it and the apply is dropped if the workload has moved on meanwhile
        (deleted, moved, updated or stopped): a queued apply must not bring back a workload
        deleted while it waited. ``leader_only``: the change was committed by a leader loop
        (fenced); the apply is sent only if this replica still leads when its turn comes, and
        carries the leader term, so a replica that lost leadership meanwhile never applies on
        the new leader's behalf.
        """
        self._spawn(self._apply(copy_record(spec), dict(metadata), node_id, desired,
                                after, leader_only))

    async def _shows_commit(self, after: int) -> str | None:
        """None once this replica's projection shows revision ``after``; else why not."""
        if not after:
            return None
        try:
            await self.cluster.wait_for(after, timeout=PROJECTION_WAIT_S,
                                        which=("specs", "statuses"))
        except StoreError as exc:
            return f"state not readable ({exc}); the reconcile loop applies it"
        return None

    def _superseded(self, spec: WorkloadSpec, node_id: str, desired: str) -> str | None:
        """None when the apply still stands on the projection; otherwise why it is dropped."""
        spec_item = self.cluster.specs.get(spec.id)
        status_item = self.cluster.statuses.get(spec.id)
        if spec_item is None or status_item is None:
            return "the workload is gone"
        current, status = spec_item.value, status_item.value
        if being_deleted(current, status):
            return "the workload is being deleted"
        if node_of(status) != node_id:
            return f"the workload moved to {node_of(status) or 'no node'}"
        if current.revision_id != spec.revision_id or (
                normalize_desired_state(current.desired_state)
                != normalize_desired_state(desired)):
            return "a newer spec superseded it (its own apply follows)"
        return None

    async def _apply(self, spec: WorkloadSpec, metadata: dict[str, Any], node_id: str,
                     desired: str, after: int = 0, leader_only: bool = False) -> None:
        # the wait holds no slot; the check runs in the slot, right before the call
        why_not = await self._shows_commit(after)
        async with self._slot(node_id):
            if why_not is None:
                why_not = self._superseded(spec, node_id, desired)
            if why_not is not None:
                log.info("apply not sent workload_id=%s node_id=%s: %s", spec.id, node_id,
                         why_not)
                return
            endpoint = self.endpoint(node_id)
            if endpoint is None:
                return
            try:
                request = agent_apply_request(spec, metadata, desired)
            except CONVERSION_ERRORS as exc:  # a spec stored before ApplyWorkload checked it
                log.warning("apply not sent: the spec cannot be converted workload_id=%s "
                            "node_id=%s error=%r", spec.id, node_id, exc)
                await self._record_apply(spec, node_id, error=f"spec cannot be sent: {exc!r}")
                return
            try:
                response = await self.pool.apply(node_id, endpoint, request,
                                                 timeout=(self.vm_apply_timeout
                                                          if is_vm(spec.type)
                                                          else self.apply_timeout),
                                                 leader_only=leader_only)
            except AgentError as exc:
                log.warning("agent apply failed workload_id=%s node_id=%s error=%s",
                            spec.id, node_id, exc)
                await self._record_apply(spec, node_id, error=str(exc))
                return
            except NotLeader:
                log.info("apply not sent: leadership lost since the placement workload_id=%s "
                         "node_id=%s", spec.id, node_id)
                return
            if not response.applied and not response.skipped:
                await self._record_apply(spec, node_id, error=response.message or "not applied")
                return
            # success costs no write (the committing transaction already recorded the apply
            # request, lastApplyRequestAt, and the agent's reports show the outcome) unless
            # the answer carries agent metadata the status does not hold yet
            await self._record_answer(spec, node_id, response.status)

    async def _record_answer(self, spec: WorkloadSpec, node_id: str,
                             answer: agent_pb2.WorkloadStatus) -> None:
        """Merge the metadata of an accepted apply's status into the status record
        (docs/compatibility.md, "Workload status metadata")."""
        if answer.metadata.get("task_id"):
            log.debug("apply accepted workload_id=%s node_id=%s task_id=%s", spec.id, node_id,
                      answer.metadata["task_id"])
        reported = agent_metadata(answer.metadata) if answer.metadata else {}
        if not reported or (answer.revision_id and spec.revision_id
                            and answer.revision_id != spec.revision_id):
            return
        failed = answer.actual_state == agent_pb2.ACTUAL_STATE_FAILED
        item = self.cluster.statuses.get(spec.id)
        if item is None or not metadata_news(reported, item.value.metadata, failed=failed):
            return

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            current = self.cluster.specs.get(spec.id)
            if (node_of(status) != node_id or current is None
                    or current.value.revision_id != spec.revision_id
                    or being_deleted(current.value, status)):
                return None  # superseded while the call ran
            news = metadata_news(reported, status.metadata, failed=failed)
            return [] if merge_metadata(status.metadata, news) else None

        try:
            await self.writer.update_status(spec.id, mutate, kind="dispatch")
        except (NotFound, Conflict, StoreError) as exc:
            log.info("apply answer not recorded workload_id=%s: %s", spec.id, exc)

    async def _record_apply(self, spec: WorkloadSpec, node_id: str, *, error: str) -> None:
        """Record a failed apply on the status, for the reconcile loop's retry budget."""

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if status.node_id != node_id:
                return None
            status.metadata["scheduler_last_error"] = error
            status.metadata["last_action"] = "ApplyFailed"
            return []

        try:
            try:
                await self.writer.update_status(spec.id, mutate, kind="dispatch")
            except NotFound:
                # the agent answered before this replica's projection showed the commit
                await self.cluster.wait_for(await self.etcd_revision(), which=("statuses",))
                await self.writer.update_status(spec.id, mutate, kind="dispatch")
        except (NotFound, Conflict, StoreError) as exc:
            log.info("apply outcome not recorded workload_id=%s: %s", spec.id, exc)

    # -- delete -----------------------------------------------------------------------------
    def delete(self, workload_id: str, node_id: str, *, after: int = 0) -> None:
        """Delete on the agent, then remove the state. ``after``: the revision of the delete
        request; finalisation reads the projection, which must show it (or it would see the
        workload still desired and leave it to the next reconcile cycle)."""
        self._spawn(self._delete(workload_id, node_id, after))

    async def _delete(self, workload_id: str, node_id: str, after: int = 0) -> None:
        async with self._slot(node_id):
            endpoint = self.endpoint(node_id) if node_id else None
            if endpoint is not None:
                try:
                    answer = await self.pool.delete(node_id, endpoint, workload_id)
                    if refused(answer) and not await self.gone.gone(
                            node_id, endpoint, workload_id):
                        # the agent still holds it (or cannot say): finalising could leave an
                        # orphan there
                        log.warning("agent refused the delete workload_id=%s node_id=%s: %s "
                                    "(reconcile retries)", workload_id, node_id, answer.message)
                        return
                except AgentError as exc:
                    if not (exc.not_found or exc.unreachable):
                        log.warning("agent delete failed workload_id=%s node_id=%s error=%s",
                                    workload_id, node_id, exc)
                        return
                    if exc.unreachable and self.cluster.alive.get(node_id) is not None:
                        # the node is alive but did not answer: keep Deleting for reconcile
                        return
                except NotLeader:
                    return
                else:
                    # as in Go: Deleting until the agent no longer lists it (or the wait ends)
                    await self.gone.wait_gone(node_id, endpoint, workload_id)
            try:
                if after:
                    await self.cluster.wait_for(after, which=("specs", "statuses",
                                                              "allocations"))
                await self.finalize(workload_id)
            except StoreError as exc:
                log.warning("delete finalisation failed workload_id=%s: %s", workload_id, exc)

    def forget_on(self, workload_id: str, node_id: str, *, leader_only: bool = False) -> None:
        """Best-effort removal of a moved workload from the node it left (``leader_only``: as
        for ``apply``)."""
        self._spawn(self._forget_on(workload_id, node_id, leader_only))

    async def _forget_on(self, workload_id: str, node_id: str, leader_only: bool) -> None:
        async with self._slot(node_id):
            endpoint = self.endpoint(node_id)
            if endpoint is None:
                return
            try:
                await self.pool.delete(node_id, endpoint, workload_id, leader_only=leader_only)
            except (AgentError, NotLeader) as exc:
                log.info("old copy not removed workload_id=%s node_id=%s: %s (drift cleans up)",
                         workload_id, node_id, exc)

    async def finalize(self, workload_id: str, *, fenced: bool = False) -> bool:
        """Remove a deleted workload's state and release its allocation; True when removed."""
        async def attempt(n: int) -> bool:
            spec_item = self.cluster.specs.get(workload_id)
            status_item = self.cluster.statuses.get(workload_id)
            if spec_item is None:
                return False
            if spec_item.value.desired_state != "Deleted":
                return False
            node_id = status_item.value.node_id if status_item else ""
            allocation = None
            if node_id:
                alloc_item = self.cluster.allocations.get(node_id)
                if alloc_item is not None and workload_id in alloc_item.value.workloads:
                    record = alloc_item.value.clone()
                    record.remove(workload_id)
                    allocation = (node_id, record, alloc_item.mod_revision)
            change = delete_workload_change(
                self.layout, workload_id, spec_rev=spec_item.mod_revision,
                status_rev=status_item.mod_revision if status_item else 0,
                allocation=allocation,
                event=Event(type="WorkloadDeleted", workload_id=workload_id, node_id=node_id,
                            reason="Workload state removed", timestamp=self.clock.now()),
            )
            await self._detach_disks(change, spec_item.value,
                                     status_item.value.metadata if status_item else {})
            try:
                await self.committer.commit(change, fenced=fenced)
            except Conflict as exc:
                if exc.revision:
                    await self.cluster.wait_for(exc.revision,
                                                which=("specs", "statuses", "allocations"))
                raise
            return True

        return await retry_on_conflict(attempt)

    async def _detach_disks(self, change: Change, spec: WorkloadSpec,
                            metadata: dict[str, Any]) -> None:
        """Release the workload's standalone disks in its finalising transaction: those its
        spec got volumes from, and those its metadata names (records written before disks
        were attached here, or by the Go version); a disk deleted meanwhile, or not
        referencing the workload, is left alone."""
        volumes = spec.managed_volumes or (spec.vm or {}).get("managedVolumes") or []
        disk_ids = list(dict.fromkeys([*disk_ids_in_spec(volumes),
                                       *disk_ids_of(metadata, spec.vm)]))
        if not disk_ids:
            return
        now = rfc3339(self.clock.now())
        found = await load_disks(self.committer.etcd, self.layout, disk_ids)
        for disk_id, record, mod in used_by(found, spec.id):
            compare, put = rewrite(self.layout, disk_id, mod, detached(record, spec.id, now))
            change.compares.append(compare)
            change.puts.append(put)

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
