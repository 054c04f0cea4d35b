"""What an agent's heartbeat reports about its workloads, as the status records store it:
the state name, the bounded message and reason, and the usage snapshot.

Pure translation and comparison (protobuf message -> record field, stored vs reported),
apart from the heartbeat's writes so each bound and each "is this news" rule reads on its
own: a status record is rewritten (and watched by every replica) only when a report is news,
and an agent's text must never outgrow the record.
"""

from __future__ import annotations

import math
from datetime import UTC, timedelta
from typing import Any

from eventsource.events import parse_rfc3339, rfc3339
from eventsource.records import ReasonInfo, WorkloadStatus
from proto.persys.control.v1 import control_pb2

#: bound on the status record's log tail (the Go version grew it forever: docs/compatibility.md,
#: "Status log growth")
LOG_TAIL_BYTES = 4096
#: an agent's status message is kept to this many characters: the status record is rewritten
#: (and watched by every replica) whenever a message is new, and a record has a size limit
MESSAGE_MAX_CHARS = 1024
#: a usage snapshot's free-text fields (its type and source): one agent must not be able to
#: grow the usage keys and the meter stream without bound
USAGE_TEXT_MAX_CHARS = 64
#: a ReasonDetail's code (the Go agent's metadata ``failure_reason``, e.g. "ImagePullFailed")
REASON_CODE_MAX_CHARS = 128
#: a message already among the last this many characters of the log tail is not new
RECENT_LOG_CHARS = 512


def agent_message(ws: control_pb2.WorkloadStatus) -> str:
    """The agent's message as recorded: bounded, so that a long one is recognised as already
    recorded (a crash loop repeats it every heartbeat) and never outgrows the record."""
    message = ws.message
    return message if len(message) <= MESSAGE_MAX_CHARS else message[:MESSAGE_MAX_CHARS] + "…"


def already_logged(logs: str, message: str) -> bool:
    return message in logs[-(RECENT_LOG_CHARS + len(message)):]


def agent_reason(ws: control_pb2.WorkloadStatus) -> ReasonInfo | None:
    """The agent's ReasonDetail as ``statusInfo.reason`` stores it (times RFC3339, text
    bounded); None when the status carries none. An all-empty detail is returned as such: it
    says the workload has no reason now."""
    if not ws.HasField("reason"):
        return None
    r = ws.reason
    message = r.message if len(r.message) <= MESSAGE_MAX_CHARS else (
        r.message[:MESSAGE_MAX_CHARS] + "…")
    return ReasonInfo(
        code=r.code[:REASON_CODE_MAX_CHARS], message=message, retryable=r.retryable,
        last_transition=_time_text(r, "last_transition"),
        next_retry_at=_time_text(r, "next_retry_at"))


def is_empty_reason(reason: ReasonInfo) -> bool:
    return not (reason.code or reason.message or reason.retryable or reason.next_retry_at)


def same_reason(stored: ReasonInfo | None, reported: ReasonInfo) -> bool:
    """Whether ``reported`` says what ``stored`` says. ``last_transition`` is left out: the Go
    agent stamps it from the workload's update time (or now, when it has none), so it can move
    on every heartbeat while the reason stays the same; the stored one says when it began."""
    if stored is None or is_empty_reason(stored):
        return is_empty_reason(reported)
    return (stored.code, stored.message, stored.retryable, stored.next_retry_at) == (
        reported.code, reported.message, reported.retryable, reported.next_retry_at)


def map_agent_state(state: str) -> str:
    s = state.strip().lower()
    return {"running": "Running", "stopped": "Stopped", "failed": "Failed", "pending": "Pending"
            }.get(s, "Unknown")


def older_than_apply(ws: control_pb2.WorkloadStatus, status: WorkloadStatus) -> bool:
    """Whether the agent's state changed last before the scheduler asked for the apply now in
    flight (a heartbeat built while the old revision ran, delivered after an update)."""
    requested = parse_rfc3339(str(status.metadata.get("lastApplyRequestAt", "")))
    if requested is None or not ws.HasField("last_transition"):
        return False
    try:
        # a second of slack: agents may stamp whole seconds, and clocks differ a little
        return ws.last_transition.ToDatetime(tzinfo=UTC) < requested - timedelta(seconds=1)
    except (ValueError, OverflowError, OSError):
        return False


def usage_dict(u: control_pb2.WorkloadUsageSnapshot) -> dict[str, Any]:
    return {
        # JSON has no NaN or infinity, and Go's decoder refuses them
        "workloadId": u.workload_id, "type": u.type[:USAGE_TEXT_MAX_CHARS],
        "cpuPercent": u.cpu_percent if math.isfinite(u.cpu_percent) else 0.0,
        "memoryBytes": u.memory_bytes, "diskReadBytes": u.disk_read_bytes,
        "diskWriteBytes": u.disk_write_bytes, "netRxBytes": u.net_rx_bytes,
        "netTxBytes": u.net_tx_bytes,
        "collectedAt": _collected_at(u),
        "source": u.source[:USAGE_TEXT_MAX_CHARS],
    }


def _collected_at(u: control_pb2.WorkloadUsageSnapshot) -> str:
    """The snapshot's time, or "" when absent or not a time (a bad clock on one agent must not
    fail its whole heartbeat)."""
    return _time_text(u, "collected_at")


def _time_text(message: Any, field_name: str) -> str:
    """A Timestamp field of ``message`` as RFC3339, or "" when absent or not a time."""
    if not message.HasField(field_name):
        return ""
    try:
        return rfc3339(getattr(message, field_name).ToDatetime(tzinfo=UTC))
    except (ValueError, OverflowError, OSError):
        return ""
