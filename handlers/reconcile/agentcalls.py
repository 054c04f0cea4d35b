"""The reconcile actions that call an agent: delete a workload on it, apply a workload to it.

Why apart: these are the only executors with an agent RPC (``leader_only``, deadlined); each
re-checks what the plan assumed before the call (the workload still on that node, not being
deleted, its desired state unchanged) and after it (the spec not superseded while the call
ran). What the answer means is decided here: an unreachable agent marks its node NotReady, a
missing runtime unassigns the workload (``handlers.reconcile.relocations``), any other failure
is charged to the retry budget (``handlers.reconcile.statuswrites``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime

from eventsource.events import Event, rfc3339
from eventsource.records import WorkloadStatus
from handlers.agents.pool import AgentError
from handlers.reconcile.bookkeeping import CycleReport
from handlers.reconcile.planner.inputs import STOPPED, NodeView, node_of
from handlers.reconcile.planner.workload import APPLY_STOPPED, REAPPLY, Action
from handlers.reconcile.relocations import Relocations
from handlers.reconcile.shell import LoopShell
from handlers.reconcile.statuswrites import StatusWrites
from handlers.specs.agent_request import CONVERSION_ERRORS, agent_apply_request
from handlers.specs.stored import (
    DELETING_STATUSES,
    being_deleted,
    compute_revision,
    normalize_desired_state,
)
from handlers.workloads.dispatch import refused
from handlers.workloads.metadata import agent_metadata, merge_metadata, metadata_news
from handlers.workloads.retry import (
    LAST_APPLY_AT,
    LAST_APPLY_REVISION,
    REAPPLY_ATTEMPTS,
    REAPPLY_NEXT_AT,
    ReapplyState,
    after_reapply,
    is_vm,
)

log = logging.getLogger("persys.loops")

#: an apply error with this text (any case) means the node lacks the workload's runtime
#: (docs/compatibility.md, "Runtime unsupported")
RUNTIME_MISSING = "runtime not available"


class AgentCalls:
    """The reconcile cycle's DeleteWorkload and ApplyWorkload calls, and what their answers
    are made into."""

    def __init__(self, shell: LoopShell, status_writes: StatusWrites,
                 relocations: Relocations) -> None:
        self.shell = shell
        self.agents = shell.agents
        self.cluster = shell.cluster
        self.dispatcher = shell.dispatcher
        self.settings = shell.settings
        self.writer = shell.writer
        self.policy = shell.policy
        self.status_writes = status_writes
        self.relocations = relocations

    async def delete(self, workload_id: str, node_id: str, views: Mapping[str, NodeView],
                     report: CycleReport, *, finalize: bool) -> bool:
        """DeleteWorkload on the node's agent (an agent without the workload counts as done);
        ``finalize``: then finalise the deletion (the Deleting finisher)."""
        view = views.get(node_id)
        if view is None or not view.endpoint:
            return False
        report.rpcs["DeleteWorkload"] += 1
        try:
            answer = await self.agents.delete(node_id, view.endpoint, workload_id,
                                              leader_only=True)
            if refused(answer):
                log.info("agent refused the delete workload_id=%s node_id=%s: %s", workload_id,
                         node_id, answer.message)
                return False
        except AgentError as exc:
            if not exc.not_found:
                log.info("agent delete failed workload_id=%s node_id=%s: %s", workload_id,
                         node_id, exc)
                return False
        if finalize:
            await self.dispatcher.finalize(workload_id, fenced=True)
        return True

    async def apply(self, action: Action, views: Mapping[str, NodeView], report: CycleReport,
                    now: datetime) -> bool:
        """ApplyWorkload in the planned desired state (``REAPPLY``: Running,
        ``APPLY_STOPPED``: Stopped), then its outcome on the status."""
        wid, node_id = action.workload_id, action.node_id
        spec_item = self.cluster.specs.get(wid)
        status_item = self.cluster.statuses.get(wid)
        view = views.get(node_id)
        if spec_item is None or status_item is None or view is None:
            return False
        spec = spec_item.value
        if node_of(status_item.value) != node_id or being_deleted(spec, status_item.value):
            # the plan is older than this moment: a delete committed since (by any replica)
            # must not be undone by the apply the plan asked for
            return False
        desired = STOPPED if action.kind == APPLY_STOPPED else "Running"
        if normalize_desired_state(spec.desired_state) != desired:
            # the desired state changed since the plan (a stop after a planned re-apply): its
            # own apply is on its way, and this one would undo it
            return False
        try:
            request = agent_apply_request(spec, status_item.value.metadata, desired)
        except CONVERSION_ERRORS as exc:  # a spec stored before ApplyWorkload checked it
            await self.status_writes.count_failure(
                wid, node_id, reason=f"spec cannot be sent: {exc!r}", now=now, once=False)
            return False
        timeout = (self.settings.agent_vm_apply_timeout_s if is_vm(spec.type)
                   else self.settings.agent_apply_timeout_s)
        report.rpcs["ApplyWorkload"] += 1
        try:
            resp = await self.agents.apply(node_id, view.endpoint, request, timeout=timeout,
                                           leader_only=True)
        except AgentError as exc:
            if exc.unreachable:
                await self.shell.mark_not_ready(node_id, reason=f"agent unreachable: {exc}",
                                          source="reconciler", now=now)
            elif RUNTIME_MISSING in str(exc).lower():
                return await self.relocations.runtime_unsupported(wid, node_id, str(exc), now)
            await self.status_writes.count_failure(
                wid, node_id, reason=f"apply failed: {exc}", now=now, once=False)
            return False
        if not resp.applied and not resp.skipped:
            if RUNTIME_MISSING in (resp.message or "").lower():
                return await self.relocations.runtime_unsupported(wid, node_id, resp.message, now)
            await self.status_writes.count_failure(
                wid, node_id, reason=resp.message or "apply not accepted", now=now, once=False)
            return False
        agent_meta = agent_metadata(resp.status.metadata)
        state = {1: "Pending", 2: "Running", 3: "Stopped", 4: "Failed"}.get(
            int(resp.status.actual_state), "Pending")
        stamp = rfc3339(now)
        revision = request.revision_id

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_of(status) != node_id or status.status in DELETING_STATUSES:
                return None
            current = self.cluster.specs.get(wid)
            if current is None or (current.value.revision_id
                                   or compute_revision(current.value)) != revision or (
                    normalize_desired_state(current.value.desired_state) != desired):
                return None  # superseded while the call ran: the newer change's record stands
            meta = status.metadata
            merge_metadata(meta, metadata_news(agent_meta, meta, failed=state == "Failed"))
            if action.kind == REAPPLY:
                meta.update(after_reapply(ReapplyState.read(meta), revision_id=revision,
                                          workload_type=spec.type, now=now, policy=self.policy))
            else:
                meta[LAST_APPLY_AT] = stamp
                meta[LAST_APPLY_REVISION] = revision
                meta.pop(REAPPLY_ATTEMPTS, None)
                meta.pop(REAPPLY_NEXT_AT, None)
            meta["last_action"] = action.kind
            status.retry.next_retry_at = ""
            status.status = state
            status.status_info.actual_state = state
            status.status_info.last_updated = stamp
            return [Event(type="WorkloadScheduled", workload_id=wid, node_id=node_id,
                          reason=action.kind, timestamp=now,
                          details={"revision_id": revision, "desired_state": desired})]

        await self.writer.update_status(wid, mutate, kind="reconcile", fenced=True)
        return True
