"""The node monitor's decision: which nodes are lost, which are removed.

Why apart: the monitor's shell (``handlers.reconcile.monitor``) reads the projections and
writes; which Ready nodes turn NotReady and which long-NotReady nodes are collected is decided
here from the checks and ``now`` alone, without I/O or clock reads. The rules:
docs/compatibility.md, "Node lifecycle", "Liveness leases" and "Node events".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from eventsource.events import parse_rfc3339
from handlers.reconcile.planner.inputs import MONITORED_NODE_STATUSES


@dataclass(frozen=True, slots=True)
class NodeCheck:
    """The inputs of the node monitor for one node."""

    node_id: str
    status: str
    #: the liveness key is absent *and* the alive projection has caught up with the node record
    lease_gone: bool
    status_updated_at: str = ""


@dataclass(frozen=True, slots=True)
class MonitorPlan:
    lost: tuple[str, ...]
    collect: tuple[str, ...]


def plan_node_monitor(checks: Iterable[NodeCheck], *, now: datetime,
                      gc_after_s: float) -> MonitorPlan:
    """Ready nodes whose liveness lease expired become NotReady; NotReady nodes older than
    ``gc_after_s`` (measured from ``statusUpdatedAt``; 0 disables) are removed."""
    lost: list[str] = []
    collect: list[str] = []
    for check in checks:
        status = check.status.lower()
        if status in MONITORED_NODE_STATUSES and check.lease_gone:
            lost.append(check.node_id)
        elif status == "notready" and gc_after_s > 0 and check.lease_gone:
            since = parse_rfc3339(check.status_updated_at)
            if since is not None and now - since >= timedelta(seconds=gc_after_s):
                collect.append(check.node_id)
    return MonitorPlan(tuple(sorted(lost)), tuple(sorted(collect)))
