"""Workloads that fit no node: stored ``Pending`` with why, and placed when capacity appears.

Why: a client that submits ahead of capacity (a node still booting, a drain in progress, a
burst) must not lose its workload. The Go scheduler stored such a workload and kept trying;
Nomad (blocked evaluations) and Kubernetes (pending pods) do the same. Here the apply stores
the spec and a status ``Pending`` (no node, no allocation) with the refusals counted by reason,
and the reconcile package's pending placer places it as soon as the projections show capacity.

The in-band answer stays a refusal (``success=false``, ``INSUFFICIENT_RESOURCES``), as in Go,
which also answered a failure and stored the workload: a Go client keeps reading "not placed",
and its text says it was stored: "stored as Pending, placed when capacity appears: no suitable
node: 0/20 nodes fit: ...". ``SCHEDULER_UNPLACEABLE=refuse`` stores nothing (the refusal of
old), and past ``SCHEDULER_PENDING_MAX`` pending workloads an apply is refused the same way.

A pending workload's reason is rewritten, with one ``WorkloadPending`` event, only when the
kinds of refusal change ("insufficient cpu" becoming "insufficient cpu, draining"), never per
attempt: the counts in the text are those of the last change.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from eventsource.events import Event, rfc3339
from eventsource.records import ReasonInfo, WorkloadStatus
from handlers.placement.refusals import refusal_kinds
from handlers.workloads.outcome import Outcome

PENDING = "Pending"
#: the reason code a pending workload shows (``GetWorkload``'s ``reason.code``)
UNSCHEDULABLE = "Unschedulable"
#: metadata: the refusal kinds the last WorkloadPending announced
PENDING_KINDS = "pending_refusals"
#: metadata: when the workload became pending (RFC 3339)
PENDING_SINCE = "pending_since"
STORED_PREFIX = "stored as Pending, placed when capacity appears: "


@dataclass(frozen=True, slots=True)
class PendingPolicy:
    """``SCHEDULER_UNPLACEABLE`` and ``SCHEDULER_PENDING_MAX``."""

    store: bool = True
    max_pending: int = 10_000

    def refusal(self, pending_now: int) -> str:
        """Why an unplaceable apply is not stored; "" when it may be."""
        if not self.store:
            return "SCHEDULER_UNPLACEABLE=refuse"
        if pending_now >= self.max_pending:
            return f"{pending_now} workloads pending already (SCHEDULER_PENDING_MAX)"
        return ""


def pending_answer(reason: str) -> Outcome:
    """The answer of an apply that stored its workload as pending."""
    return Outcome(False, "INSUFFICIENT_RESOURCES", STORED_PREFIX + reason, unplaced=True)


def is_pending(status: WorkloadStatus) -> bool:
    """Found to fit nowhere, and still on no node: what the pending placer keeps."""
    reason = status.status_info.reason
    return (status.status == PENDING and not (status.node_id or status.assigned_node)
            and reason is not None and reason.code == UNSCHEDULABLE)


def mark_pending(status: WorkloadStatus, workload_id: str, reason: str,
                 now: datetime) -> Event | None:
    """Make ``status`` pending for ``reason``; the ``WorkloadPending`` event to commit with it
    when this is news (it just became pending, or its kinds of refusal changed), else None
    (and then ``status`` is left as it was: nothing worth a write)."""
    kinds = refusal_kinds(reason)
    if is_pending(status) and status.metadata.get(PENDING_KINDS) == kinds:
        return None
    stamp = rfc3339(now)
    status.status = PENDING
    status.node_id = ""
    status.assigned_node = ""
    status.status_info.actual_state = PENDING
    status.status_info.last_updated = stamp
    status.status_info.failure_reason = reason
    status.status_info.reason = ReasonInfo(code=UNSCHEDULABLE, message=reason,
                                           last_transition=stamp, retryable=True)
    status.metadata.setdefault(PENDING_SINCE, stamp)
    status.metadata[PENDING_KINDS] = kinds
    status.metadata["last_action"] = "Pending"
    return Event(type="WorkloadPending", workload_id=workload_id, reason=reason,
                 details={"refusals": kinds}, timestamp=now)


def clear_pending(status: WorkloadStatus) -> None:
    """Placed: drop what only a pending workload carries."""
    for key in (PENDING_KINDS, PENDING_SINCE):
        status.metadata.pop(key, None)
    reason = status.status_info.reason
    if reason is not None and reason.code == UNSCHEDULABLE:
        status.status_info.reason = None
        status.status_info.failure_reason = ""
