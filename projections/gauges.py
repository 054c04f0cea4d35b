"""The Go version's state gauges, kept from the projections' change feed.

``persys_scheduler_nodes_status{status}``, ``..._workloads_status{status}`` and
``..._workloads_desired_state{desired_state}`` count nodes and workloads by a label: the
record's value lower-cased and trimmed, ``unknown`` when empty (as Go's ``normalizeLabel``).

Why a listener: the Go version recomputed them with a full scan of etcd after every reconcile
and monitor cycle, on the leader only, so a standby's gauges stayed as they were at its start.
Every replica here folds the same changes into its projections, and a listener per projection
keeps the counts as the changes arrive: O(1) per change (nothing when a record is rewritten
with the same label), a recount on a re-list, nothing at scrape time. A standby reports what
the leader reports, at 5,000 nodes and 100,000 workloads as at ten.

Invariants: the gauge of a label equals the number of items in the projection with that label,
after every folded batch; Go's pre-seeded labels are always exported (0 when nothing has
them); any other label is exported while something has it, and removed when nothing does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from prometheus_client import Gauge

from projections.prefix import Item

R = TypeVar("R")


def go_label(value: str) -> str:
    """A status as the Go gauges label it: lower-cased, trimmed, ``unknown`` when empty."""
    return value.strip().lower() or "unknown"


class LabelGauge(Generic[R]):
    """A projection listener that keeps ``gauge`` at the number of items per label."""

    def __init__(self, gauge: Gauge, value_of: Callable[[R], str], *,
                 seeded: Iterable[str]) -> None:
        self._gauge = gauge
        self._value_of = value_of
        self._seeded = frozenset(seeded)
        #: items per label; only labels some item has
        self.counts: Counter[str] = Counter()
        #: the gauge's child per exported label (``labels()`` costs a lock and a tuple)
        self._children: dict[str, Gauge] = {}
        for label in self._seeded:
            self._publish(label)

    def label_of(self, value: R) -> str:
        return go_label(self._value_of(value))

    def changed(self, item_id: str, old: Item[R] | None, new: Item[R] | None) -> None:
        before = None if old is None else self.label_of(old.value)
        after = None if new is None else self.label_of(new.value)
        if before == after:
            return
        if before is not None:
            self.counts[before] -= 1
            self._publish(before)
        if after is not None:
            self.counts[after] += 1
            self._publish(after)

    def reset(self, items: dict[str, Item[R]]) -> None:
        previous = set(self.counts)
        self.counts = Counter(self.label_of(item.value) for item in items.values())
        for label in previous | set(self.counts) | self._seeded:
            self._publish(label)

    def _publish(self, label: str) -> None:
        count = self.counts.get(label, 0)
        if count <= 0:
            self.counts.pop(label, None)
            if label not in self._seeded:
                if self._children.pop(label, None) is not None:
                    self._gauge.remove(label)
                return
        child = self._children.get(label)
        if child is None:
            child = self._children[label] = self._gauge.labels(label)
        child.set(count)
