"""In-flight reservations: capacity a replica has just promised and not yet seen committed.

A reservation is recorded when a placement is chosen and counts against the node's free capacity
until the allocation projection shows the workload (the commit is visible, so the allocation
itself now counts it: keeping the hold would count it twice), until the placement is abandoned,
or until ``ttl`` passes, whichever comes first. Pure state: times are passed in.

Cost: placement prunes before every decision, and during a relocation storm thousands of holds
are in flight, so nothing here scans all holds. Expiry pops a heap ordered by expiry time;
confirmation is pushed by the allocation projection (``confirm_node`` for the one node whose
allocation changed, checking only that node's holds).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class Hold:
    node_id: str
    cpu_m: int
    mem_mb: int
    expires_at: float


class Reservations(Mapping[str, tuple[int, int]]):
    """node id -> (cpu millicores, memory MB) held in flight; a read-only mapping for placement."""

    def __init__(self, ttl: float, *, confirmed: Callable[[str, str], bool]) -> None:
        self.ttl = ttl
        #: workload id -> hold
        self._holds: dict[str, Hold] = {}
        #: node id -> (cpu, mem) sums of the holds on it
        self._sums: dict[str, tuple[int, int]] = {}
        #: node id -> workload ids held on it
        self._on_node: dict[str, set[str]] = {}
        #: (expires_at, workload id); entries of released or re-made holds are skipped lazily
        self._expiry: list[tuple[float, str]] = []
        self._confirmed = confirmed

    def reserve(self, workload_id: str, node_id: str, cpu_m: int, mem_mb: int, now: float) -> None:
        self.release(workload_id)
        if self._confirmed(node_id, workload_id):
            return  # the allocation already counts it
        hold = Hold(node_id, cpu_m, mem_mb, now + self.ttl)
        self._holds[workload_id] = hold
        self._on_node.setdefault(node_id, set()).add(workload_id)
        heapq.heappush(self._expiry, (hold.expires_at, workload_id))
        cpu, mem = self._sums.get(node_id, (0, 0))
        self._sums[node_id] = (cpu + cpu_m, mem + mem_mb)

    def release(self, workload_id: str) -> None:
        hold = self._holds.pop(workload_id, None)
        if hold is None:
            return
        held = self._on_node.get(hold.node_id)
        if held is not None:
            held.discard(workload_id)
            if not held:
                del self._on_node[hold.node_id]
        cpu, mem = self._sums.get(hold.node_id, (0, 0))
        cpu, mem = cpu - hold.cpu_m, mem - hold.mem_mb
        if cpu <= 0 and mem <= 0:
            self._sums.pop(hold.node_id, None)
        else:
            self._sums[hold.node_id] = (cpu, mem)

    def prune(self, now: float) -> None:
        """Drop expired holds (confirmed ones are dropped by ``confirm_node`` as they appear)."""
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            expires_at, workload_id = heapq.heappop(expiry)
            hold = self._holds.get(workload_id)
            if hold is not None and hold.expires_at == expires_at:
                self.release(workload_id)
        if len(expiry) > 4 * len(self._holds) + 64:
            # mostly entries of holds released early: rebuild so the heap stays bounded
            self._expiry = [(h.expires_at, w) for w, h in self._holds.items()]
            heapq.heapify(self._expiry)

    def confirm_node(self, node_id: str, allocated: Container[str]) -> None:
        """The allocation of ``node_id`` changed: drop the holds it now counts."""
        held = self._on_node.get(node_id)
        if not held:
            return
        for workload_id in [w for w in held if w in allocated]:
            self.release(workload_id)

    @property
    def by_node(self) -> Mapping[str, tuple[int, int]]:
        """node id -> held (cpu, mem); a read-only view for placement's hot loop."""
        return self._sums

    def holds(self) -> dict[str, Hold]:
        return dict(self._holds)

    def __getitem__(self, node_id: str) -> tuple[int, int]:
        return self._sums[node_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sums)

    def __len__(self) -> int:
        return len(self._sums)
