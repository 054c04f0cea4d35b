"""The reconcile actions that only write a workload's status: charge a failure, settle,
mark terminal, record the agent's report.

Why apart: these executors make no agent call and move nothing; each is one fenced status
mutation that re-checks, at write time, what the plan assumed (the workload still on the
node the report was about, the spec still at the revision the plan saw). The agent calls
(``handlers.reconcile.agentcalls``) and relocations (``handlers.reconcile.relocations``) charge
their failures through ``count_failure`` here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from eventsource.events import Event, rfc3339
from eventsource.records import WorkloadStatus
from handlers.reconcile.planner.inputs import node_of
from handlers.reconcile.planner.workload import Action
from handlers.reconcile.shell import LoopShell
from handlers.specs.stored import normalize_desired_state
from handlers.workloads.metadata import merge_metadata
from handlers.workloads.retry import (
    REAPPLY_KEYS,
    apply_failure,
    apply_success,
    decide_failure,
    failure_counted,
)


class StatusWrites:
    """Status-only executors of the reconcile actions, each one fenced write.

    Go's rules: docs/compatibility.md, "Reconcile order" and "Retry budget"."""

    def __init__(self, shell: LoopShell) -> None:
        self.cluster = shell.cluster
        self.writer = shell.writer
        self.policy = shell.policy

    async def count_failure(self, workload_id: str, node_id: str, *, reason: str, now: datetime,
                            once: bool, reported: Mapping[str, str | None] | None = None,
                            revision: str | None = None) -> bool:
        """Charge one failure to the retry budget, fenced. ``once``: only if the latest
        apply's failure was not counted yet (an observed Failed is seen by many cycles).
        ``reported``: the agent's metadata news, merged in the same write. ``revision``: the
        spec revision the failure was observed for (nothing is charged to a newer one)."""

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_id and node_of(status) != node_id:
                return None
            if revision is not None and not self._spec_unchanged(workload_id, revision):
                return None
            if once and failure_counted(status):
                return None
            merge_metadata(status.metadata, reported or {})
            outcome = decide_failure(status, reason=reason, now=now, policy=self.policy,
                                     workload_id=workload_id, node_id=node_id)
            apply_failure(status, outcome, now=now)
            return [outcome.event]

        await self.writer.update_status(workload_id, mutate, kind="retry", fenced=True)
        return True

    def _spec_unchanged(self, workload_id: str, revision: str) -> bool:
        """The spec is still at ``revision`` and not being deleted. Read inside a status
        mutation: an update or a delete writes the status in the same transaction as the spec,
        so the projections show both or neither when the status is read fresh."""
        item = self.cluster.specs.get(workload_id)
        return (item is not None and item.value.revision_id == revision
                and normalize_desired_state(item.value.desired_state) != "Deleted")

    async def settle(self, action: Action, now: datetime) -> bool:
        actual = action.observed or "Running"

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_of(status) != action.node_id:
                return None
            if not self._spec_unchanged(action.workload_id, action.revision):
                return None  # updated or deleted since the listing: the report is stale
            merged = merge_metadata(status.metadata, dict(action.reported))
            return [] if apply_success(status, actual=actual, now=now) or merged else None

        await self.writer.update_status(action.workload_id, mutate, kind="reconcile",
                                        fenced=True)
        return True

    async def mark_terminal(self, action: Action, now: datetime) -> bool:
        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if action.reported and node_of(status) != action.node_id:
                return None  # moved since the plan: the report was about the old copy
            if not self._spec_unchanged(action.workload_id, action.revision):
                return None  # updated or deleted since the plan: decided for the old spec
            merged = merge_metadata(status.metadata, dict(action.reported))
            if status.status == "Failed" and not merged:
                return None
            status.status = "Failed"
            status.status_info.actual_state = "Failed"
            status.status_info.last_updated = rfc3339(now)
            status.metadata["last_action"] = "TerminalFailureNoReapply"
            status.metadata["terminal_failure_reason"] = action.reason
            for key in REAPPLY_KEYS:
                status.metadata.pop(key, None)
            return []

        await self.writer.update_status(action.workload_id, mutate, kind="reconcile",
                                        fenced=True)
        return True

    async def record_report(self, action: Action) -> bool:
        """Merge the agent's metadata news into the status, and nothing else
        (docs/compatibility.md, "Workload status metadata")."""

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_of(status) != action.node_id:
                return None
            if not self._spec_unchanged(action.workload_id, action.revision):
                return None
            return [] if merge_metadata(status.metadata, dict(action.reported)) else None

        await self.writer.update_status(action.workload_id, mutate, kind="reconcile",
                                        fenced=True)
        return True
