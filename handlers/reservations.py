"""In-flight reservations: capacity a replica has just promised and not yet seen committed.

A reservation is recorded when a placement is chosen and counts against the node's free capacity
until the allocation projection shows the workload (the commit is visible, so the allocation
itself now counts it: keeping the hold would count it twice), until the placement is abandoned,
or until ``ttl`` passes, whichever comes first. Pure state: times are passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
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
        self._confirmed = confirmed

    def reserve(self, workload_id: str, node_id: str, cpu_m: int, mem_mb: int, now: float) -> None:
        self.release(workload_id)
        self._holds[workload_id] = Hold(node_id, cpu_m, mem_mb, now + self.ttl)
        cpu, mem = self._sums.get(node_id, (0, 0))
        self._sums[node_id] = (cpu + cpu_m, mem + mem_mb)

    def release(self, workload_id: str) -> None:
        hold = self._holds.pop(workload_id, None)
        if hold is None:
            return
        cpu, mem = self._sums.get(hold.node_id, (0, 0))
        cpu, mem = cpu - hold.cpu_m, mem - hold.mem_mb
        if cpu <= 0 and mem <= 0:
            self._sums.pop(hold.node_id, None)
        else:
            self._sums[hold.node_id] = (cpu, mem)

    def prune(self, now: float) -> None:
        """Drop expired holds and holds whose allocation is already visible."""
        for workload_id, hold in list(self._holds.items()):
            if hold.expires_at <= now or self._confirmed(hold.node_id, workload_id):
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
