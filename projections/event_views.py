"""The event view: the newest events of the stream, in memory, indexed by node, workload, type.

A fold over the Redis stream in id order (entries at or below the last folded id are ignored,
so a replayed entry is never counted twice). Bounded: at most ``capacity`` entries; the indexes
hold references into the same window and are trimmed as the window moves. ``complete`` says the
window starts at the head of the stream, so a query that finds too few matches in the view knows
the stream has no more.

Replay rebuilds a view from the stream alone; a rebuilt view equals the live one folded from the
same entries (``snapshot`` is what is compared).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from eventsource.events import GAP_TYPE, StreamEntry, parse_stream_id


@dataclass(frozen=True, slots=True)
class ViewFilter:
    type: str = ""
    workload_id: str = ""
    node_id: str = ""

    def matches(self, entry: StreamEntry) -> bool:
        if entry.type == GAP_TYPE:
            return True
        if self.type and entry.type.lower() != self.type.lower():
            return False
        if self.workload_id and entry.workload_id != self.workload_id:
            return False
        return not (self.node_id and entry.node_id != self.node_id)


def _key(stream_id: str) -> tuple[int, int]:
    return parse_stream_id(stream_id)


class EventView:
    """A bounded, indexed window over the newest stream entries."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self.entries: deque[StreamEntry] = deque()
        self.by_node: dict[str, deque[StreamEntry]] = {}
        self.by_workload: dict[str, deque[StreamEntry]] = {}
        self.by_type: dict[str, deque[StreamEntry]] = {}
        self.last_id: tuple[int, int] = (0, 0)
        #: True while the window holds every entry from the head of the stream
        self.complete = True

    def add(self, entry: StreamEntry) -> bool:
        key = _key(entry.stream_id)
        if key <= self.last_id:
            return False
        self.last_id = key
        self.entries.append(entry)
        for index, value in ((self.by_node, entry.node_id),
                             (self.by_workload, entry.workload_id),
                             (self.by_type, entry.type.lower())):
            if value:
                index.setdefault(value, deque()).append(entry)
        while len(self.entries) > self.capacity:
            self._evict(self.entries.popleft())
            self.complete = False
        return True

    def extend(self, entries: Iterable[StreamEntry]) -> None:
        for entry in entries:
            self.add(entry)

    def _evict(self, entry: StreamEntry) -> None:
        for index, value in ((self.by_node, entry.node_id),
                             (self.by_workload, entry.workload_id),
                             (self.by_type, entry.type.lower())):
            if not value:
                continue
            bucket = index.get(value)
            if bucket and bucket[0] is entry:
                bucket.popleft()
                if not bucket:
                    del index[value]

    def trim_before(self, stream_id: str) -> None:
        """Forget entries the stream no longer retains (retention moved its head)."""
        floor = _key(stream_id)
        while self.entries and _key(self.entries[0].stream_id) < floor:
            self._evict(self.entries.popleft())

    def _candidates(self, flt: ViewFilter) -> deque[StreamEntry]:
        options: list[deque[StreamEntry]] = []
        if flt.node_id:
            options.append(self.by_node.get(flt.node_id, deque()))
        if flt.workload_id:
            options.append(self.by_workload.get(flt.workload_id, deque()))
        if flt.type:
            options.append(self.by_type.get(flt.type.lower(), deque()))
        if not options:
            return self.entries
        return min(options, key=len)

    def newest(self, flt: ViewFilter, limit: int) -> list[StreamEntry]:
        """The newest ``limit`` matching entries in ascending order (gaps always match)."""
        out: list[StreamEntry] = []
        gaps = self.by_type.get("eventsgap", deque()) if (flt.node_id or flt.workload_id
                                                          or flt.type) else deque()
        source = self._candidates(flt)
        merged = sorted({id(e): e for e in (*source, *gaps)}.values(),
                        key=lambda e: _key(e.stream_id)) if gaps else list(source)
        for entry in reversed(merged):
            if flt.matches(entry):
                out.append(entry)
                if len(out) >= limit:
                    break
        out.reverse()
        return out

    def snapshot(self) -> list[tuple[str, str, str, str, str]]:
        """What replay compares: every entry's id, event id, type, node and workload."""
        return [(e.stream_id, e.event_id, e.type, e.node_id, e.workload_id)
                for e in self.entries]
