"""Drift remediation: carry out the findings of drift detection and record them.

Why apart: drift is classified purely (``handlers.reconcile.planner.drift``) on the cycles asked for
it; carrying a finding out is its own kind of act (adopt a workload to the node that runs
it, delete an orphan or a duplicate from an agent, align a status), credited to the reconcile
action that already did it where there is one, and each admitted finding is recorded as a
``DriftRecord`` and a ``DriftDetected`` event, batched and fenced. The de-duplication window
(``DriftDeduper``) is remediation's own memory between cycles. Go's actions:
docs/compatibility.md, "Drift detection"; what is ours: "Drift adoption".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime

from eventsource.commit import Change, retry_on_conflict
from eventsource.errors import Conflict, StoreError
from eventsource.etcd import Compare, Delete, Put
from eventsource.events import Event, rfc3339
from eventsource.records import Allocation, Assignment, WorkloadStatus, copy_record, encode
from handlers.reconcile.agentcalls import AgentCalls
from handlers.reconcile.bookkeeping import ActionResult, CycleReport
from handlers.reconcile.planner.drift import (
    ADOPT_ACTIONS,
    ALIGN_STATUS,
    DELETE_ON_AGENT_ACTIONS,
    DELETE_ORPHAN,
    DELETE_RESIDUAL,
    DriftDeduper,
    DriftFinding,
)
from handlers.reconcile.planner.inputs import COMPARABLE_STATUSES, NodeView, node_of
from handlers.reconcile.planner.workload import (
    APPLY_STOPPED,
    COUNT_FAILURE,
    MARK_TERMINAL,
    REAPPLY,
    SETTLE,
)
from handlers.reconcile.shell import LoopShell, run_bounded
from handlers.specs.stored import request_of
from handlers.writes.cas import NotFound

log = logging.getLogger("persys.loops")

#: drift actions whose success (the workload deleted on the agent) clears the DriftRecord
CLEARED_WHEN_DONE = DELETE_ON_AGENT_ACTIONS | {DELETE_RESIDUAL}
#: drift records + events per transaction (2 ops each, well under etcd's 128)
DRIFT_BATCH = 40
#: actions whose own status write makes a separate state_mismatch alignment redundant
STATUS_WRITING = frozenset({SETTLE, REAPPLY, APPLY_STOPPED, COUNT_FAILURE, MARK_TERMINAL})


class DriftRemediation:
    """Carries out a cycle's drift findings and records the admitted ones."""

    def __init__(self, shell: LoopShell, agent_calls: AgentCalls) -> None:
        self.cluster = shell.cluster
        self.committer = shell.committer
        self.layout = shell.layout
        self.writer = shell.writer
        self.concurrency = shell.concurrency
        self.agent_calls = agent_calls
        #: one DriftDetected per finding per 2 min (docs/compatibility.md, "Drift detection")
        self.dedup = DriftDeduper()

    async def remediate(self, findings: list[DriftFinding],
                        results: Mapping[str, ActionResult],
                        views: Mapping[str, NodeView], report: CycleReport,
                        now: datetime) -> None:
        """Carry out each finding (or credit the reconcile action that already did), then
        record the admitted ones: DriftRecord + DriftDetected, batched, fenced."""
        outcomes: dict[tuple[str, str, str, str], tuple[bool, str, bool]] = {}

        async def one(f: DriftFinding) -> None:
            recorded = False
            error = ""
            try:
                if f.action in ADOPT_ACTIONS:
                    ok, recorded = await self._adopt(f, now)
                elif f.action in DELETE_ON_AGENT_ACTIONS or (
                        f.action == DELETE_RESIDUAL
                        and results.get(f.workload_id, ("", False, ""))[2] != f.node_id):
                    ok = await self.agent_calls.delete(f.workload_id, f.node_id, views, report,
                                                      finalize=False)
                elif f.action == ALIGN_STATUS:
                    ok = await self._align(f, results, now)
                else:
                    kind_ok = results.get(f.workload_id)
                    ok = kind_ok is not None and kind_ok[1]
                    if kind_ok is None:
                        error = "no remediation this cycle"
            except NotFound:
                ok = True
            except StoreError as exc:
                ok, error = False, str(exc)
            outcomes[f.key] = (ok, error, recorded)

        await run_bounded(findings, self.concurrency, one)
        pending: list[Change] = []
        for f in findings:
            ok, error, recorded = outcomes.get(f.key, (False, "not run", False))
            if recorded:
                continue
            admitted = self.dedup.admit(f.key, now)
            # a delete done on the agent clears the record even when its event is de-duplicated
            # (an earlier failed attempt may have written it)
            if admitted or (ok and f.action in CLEARED_WHEN_DONE):
                pending.append(self._drift_change(f, ok=ok, error=error, now=now,
                                                  event=admitted))
        for start in range(0, len(pending), DRIFT_BATCH):
            batch = Change(kind="drift")
            for change in pending[start:start + DRIFT_BATCH]:
                batch.merge(change)
            try:
                await self.committer.commit(batch, fenced=True)
            except StoreError as exc:
                log.warning("drift records not stored (%d): %s", len(batch.puts), exc)

    def _drift_change(self, f: DriftFinding, *, ok: bool, error: str, now: datetime,
                      event: bool = True) -> Change:
        """The DriftRecord and DriftDetected of a finding, with two exceptions that keep etcd
        bounded whatever an agent lists (docs/compatibility.md, "Drift adoption"): a delete
        done on the agent clears its record (as Go's verified orphan delete did), and an
        orphan whose id the scheduler does not know gets its event but no record (the id is
        the agent's word only)."""
        key = self.layout.drift(f.node_id, f.workload_id, f.drift_type)
        events = [Event(type="DriftDetected", workload_id=f.workload_id, node_id=f.node_id,
                        reason=f.drift_type, timestamp=now, details={
                            "scheduler_status": f.scheduler_status,
                            "agent_status": f.agent_status, "action": f.action,
                            "resolved": str(ok).lower(), "last_error": error})] if event else []
        if ok and f.action in CLEARED_WHEN_DONE:
            return Change(kind="drift", deletes=[Delete(key, category="drift")], events=events)
        if f.action == DELETE_ORPHAN:
            return Change(kind="drift", events=events)
        record = {
            "nodeId": f.node_id, "workloadId": f.workload_id, "driftType": f.drift_type,
            "detectedAt": rfc3339(now), "schedulerStatus": f.scheduler_status,
            "agentStatus": f.agent_status, "action": f.action, "resolved": ok,
            "lastError": error,
        }
        return Change(
            kind="drift",
            puts=[Put(key, json.dumps(record, separators=(",", ":")).encode(), category="drift")],
            events=events)

    async def _align(self, f: DriftFinding, results: Mapping[str, ActionResult],
                     now: datetime) -> bool:
        done = results.get(f.workload_id)
        if done is not None and done[0] in STATUS_WRITING:
            return done[1]
        state = f.agent_status
        stamp = rfc3339(now)

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_of(status) != f.node_id or status.status not in COMPARABLE_STATUSES:
                return None
            if status.status == state:
                return None
            status.status = state
            status.status_info.actual_state = state
            status.status_info.last_updated = stamp
            status.metadata["drift_reason"] = f.drift_type
            status.metadata["drift_reconciled_at"] = stamp
            return []

        await self.writer.update_status(f.workload_id, mutate, kind="drift", fenced=True)
        return True

    async def _adopt(self, f: DriftFinding, now: datetime) -> tuple[bool, bool]:
        """Re-bind a workload to the node that runs it (status, assignment, both allocations
        and, when admitted, the drift record + event: one transaction). Returns (ok, recorded).
        """
        wid, new = f.workload_id, f.node_id
        stamp = rfc3339(now)
        admitted = self.dedup.admit(f.key, now)

        async def attempt(n: int) -> tuple[bool, bool]:
            spec_item = self.cluster.specs.get(wid)
            status_item = self.cluster.statuses.get(wid)
            if spec_item is None or status_item is None:
                return False, False
            status = copy_record(status_item.value)
            old = node_of(status)
            if old != f.previous_node:
                return False, False  # someone moved it meanwhile
            status.node_id = new
            status.assigned_node = new
            if f.agent_status in COMPARABLE_STATUSES:
                status.status = f.agent_status
                status.status_info.actual_state = f.agent_status
            status.status_info.last_updated = stamp
            status.metadata["last_action"] = "DriftRemediatedOrphan"
            status.metadata["drift_reason"] = f.action
            status.metadata["drift_reconciled_at"] = stamp
            if old and old != new:
                status.metadata["previous_node"] = old
            change = Change(kind="drift", compares=[
                Compare.mod(self.layout.status(wid), status_item.mod_revision)], puts=[
                Put(self.layout.status(wid), encode(status), category="status"),
                Put(self.layout.assignment(wid), encode(Assignment(
                    workload_id=wid, node_id=new, reason=f.action, created_at=stamp)),
                    category="assignment")])
            cpu_m, mem_mb = request_of(spec_item.value)
            moves = [(new, True)] + ([(old, False)] if old and old != new else [])
            for node_id, add in moves:
                # the workload runs here: its allocation follows reality, without a fit check
                item = self.cluster.allocations.get(node_id)
                record = item.value.clone() if item else Allocation(node_id=node_id)
                record.node_id = node_id
                if add:
                    record.add(wid, cpu_m, mem_mb)
                elif not record.remove(wid):
                    continue
                change.compares.append(Compare.mod(self.layout.allocation(node_id),
                                                   item.mod_revision if item else 0))
                change.puts.append(Put(self.layout.allocation(node_id), encode(record),
                                       category="allocation"))
            if admitted:
                change.merge(self._drift_change(f, ok=True, error="", now=now))
            try:
                await self.committer.commit(change, fenced=True)
            except Conflict as exc:
                if exc.revision:
                    await self.cluster.wait_for(exc.revision,
                                                which=("statuses", "allocations", "specs"))
                raise
            log.warning("drift: workload adopted workload_id=%s from=%s to=%s action=%s", wid,
                        old or "-", new, f.action)
            return True, admitted

        return await retry_on_conflict(attempt)
