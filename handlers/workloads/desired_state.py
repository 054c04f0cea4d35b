"""A desired-state change (stop, start): ApplyWorkload naming an existing workload with a
desired state and no spec.

Apart because it changes nothing but the desired state and the re-apply stamps: the spec's
revision, resources and disks stay, and the change commits (and is applied) as any update
does. A change to Deleted is a delete (``delete.DeleteCommand``); one to the current desired
state is answered without a write.
"""

from __future__ import annotations

from datetime import datetime

from eventsource.events import Event
from eventsource.records import WorkloadSpec, WorkloadStatus
from handlers.workloads.retry import REAPPLY_KEYS


def set_desired_state(spec: WorkloadSpec, status: WorkloadStatus, desired_state: str,
                      timestamp: datetime) -> Event:
    """Set ``desired_state`` on the (copied) spec, clear the status's re-apply stamps (the
    agent is asked anew), and return the event that records the change."""
    spec.desired_state = desired_state
    for key in REAPPLY_KEYS:
        status.metadata.pop(key, None)
    status.metadata["last_action"] = "DesiredStateUpdated"
    return Event(type="WorkloadScheduled", workload_id=spec.id, node_id=status.node_id,
                 reason="Desired state updated", details={"desired_state": spec.desired_state},
                 timestamp=timestamp)
