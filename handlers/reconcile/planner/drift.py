"""Drift classification: what an agent holds that the scheduler does not expect.

Why apart: drift compares whole listings with the assignments (orphans, duplicates, owners
rotated or gone, missing workloads), a different question from the per-workload decision, and
it runs only on the cycles asked for it. ``classify_drift`` returns findings as data; the
reconcile loop's remediation (``handlers.reconcile.remediation``) carries them out, and
``DriftDeduper`` bounds how often each finding is reported. No I/O, no clock. Go's types and
actions: docs/compatibility.md, "Drift detection"; what is ours: "Drift adoption".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from eventsource.records import WorkloadSpec, WorkloadStatus
from handlers.reconcile.planner.inputs import (
    COMPARABLE_STATUSES,
    DELETED,
    FAILED,
    MISSING,
    RUNNING,
    STOPPED,
    NodeObservation,
    NodeView,
    ObservedWorkload,
    node_of,
)
from handlers.reconcile.planner.workload import dispatched_at
from handlers.specs.fields import InvalidSpec, validate_id
from handlers.specs.stored import being_deleted, normalize_desired_state
from handlers.workloads.retry import ReapplyState, RetryPolicy, reapply_guard

ORPHAN = "orphan_on_agent"
STATE_MISMATCH = "state_mismatch"
REVISION_MISMATCH = "revision_mismatch"
MISSING_ON_AGENT = "missing_on_agent"

DELETE_ORPHAN = "delete_orphan_on_agent"
DELETE_RESIDUAL = "delete_deleted_residual_on_agent"
DELETE_DUPLICATE = "delete_duplicate_on_reporting_node"
ADOPT = "adopt_orphan_to_reporting_node"
REASSIGN_MISSING_OWNER = "reassign_from_missing_owner"
REBIND_ROTATED = "rebind_assignment_to_rotated_node_id"
FAILOVER_REASSIGN = "failover_reassign_to_reporting_node"
REASSIGN = "reassign_to_reporting_node"
INVESTIGATE = "operator_investigation"
AWAIT_OWNER_APPLY = "await_owner_apply"
ALIGN_STATUS = "align_scheduler_status"
REAPPLY_REVISION = "reapply_scheduler_revision"
RETRY_AND_RECONCILE = "retry_and_reconcile"

ADOPT_ACTIONS = frozenset({ADOPT, REASSIGN_MISSING_OWNER, REBIND_ROTATED, FAILOVER_REASSIGN,
                           REASSIGN})
DELETE_ON_AGENT_ACTIONS = frozenset({DELETE_ORPHAN, DELETE_DUPLICATE})
#: orphans classified per node and pass: an agent's listing is its own word, and a listing of
#: thousands of made-up ids must not become thousands of records, events and deletes at once
#: (the rest are found by the next passes, as these are deleted)
MAX_ORPHANS_PER_NODE = 100


@dataclass(frozen=True, slots=True)
class DriftFinding:
    """One difference between what the scheduler expects on a node and what its agent holds."""

    node_id: str
    workload_id: str
    drift_type: str
    action: str
    scheduler_status: str = ""
    agent_status: str = ""
    #: for adoptions: the node the workload was assigned to
    previous_node: str = ""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.node_id, self.workload_id, self.drift_type, self.action)


def _in_flight(spec: WorkloadSpec | None, status: WorkloadStatus, now: datetime,
               policy: RetryPolicy) -> bool:
    """An apply was sent recently enough that the agent's list may not show it yet.

    See docs/compatibility.md, "In-flight applies"."""
    verdict = reapply_guard(ReapplyState.read(status.metadata),
                            revision_id=spec.revision_id if spec else "",
                            workload_type=spec.type if spec else "", now=now, policy=policy,
                            dispatched_at=dispatched_at(status))
    return verdict.active


def classify_drift(
    specs: Mapping[str, WorkloadSpec],
    statuses: Mapping[str, WorkloadStatus],
    *,
    expected: Mapping[str, Collection[str]],
    nodes: Mapping[str, NodeView],
    observations: Mapping[str, NodeObservation],
    now: datetime,
    policy: RetryPolicy,
) -> list[DriftFinding]:
    """Compare every successfully listed node with what is assigned to it.

    ``expected`` maps node id -> workload ids assigned to it. Only nodes in ``observations``
    with ``ok`` are compared; owners that were not listed count as "unknown" (never "missing").
    Adoptions are decided first, so ``missing_on_agent`` skips a workload re-bound this cycle,
    and a workload reported by several non-owners is adopted by one (the lowest node id) and
    deleted as a duplicate from the others. Ids that are not valid workload ids are ignored,
    and at most ``MAX_ORPHANS_PER_NODE`` orphans are classified per node.
    """
    findings: list[DriftFinding] = []
    adopted: set[str] = set()
    listed = sorted(n for n, o in observations.items() if o.ok)
    for node_id in listed:
        obs = observations[node_id]
        mine = expected.get(node_id, ())
        here = nodes.get(node_id)
        orphans = 0
        for wid in sorted(obs.workloads):
            seen = obs.workloads[wid]
            status = statuses.get(wid)
            spec = specs.get(wid)
            if wid in mine and status is not None and spec is not None:
                findings.extend(_expected_drift(node_id, spec, status, seen, now, policy))
                continue
            if orphans >= MAX_ORPHANS_PER_NODE or not _valid_id(wid):
                continue
            orphans += 1
            findings.append(_orphan(node_id, here, wid, spec, status, seen, nodes,
                                    observations, adopted, now, policy))
    for node_id in listed:
        obs = observations[node_id]
        for wid in sorted(expected.get(node_id, ())):
            if wid in obs.workloads or wid in adopted:
                continue
            spec = specs.get(wid)
            status = statuses.get(wid)
            if spec is None or status is None or node_of(status) != node_id:
                continue
            if being_deleted(spec, status):
                continue
            if _in_flight(spec, status, now, policy):
                continue
            findings.append(DriftFinding(node_id, wid, MISSING_ON_AGENT, RETRY_AND_RECONCILE,
                                         status.status, MISSING))
    return findings


def _expected_drift(node_id: str, spec: WorkloadSpec, status: WorkloadStatus,
                    seen: ObservedWorkload, now: datetime,
                    policy: RetryPolicy) -> list[DriftFinding]:
    wid = spec.id or status.id
    if normalize_desired_state(spec.desired_state) == DELETED:
        return [DriftFinding(node_id, wid, ORPHAN, DELETE_RESIDUAL, status.status, seen.state)]
    out: list[DriftFinding] = []
    if (seen.revision_id and spec.revision_id and seen.revision_id != spec.revision_id
            and not _in_flight(spec, status, now, policy)):
        out.append(DriftFinding(node_id, wid, REVISION_MISMATCH, REAPPLY_REVISION,
                                status.status, seen.state))
    settled = seen.state in (RUNNING, STOPPED, FAILED)
    if (settled and status.status in COMPARABLE_STATUSES and status.status != seen.state
            and not (seen.revision_id and spec.revision_id
                     and seen.revision_id != spec.revision_id)):
        out.append(DriftFinding(node_id, wid, STATE_MISMATCH, ALIGN_STATUS, status.status,
                                seen.state))
    return out


def _orphan(node_id: str, here: NodeView | None, wid: str, spec: WorkloadSpec | None,
            status: WorkloadStatus | None, seen: ObservedWorkload,
            nodes: Mapping[str, NodeView], observations: Mapping[str, NodeObservation],
            adopted: set[str], now: datetime, policy: RetryPolicy) -> DriftFinding:
    """Classify a workload an agent holds but the scheduler assigned elsewhere (or nowhere).

    The reporting agent's word alone never moves a workload to its node: an adoption that
    changes the owner needs the agent to report the spec's revision, which it can know only
    from an apply of that very spec. Otherwise one node's agent could list another node's
    workload id while that node restarts and be sent the spec, secrets included; such a
    finding is left to the operator (``operator_investigation``) and to the normal failover.
    """

    def finding(action: str, previous: str = "") -> DriftFinding:
        if action in ADOPT_ACTIONS and previous != node_id and not _vouched(spec, seen):
            action = INVESTIGATE
        if action in ADOPT_ACTIONS:
            if wid in adopted:
                action = DELETE_DUPLICATE
            else:
                adopted.add(wid)
        return DriftFinding(node_id, wid, ORPHAN, action,
                            status.status if status is not None else "", seen.state, previous)

    if spec is None or status is None:
        return finding(DELETE_ORPHAN)
    if being_deleted(spec, status):
        return finding(DELETE_RESIDUAL)
    owner = node_of(status)
    if not owner or owner == node_id:
        return finding(ADOPT, owner)
    owner_view = nodes.get(owner)
    if owner_view is None or not owner_view.exists:
        return finding(REASSIGN_MISSING_OWNER, owner)
    if here is not None and _real(here.endpoint) and owner_view.endpoint == here.endpoint:
        return finding(REBIND_ROTATED, owner)
    owner_obs = observations.get(owner)
    if owner_obs is not None and owner_obs.ok:
        if wid in owner_obs.workloads:
            return finding(DELETE_DUPLICATE, owner)
        if _in_flight(spec, status, now, policy):
            return finding(AWAIT_OWNER_APPLY, owner)
        return finding(REASSIGN, owner)
    if not owner_view.available or (owner_obs is not None and owner_obs.unreachable):
        return finding(FAILOVER_REASSIGN, owner)
    return finding(INVESTIGATE, owner)


def _vouched(spec: WorkloadSpec | None, seen: ObservedWorkload) -> bool:
    """The agent reports the revision the scheduler holds for this workload."""
    return spec is not None and bool(spec.revision_id) and seen.revision_id == spec.revision_id


def _valid_id(workload_id: str) -> bool:
    try:
        return validate_id("workload_id", workload_id) == workload_id
    except InvalidSpec:
        return False


def _real(endpoint: str) -> bool:
    """An endpoint with a host (a record without address fields renders as ``:0``)."""
    host, _, port = endpoint.rpartition(":")
    return bool(host) and port not in ("", "0")


class DriftDeduper:
    """Admits one DriftDetected per (node, workload, type, action) per window.

    The window is Go's 2 minutes (docs/compatibility.md, "Drift detection"). Bounded: above
    ``max_entries`` the entries older than the window are pruned, and if that is not enough the
    oldest are dropped (a dropped key may be reported again: harmless).
    """

    def __init__(self, *, window_s: float = 120.0, max_entries: int = 4096) -> None:
        self.window = timedelta(seconds=window_s)
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, str, str, str], datetime] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, key: tuple[str, str, str, str], now: datetime) -> bool:
        last = self._seen.get(key)
        if last is not None and now - last < self.window:
            return False
        self._seen[key] = now
        self._seen.move_to_end(key)
        if len(self._seen) > self.max_entries:
            self._prune(now)
        return True

    def _prune(self, now: datetime) -> None:
        for key in [k for k, t in self._seen.items() if now - t >= self.window]:
            del self._seen[key]
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
