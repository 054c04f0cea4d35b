"""Records -> protobuf views. The only module that knows both shapes of a node or workload."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from eventsource.events import StreamEntry, parse_rfc3339
from eventsource.records import Allocation, Node, WorkloadSpec, WorkloadStatus
from proto.persys.control.v1 import control_pb2

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def set_time(target: Timestamp, value: str | datetime | None) -> None:
    """``target.FromDatetime`` in integer arithmetic (several per view, on every event sent).

    A naive datetime is taken as UTC, as ``FromDatetime`` takes it.
    """
    moment = parse_rfc3339(value) if isinstance(value, str) else value
    if moment is None:
        return
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    delta = moment - _EPOCH
    target.seconds = delta.days * 86_400 + delta.seconds
    target.nanos = delta.microseconds * 1_000


def node_view(node: Node, allocation: Allocation | None, *, alive: bool,
              last_heartbeat: datetime | None = None,
              used: tuple[int, int] | None = None) -> control_pb2.NodeView:
    """``last_heartbeat``: the newest heartbeat known outside the record (handlers.nodes.usage); the
    view shows it or the record's ``lastHeartbeat``, whichever is newer."""
    view = control_pb2.NodeView(
        node_id=node.node_id,
        status=node.status if alive or node.status != "Ready" else "Ready",
        status_reason=node.status_reason,
        status_updated_by=node.status_updated_by,
        grpc_endpoint=node.endpoint,
        total_cpu_cores=node.total_cpu,
        total_memory_mb=node.total_memory,
        supported_workload_types=list(node.supported_workload_types),
        labels=dict(node.labels),
    )
    allocated_cpu = allocation.cpu_millicores / 1000.0 if allocation else 0.0
    allocated_mem = allocation.memory_mb if allocation else 0
    view.allocated_cpu_cores = allocated_cpu
    view.allocated_memory_mb = allocated_mem
    view.allocatable_cpu_cores = max(0.0, node.total_cpu - allocated_cpu)
    view.allocatable_memory_mb = max(0, node.total_memory - allocated_mem)
    # the Go fields keep the Go meaning: total minus what the agent reported in use
    # (docs/compatibility.md, "Available CPU and memory")
    if used is not None:
        view.usage_reported = True
        view.used_cpu_cores = used[0] / 1000.0
        view.used_memory_mb = used[1]
        view.available_cpu_cores = max(0.0, node.total_cpu - used[0] / 1000.0)
        view.available_memory_mb = max(0, node.total_memory - used[1])
    else:
        view.available_cpu_cores = node.total_cpu
        view.available_memory_mb = node.total_memory
    set_time(view.status_updated_at, node.status_updated_at)
    recorded = parse_rfc3339(node.last_heartbeat)
    if last_heartbeat is None or (recorded is not None and recorded > last_heartbeat):
        set_time(view.last_heartbeat, recorded)
    else:
        set_time(view.last_heartbeat, last_heartbeat)
    for t in node.taints:
        view.taints.append(control_pb2.NodeTaint(key=t.key, value=t.value, effect=t.effect))
    return view


def _failure_text(status: WorkloadStatus) -> str:
    parts: list[str] = []
    for value in (
        status.status_info.failure_reason,
        status.metadata.get("last_error"),
        status.metadata.get("container.stderr") or status.metadata.get("last_runtime_error")
        or status.metadata.get("container.runtime_error"),
    ):
        text = str(value or "").strip()
        if text and text not in parts:
            parts.append(text)
    return "\n".join(parts)


def workload_view(spec: WorkloadSpec, status: WorkloadStatus | None,
                  usage: dict[str, Any] | None = None) -> control_pb2.WorkloadView:
    st = status or WorkloadStatus(id=spec.id)
    shown = st.status or "Unknown"
    ip = st.metadata.get("vm.primary_ip") if spec.type in ("vm", "microvm") else None
    if ip:
        shown = f"{shown} (ip={ip})"
    view = control_pb2.WorkloadView(
        workload_id=spec.id,
        type=spec.type,
        desired_state=spec.desired_state,
        status=shown,
        assigned_node_id=st.node_id or st.assigned_node,
        revision_id=spec.revision_id,
        retry_attempts=st.retry.attempts,
        retry_max_attempts=st.retry.max_attempts,
        failure_reason=_failure_text(st),
    )
    set_time(view.retry_next_at, st.retry.next_retry_at)
    set_time(view.last_updated, st.status_info.last_updated)
    set_time(view.created_at, spec.created_at or str(st.metadata.get("created_at", "")))
    reason = st.status_info.reason
    if reason is not None:
        view.reason.code = reason.code
        view.reason.message = reason.message
        view.reason.retryable = reason.retryable
        set_time(view.reason.last_transition, reason.last_transition)
        set_time(view.reason.next_retry_at, reason.next_retry_at)
    u = usage or st.usage
    if u:
        view.usage.workload_id = str(u.get("workloadId", spec.id))
        view.usage.type = str(u.get("type", ""))
        view.usage.cpu_percent = float(u.get("cpuPercent", 0.0))
        view.usage.memory_bytes = int(u.get("memoryBytes", 0))
        view.usage.disk_read_bytes = int(u.get("diskReadBytes", 0))
        view.usage.disk_write_bytes = int(u.get("diskWriteBytes", 0))
        view.usage.net_rx_bytes = int(u.get("netRxBytes", 0))
        view.usage.net_tx_bytes = int(u.get("netTxBytes", 0))
        view.usage.source = str(u.get("source", ""))
        set_time(view.usage.collected_at, str(u.get("collectedAt", "")))
    return view


def event_view(entry: StreamEntry) -> control_pb2.SchedulerEventView:
    view = control_pb2.SchedulerEventView(
        id=entry.stream_id, type=entry.type, workload_id=entry.workload_id,
        node_id=entry.node_id, reason=entry.reason, details=dict(entry.details),
    )
    if entry.event_id:
        view.details["event_id"] = entry.event_id
    set_time(view.timestamp, entry.timestamp)
    return view


def disk_view(record: dict[str, Any]) -> control_pb2.DiskView:
    view = control_pb2.DiskView(
        id=str(record.get("id", "")), name=str(record.get("name", "")),
        driver=str(record.get("driver", "")), size_gb=int(record.get("sizeGb", 0) or 0),
        fs_type=str(record.get("fsType", "")), access_mode=str(record.get("accessMode", "")),
        retain_policy=str(record.get("retainPolicy", "")), phase=str(record.get("phase", "")),
        last_error=str(record.get("lastError", "")), node_id=str(record.get("nodeId", "")),
        device=str(record.get("device", "")), standalone=bool(record.get("standalone", False)),
        mount_path=str(record.get("mountPath", "")),
        workload_refs=[str(r) for r in record.get("workloadRefs") or []],
        attached_nodes=[str(n) for n in record.get("attachedNodes") or []],
    )
    set_time(view.created_at, str(record.get("createdAt", "")))
    set_time(view.updated_at, str(record.get("updatedAt", "")))
    return view
