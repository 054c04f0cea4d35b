"""Outbox records as the relay reads them: one etcd outbox key, its stream id and its order.

Why apart: pure decoding shared by the pump (listing and watch), the take-over and the pruning;
a key whose value does not decode is poison: it can never be relayed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eventsource.events import TRACEPARENT_FIELD

if TYPE_CHECKING:
    from eventsource.etcd import KeyValue

#: a stream id as a sortable ``(revision, seq)`` tuple
IdKey = tuple[int, int]


@dataclass(frozen=True, slots=True)
class OutboxRecord:
    """One outbox key: an event committed at ``revision`` as the ``seq``-th of its txn."""

    key: str
    revision: int
    seq: int
    value: bytes
    #: the event's timestamp in epoch milliseconds (its decision), 0 if it has none
    ts_ms: int = 0
    #: the W3C traceparent of the span that committed it ("" untraced), and its type (known
    #: only when traced: the relay's span names it)
    traceparent: str = ""
    event_type: str = ""

    @property
    def order(self) -> IdKey:
        return (self.revision, self.seq)

    @property
    def stream_id(self) -> str:
        return f"{self.revision}-{self.seq}"


def parse_record(kv: KeyValue) -> OutboxRecord | None:
    """The record of an outbox key, or None if its value is not an outbox record."""
    try:
        body = json.loads(kv.value)
        seq = int(body["seq"])
        event_id = body["eventId"]
    except (ValueError, TypeError, KeyError):
        return None
    if seq < 0 or not isinstance(event_id, str) or not event_id or kv.mod_revision <= 0:
        return None
    ts = body.get("ts")
    traceparent = body.get(TRACEPARENT_FIELD)
    if not isinstance(traceparent, str) or not traceparent:
        return OutboxRecord(key=kv.key, revision=kv.mod_revision, seq=seq, value=kv.value,
                            ts_ms=ts if isinstance(ts, int) and ts > 0 else 0)
    return OutboxRecord(key=kv.key, revision=kv.mod_revision, seq=seq, value=kv.value,
                        ts_ms=ts if isinstance(ts, int) and ts > 0 else 0,
                        traceparent=traceparent, event_type=str(body.get("type", "")))


def parse_all(kvs: Sequence[KeyValue]) -> tuple[list[OutboxRecord], list[str]]:
    """The records of ``kvs`` (in their order), and the keys that are poison."""
    records: list[OutboxRecord] = []
    poison: list[str] = []
    for kv in kvs:
        record = parse_record(kv)
        if record is None:
            poison.append(kv.key)
        else:
            records.append(record)
    return records, poison
