"""Stream ids and raw entries: what Redis holds, before we decide whether it is ours.

Why apart: pure parsing shared by the log, the tailer and the relay (ids as sortable tuples, the
``data`` field's JSON, redis-py's RESP2/RESP3 shapes); no Redis client here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eventsource.events import StreamEntry, parse_stream_id

#: the id before every real entry (Redis rejects XADD of 0-0 itself)
ZERO_ID = "0-0"


def id_key(stream_id: str) -> tuple[int, int]:
    """A stream id as a sortable tuple (``"12-3"`` -> ``(12, 3)``)."""
    return parse_stream_id(stream_id)


def format_id(key: tuple[int, int]) -> str:
    return f"{key[0]}-{key[1]}"


def next_id(stream_id: str) -> str:
    """The smallest id strictly greater than ``stream_id`` (same millisecond part)."""
    ms, seq = id_key(stream_id)
    return f"{ms}-{seq + 1}"


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _fields(raw: object) -> dict[str, str]:
    if isinstance(raw, Mapping):
        return {_text(k): _text(v) for k, v in raw.items()}
    if isinstance(raw, list | tuple):  # RESP2 flat field list, should a client hand it over
        items = list(raw)
        return {_text(items[i]): _text(items[i + 1]) for i in range(0, len(items) - 1, 2)}
    return {}


@dataclass(frozen=True, slots=True)
class RawEntry:
    """A stream entry as Redis holds it, before we decide whether it is ours."""

    stream_id: str
    fields: Mapping[str, str]

    @property
    def data(self) -> str | None:
        return self.fields.get("data")

    def _body(self) -> dict[str, Any] | None:
        data = self.data
        if data is None:
            return None
        try:
            body = json.loads(data)
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    @property
    def event_id(self) -> str | None:
        """Our ``eventId``; None for entries we did not write (e.g. the Go version's)."""
        body = self._body()
        if body is None:
            return None
        value = body.get("eventId")
        return value if isinstance(value, str) and value else None

    @property
    def is_ours(self) -> bool:
        return self.event_id is not None

    def decode(self) -> StreamEntry:
        """The entry as ListEvents/WatchEvents serve it; tolerant of foreign or broken data."""
        body = self._body()
        if body is None:
            return StreamEntry(
                stream_id=self.stream_id, event_id="", type="", workload_id="", node_id="",
                reason="", timestamp="", details={}, revision=0, seq=0, ts=0, prev="",
            )  # fmt: skip
        try:
            return StreamEntry.from_body(self.stream_id, body)
        except (ValueError, TypeError, AttributeError):
            return StreamEntry(
                stream_id=self.stream_id, event_id=str(body.get("eventId") or ""),
                type=str(body.get("type", "")), workload_id="", node_id="", reason="",
                timestamp="", details={}, revision=0, seq=0, ts=0, prev="",
            )  # fmt: skip

    def ts(self) -> int:
        """The commit time in ms, 0 when absent (such entries count as old)."""
        body = self._body()
        if body is None:
            return 0
        try:
            return int(body.get("ts", 0))
        except (TypeError, ValueError):
            return 0


def raw_entries(raw: object) -> list[RawEntry]:
    """The entries of a range answer (``[id, fields]`` pairs; empty for none)."""
    out: list[RawEntry] = []
    if not raw:
        return out
    assert isinstance(raw, list | tuple)
    for item in raw:
        stream_id, fields = item[0], item[1]
        out.append(RawEntry(_text(stream_id), _fields(fields)))
    return out

