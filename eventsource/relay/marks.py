"""The relay's record in etcd: its high-water mark, and the gaps it owes the stream.

Why apart: pure values that outlive a relay (the mark key's JSON survives a crash or a
failover). The take-over derives the gaps of lost data, the pruning adds the gaps of an
overflow, and the plan writes owed gaps at revision boundaries.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eventsource.relay.outbox import IdKey, OutboxRecord
from eventsource.stream.entries import ZERO_ID, format_id, next_id

if TYPE_CHECKING:
    from eventsource.etcd import KeyValue

#: fixed namespace of the deterministic ids of "Redis lost data" gaps
_GAP_NAMESPACE = uuid.UUID("8d6f0c1e-2a47-4c59-9b3e-5f1e7a0c2d31")

CAUSE_LOST = "redis-lost-entries"
CAUSE_OVERFLOW = "outbox-overflow"
CAUSE_MOVED = "stream-moved-aside"


@dataclass(frozen=True, slots=True)
class PendingGap:
    """An ``EventsGap`` the relay owes the stream (written before the next real event)."""

    event_id: str
    #: first stream id that may be missing (inclusive)
    first: str
    #: last stream id that may be missing (inclusive)
    last: str
    #: exact number of events dropped, when known
    dropped: int | None
    cause: str

    def details(self) -> dict[str, str]:
        out = {"from": self.first, "to": self.last}
        if self.dropped is not None:
            out["dropped"] = str(self.dropped)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "eventId": self.event_id,
            "from": self.first,
            "to": self.last,
            "dropped": self.dropped,
            "cause": self.cause,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> PendingGap:
        dropped = raw.get("dropped")
        return cls(
            event_id=str(raw["eventId"]),
            first=str(raw.get("from", ZERO_ID)),
            last=str(raw.get("to", ZERO_ID)),
            dropped=int(dropped) if dropped is not None else None,
            cause=str(raw.get("cause", "")),
        )


def lost_gap(top: IdKey, mark: IdKey, *, stream_key: str, cause: str = CAUSE_LOST) -> PendingGap:
    """The gap for entries in ``(top, mark]`` that the stream no longer holds.

    Its event id is derived from the gap itself, so two relays (or two attempts) that see the
    same loss write the same event, which keeps the append idempotent.
    """
    first = next_id(format_id(top))
    last = format_id(mark)
    event_id = str(uuid.uuid5(_GAP_NAMESPACE, f"{stream_key}|{cause}|{first}|{last}"))
    return PendingGap(event_id=event_id, first=first, last=last, dropped=None, cause=cause)


def merge_overflow(gaps: list[PendingGap], dropped: Sequence[OutboxRecord], *,
                   open_id: str | None) -> list[PendingGap]:
    """Add ``dropped`` to the owed overflow gap (still contiguous if still owed) or add one."""
    first, last = dropped[0].stream_id, dropped[-1].stream_id
    if gaps and gaps[-1].cause == CAUSE_OVERFLOW and gaps[-1].event_id == open_id:
        owed = gaps[-1]
        merged = PendingGap(
            event_id=owed.event_id,
            first=owed.first,
            last=last,
            dropped=(owed.dropped or 0) + len(dropped),
            cause=CAUSE_OVERFLOW,
        )
        return [*gaps[:-1], merged]
    gap = PendingGap(
        event_id=str(uuid.uuid4()),
        first=first,
        last=last,
        dropped=len(dropped),
        cause=CAUSE_OVERFLOW,
    )
    return [*gaps, gap]


@dataclass(frozen=True, slots=True)
class RelayMark:
    """The relay's high-water mark in etcd: the last stream id relayed, plus owed gaps."""

    last_id: str | None
    gaps: tuple[PendingGap, ...] = ()
    #: the mark key's mod revision (0 = absent), for compare-and-swap
    mod_revision: int = 0

    @classmethod
    def decode(cls, kv: KeyValue | None) -> RelayMark:
        if kv is None:
            return cls(last_id=None)
        body = json.loads(kv.value)
        last = body.get("lastId") or None
        gaps = tuple(PendingGap.from_json(g) for g in body.get("gaps", []))
        return cls(last_id=str(last) if last else None, gaps=gaps, mod_revision=kv.mod_revision)

    @staticmethod
    def encode(last_id: str | None, gaps: Sequence[PendingGap]) -> bytes:
        body: dict[str, Any] = {"lastId": last_id or ZERO_ID}
        if gaps:
            body["gaps"] = [g.to_json() for g in gaps]
        return json.dumps(body, separators=(",", ":")).encode()
