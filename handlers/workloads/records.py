"""What the workload commands, the relocator and the reconcile loop write into a workload's
records alike: the apply stamp, the keys a fresh start clears, the stored-size bound and the
release of a node's allocation.

Apart because each of those writers builds its own transaction but must stamp, clear, bound
and release the same way.
"""

from __future__ import annotations

from eventsource.commit import Change
from eventsource.etcd import Compare, Put
from eventsource.keys import KeyLayout
from eventsource.records import WorkloadSpec, WorkloadStatus, encode
from handlers.workloads.metadata import METADATA_MAX_KEYS
from handlers.workloads.outcome import Outcome
from handlers.workloads.retry import LAST_APPLY_AT, LAST_APPLY_REVISION
from projections.cluster import ClusterProjection

#: what marks a workload failed for good (``reconcile.halted`` reads the first and
#: ``failure_reason``, the agent's answer merged into the status): a retry or a new spec clears
#: them, or the workload would be marked Failed again while it runs
TERMINAL_KEYS = ("retry_terminal", "retry_terminal_reason", "terminal_failure_reason",
                 "failure_reason", "failureObservedAt", "failureGraceUntil")

#: what one workload's spec and status may take once stored (JSON, which escapes control
#: characters sixfold): etcd refuses a request over 1.5 MiB, and the transaction carries the
#: workload's events and its node's allocation too
RECORD_MAX_BYTES = 1024 * 1024


def mark_apply_requested(status: WorkloadStatus, spec: WorkloadSpec, now: str) -> None:
    """Record, in the transaction that commits a placement or change, the apply that follows.

    The re-apply guard of the reconcile loop measures from this time, and the dispatcher's
    successful apply then costs no extra write.
    """
    status.metadata[LAST_APPLY_AT] = now
    status.metadata[LAST_APPLY_REVISION] = spec.revision_id


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
