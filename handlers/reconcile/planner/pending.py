"""Pending workloads indexed by what they need, and the order a pass tries them in. Pure.

Why an index: when capacity appears (a node joins or returns, is undrained or untainted,
gains a label, or a workload is deleted or stopped), the pending workloads that may now fit
are placed at once, and the work that costs must not grow with the number pending. Workloads
are grouped by **shape**: their type, their request rounded up to a power of two (CPU and
memory apart), their node selector and storage drivers. Within a shape they are kept in
submission order (the creation revision of their status). A pass tries the oldest head of
each shape first (FIFO within equal priority); a head that fits nowhere blocks its shape for
the rest of the pass, never the other shapes, so a huge workload at the head does not keep
smaller ones behind it waiting (no head-of-line blocking between shapes). A pass therefore
makes at most one failed placement decision per shape, plus one per workload it places.

Within a shape, requests differ by less than a factor of two, so a head that fits nowhere
makes it likely, not certain, that the others of its shape do not fit either; they are tried
again at the next capacity change or periodic pass.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from handlers.placement.decision import PlacementRequest


@dataclass(frozen=True, slots=True)
class Shape:
    """What a pending workload needs, coarsely."""

    workload_type: str
    cpu_class: int
    mem_class: int
    selector: tuple[tuple[str, str], ...]
    drivers: tuple[str, ...]
    pinned: tuple[str, ...] = ()


def shape_of(req: PlacementRequest) -> Shape:
    """Requests rounded up to a power of two: ``bit_length`` of the millicores and MB."""
    return Shape(req.workload_type, max(0, req.cpu_m).bit_length(),
                 max(0, req.mem_mb).bit_length(), tuple(sorted(req.selector.items())),
                 tuple(sorted(req.required_drivers)), tuple(sorted(req.only)))


#: a pending workload's place in its shape's queue: (submission order, workload id)
Key = tuple[int, str]


class PendingIndex:
    """Pending workloads by shape, each shape in submission order."""

    def __init__(self) -> None:
        self._queues: dict[Shape, list[Key]] = {}
        self._where: dict[str, tuple[Shape, Key]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, workload_id: object) -> bool:
        return workload_id in self._where

    def shape(self, workload_id: str) -> Shape | None:
        found = self._where.get(workload_id)
        return found[0] if found else None

    def shapes(self) -> int:
        return len(self._queues)

    def add(self, workload_id: str, shape: Shape, order: int) -> None:
        """Index ``workload_id`` (again, if its shape or order changed)."""
        key = (order, workload_id)
        if self._where.get(workload_id) == (shape, key):
            return
        self.remove(workload_id)
        bisect.insort(self._queues.setdefault(shape, []), key)
        self._where[workload_id] = (shape, key)

    def remove(self, workload_id: str) -> None:
        found = self._where.pop(workload_id, None)
        if found is None:
            return
        shape, key = found
        queue = self._queues[shape]
        i = bisect.bisect_left(queue, key)
        if i < len(queue) and queue[i] == key:
            del queue[i]
        if not queue:
            del self._queues[shape]

    def clear(self) -> None:
        self._queues.clear()
        self._where.clear()

    def after(self, shape: Shape, key: Key | None) -> Key | None:
        """The first of ``shape``'s queue after ``key`` (from its start when None)."""
        queue = self._queues.get(shape)
        if not queue:
            return None
        i = 0 if key is None else bisect.bisect_right(queue, key)
        return queue[i] if i < len(queue) else None

    def heads(self) -> Iterator[tuple[Shape, Key]]:
        for shape, queue in self._queues.items():
            if queue:
                yield shape, queue[0]


class PendingPass:
    """One pass over the index: the oldest head first, a refused head's shape dropped.

    The index may change while the pass runs (placed workloads leave it, new ones arrive):
    each shape's position is its last key, so a removal never makes the pass skip or repeat.
    """

    def __init__(self, index: PendingIndex, *, skip: Callable[[Shape], bool]) -> None:
        self.index = index
        self._heap: list[tuple[Key, Shape]] = [
            (key, shape) for shape, key in index.heads() if not skip(shape)]
        heapq.heapify(self._heap)
        self._current: dict[str, tuple[Shape, Key]] = {}

    def next(self) -> str | None:
        """The next workload to try, or None when every shape is placed or refused."""
        if not self._heap:
            return None
        key, shape = heapq.heappop(self._heap)
        self._current[key[1]] = (shape, key)
        return key[1]

    def placed(self, workload_id: str) -> None:
        """It went somewhere (or was not eligible): its shape goes on with the next one."""
        found = self._current.pop(workload_id, None)
        if found is None:
            return
        shape, key = found
        following = self.index.after(shape, key)
        if following is not None:
            heapq.heappush(self._heap, (following, shape))

    def refused(self, workload_id: str) -> None:
        """It fits nowhere: its shape is done for this pass."""
        self._current.pop(workload_id, None)
