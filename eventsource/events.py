"""The event catalogue and the entry format of the ``scheduler:events`` stream.

An event is decided by the handler that commits the state change causing it and written in the
same etcd transaction, as an outbox record carrying its ``seq`` within that transaction. The relay
later appends it to Redis under the stream id ``"<revision>-<seq>"``, where ``revision`` is the
commit revision (the outbox key's ``mod_revision``). The stream entry has one field, ``data``:
the Go version's JSON (``id, type, workloadId, nodeId, reason, timestamp, details``) plus
``eventId``, ``revision``, ``seq``, ``ts`` (commit time in ms) and ``prev`` (previous stream id).
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

#: every event type, with the component that emits it (docs/events.md is generated from this)
CATALOGUE: Mapping[str, str] = {
    "NodeJoined": "RegisterNode (first registration or return of a removed node)",
    "NodeLost": "node monitor: liveness lease expired or agent unreachable",
    "NodeLeft": "node GC: NotReady longer than SCHEDULER_NODE_GC_AFTER",
    "WorkloadScheduled": "ApplyWorkload, reconcile applies",
    "WorkloadFailed": "retry budget exhausted, apply rejected",
    "WorkloadPending": "a workload that fits no node stored, or its kinds of refusal changed",
    "DriftDetected": "drift detection",
    "RetryTriggered": "RetryWorkload, failure retry schedule",
    "Rescheduled": "failover of a workload off an unavailable node",
    "WorkloadDeleted": "a deleted workload's state removed (the Go version said Rescheduled)",
    "Relocated": "DrainNode relocation",
    "RescheduleSkipped": "a node-local workload that cannot move",
    "NodeDraining": "DrainNode",
    "NodeReady": "UndrainNode",
    "NodeTainted": "TaintNode",
    "NodeUntainted": "UntaintNode",
    "NodeLabelSet": "SetNodeLabel",
    "NodeLabelDeleted": "DeleteNodeLabel",
    "NodeCapacityChanged": "RegisterNode of a live node that declares another capacity",
    "LeaderElected": "leadership gained",
    "LeaderLost": "leadership lost",
    "SchedulerModeChanged": "mode supervisor",
    "EventsGap": "relay or reader: events missing between two cursors",
}

EVENT_TYPES = frozenset(CATALOGUE)
#: the outbox record's field holding the committing span's W3C traceparent (not in the stream)
TRACEPARENT_FIELD = "traceparent"
#: The entry that marks events a reader may have missed; every watcher gets it, whatever its
#: filter.
GAP_TYPE = "EventsGap"


def rfc3339(moment: datetime) -> str:
    """RFC3339 with nanosecond-free UTC, as Go's time.Time JSON looks for UTC times."""
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def parse_rfc3339(text: str) -> datetime | None:
    if not text:
        return None
    value = text.strip()
    if value.endswith("Z"):
        value = value[:-1] + "+00:00"
    # Go writes up to 9 fractional digits; Python accepts at most 6
    if "." in value:
        head, _, rest = value.partition(".")
        digits = ""
        i = 0
        while i < len(rest) and rest[i].isdigit():
            digits += rest[i]
            i += 1
        value = f"{head}.{digits[:6]}{rest[i:]}" if digits else head + rest[i:]
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def new_event_id() -> str:
    """A random (version 4) UUID for an event.

    ``uuid.uuid4`` asks the OS for 16 bytes on every call; ids only have to be unique, and the
    Mersenne Twister (seeded from the OS at start, and again in a forked child) is several
    times cheaper on the hot path of every committed change.
    """
    return str(uuid.UUID(int=random.getrandbits(128), version=4))


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One domain event, before it has a revision."""

    type: str
    workload_id: str = ""
    node_id: str = ""
    reason: str = ""
    details: Mapping[str, str] = field(default_factory=dict)
    event_id: str = field(default_factory=lambda: new_event_id())
    timestamp: datetime = field(default_factory=lambda: datetime.now(UTC))
    #: the W3C ``traceparent`` of the span that committed it ("" untraced): the outbox record
    #: keeps it for the relay's span, the stream entry shows its trace id as
    #: ``details["trace_id"]`` (``eventsource.tracing``)
    traceparent: str = ""

    def __post_init__(self) -> None:
        if self.type not in EVENT_TYPES:
            raise ValueError(f"unknown event type {self.type!r}")

    def outbox_record(self, *, seq: int) -> bytes:
        """The outbox value: the entry without ``revision`` and ``prev`` (known later)."""
        body: dict[str, Any] = {
            "id": self.event_id,
            "type": self.type,
            "timestamp": rfc3339(self.timestamp),
            "eventId": self.event_id,
            "seq": seq,
            "ts": int(self.timestamp.timestamp() * 1000),
        }
        if self.workload_id:
            body["workloadId"] = self.workload_id
        if self.node_id:
            body["nodeId"] = self.node_id
        if self.reason:
            body["reason"] = self.reason
        details = {str(k): str(v) for k, v in self.details.items()} if self.details else {}
        if self.traceparent:
            body[TRACEPARENT_FIELD] = self.traceparent
            trace_id = self.traceparent.split("-")[1] if self.traceparent.count("-") == 3 else ""
            if trace_id:
                details.setdefault("trace_id", trace_id)
        if details:
            body["details"] = details
        return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamEntry:
    """One decoded stream entry (what ListEvents and WatchEvents serve)."""

    stream_id: str
    event_id: str
    type: str
    workload_id: str
    node_id: str
    reason: str
    timestamp: str
    details: Mapping[str, str]
    revision: int
    seq: int
    ts: int
    prev: str

    @classmethod
    def decode(cls, stream_id: str, data: str | bytes) -> StreamEntry:
        return cls.from_body(stream_id, json.loads(data))

    @classmethod
    def from_body(cls, stream_id: str, body: dict[str, Any]) -> StreamEntry:
        """The entry from its already parsed ``data`` (the tailer parses each entry once)."""
        details = body.get("details") or {}
        return cls(
            stream_id=stream_id,
            event_id=str(body.get("eventId") or body.get("id") or ""),
            type=str(body.get("type", "")),
            workload_id=str(body.get("workloadId", "")),
            node_id=str(body.get("nodeId", "")),
            reason=str(body.get("reason", "")),
            timestamp=str(body.get("timestamp", "")),
            details={str(k): v if isinstance(v, str) else json.dumps(v)
                     for k, v in details.items()},
            revision=int(body.get("revision", 0)),
            seq=int(body.get("seq", 0)),
            ts=int(body.get("ts", 0)),
            prev=str(body.get("prev", "")),
        )


def stream_id_for(revision: int, seq: int) -> str:
    return f"{revision}-{seq}"


def parse_stream_id(stream_id: str) -> tuple[int, int]:
    """``"12-3"`` -> (12, 3); a bare ``"12"`` -> (12, 0). Raises ValueError otherwise."""
    head, _, tail = stream_id.partition("-")
    return int(head), int(tail) if tail else 0


def entry_data(outbox_value: bytes, *, revision: int, prev: str) -> str:
    """The stream entry's ``data`` field from an outbox record and its commit revision (the
    record's ``traceparent`` is the relay's, not the entry's: the entry has the trace id)."""
    body = json.loads(outbox_value)
    body.pop(TRACEPARENT_FIELD, None)
    body["revision"] = revision
    body["prev"] = prev
    return json.dumps(body, separators=(",", ":"))
