"""The pending placer: unassigned workloads placed the moment capacity appears.

Why a placer of its own: the reconcile cycle places unassigned workloads every interval,
but a client that submitted ahead of capacity should not wait for a cycle, and with thousands
pending a cycle that tried every one would make thousands of placement decisions that visit
every node. So the projections' changes drive it: a node that joins or changes (Ready,
undrained, untainted, labelled, resized), a node whose liveness lease appears, an allocation
that shrinks (a workload deleted or stopped) each start a **generation**, and a pass over the
pending index (``handlers.reconcile.planner.pending``) tries the oldest head of every shape
not already refused in this generation. The reconcile cycle's own placements go through
``attempt`` too, so they skip the shapes a pass found unplaceable: per capacity change, at most
one failed decision per shape, whatever the number pending.

Pending here means found to fit nowhere (status ``Pending`` with reason ``Unschedulable``):
an ApplyWorkload that stored it so, or a reconcile placement that found no node. A workload
freshly unassigned (failed over, its runtime missing) is placed by the next cycle as before,
and joins the index only if that finds no node.

Leader-only and sharded like the cycle: a pass runs as a task of the leadership group, only
for the workloads this shard owns (crc32 of the workload id), and every placement is a fenced
commit that compares the node's allocation, so two replicas never overfill a node.

A workload that stays unplaceable gets its reason (and one ``WorkloadPending`` event) only
when its kinds of refusal change (``handlers.workloads.pending.mark_pending``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime
from enum import Enum
from typing import Generic, TypeVar

from eventsource.events import Event
from eventsource.records import Allocation, Node, WorkloadSpec, WorkloadStatus
from handlers.reconcile.planner.inputs import node_of, owns_workload
from handlers.reconcile.planner.pending import PendingIndex, PendingPass, Shape, shape_of
from handlers.reconcile.relocations import Relocations
from handlers.reconcile.shell import LoopShell
from handlers.specs.stored import normalize_desired_state
from handlers.workloads.assignment import placement_request
from handlers.workloads.pending import is_pending, mark_pending
from handlers.writes.cas import NotFound
from projections.prefix import Item

log = logging.getLogger("persys.pending")
R = TypeVar("R")

#: a pass on its own at least this often (reservations that expired free capacity without a
#: projection change, and a trigger lost to a restart is made up for)
PERIODIC_PASS_S = 30.0


class Tried(Enum):
    PLACED = "placed"
    REFUSED = "refused"
    SKIPPED = "skipped"


class PendingPlacer:
    """Keeps the pending index from the projections and places from it while leading."""

    name = "pending"

    def __init__(self, shell: LoopShell, relocations: Relocations,
                 periodic_s: float = PERIODIC_PASS_S) -> None:
        self.shell = shell
        self.cluster = shell.cluster
        self.relocations = relocations
        self.metrics = shell.metrics
        self.periodic_s = periodic_s
        settings = shell.settings
        self._shards = (settings.shard_count if settings.active_active else 1,
                        settings.shard_index)
        self.index = PendingIndex()
        #: bumped by every change that may have freed capacity
        self.generation = 0
        #: shapes found unplaceable, and in which generation
        self._refused: dict[Shape, int] = {}
        self._wake = asyncio.Event()
        c = self.cluster
        c.statuses.listeners.append(_Statuses(self))
        c.specs.listeners.append(_Specs(self))
        c.nodes.listeners.append(_Capacity[Node](self, _any_change))
        c.alive.listeners.append(_Capacity[bytes](self, _became_alive))
        c.allocations.listeners.append(_Capacity[Allocation](self, _shrank))

    # -- the index, from the projections ------------------------------------------------------
    def track(self, workload_id: str) -> None:
        """(Re)index ``workload_id`` if it is pending, drop it otherwise."""
        status = self.cluster.statuses.get(workload_id)
        spec = self.cluster.specs.get(workload_id)
        if (status is None or spec is None or not is_pending(status.value)
                or workload_id not in self.cluster.workloads.unassigned
                or normalize_desired_state(spec.value.desired_state) == "Deleted"):
            self.index.remove(workload_id)
        else:
            self.index.add(workload_id, shape_of(placement_request(spec.value)),
                           status.create_revision)
            self._wake.set()
        self.metrics.pending_workloads.set(len(self.index))

    def rebuild(self) -> None:
        self.index.clear()
        for workload_id in list(self.cluster.workloads.unassigned):
            self.track(workload_id)
        self.capacity_changed()

    def capacity_changed(self) -> None:
        """Something may have freed room: shapes refused before are worth trying again."""
        self.generation += 1
        self._refused.clear()
        self._wake.set()

    # -- placing ------------------------------------------------------------------------------
    def owns(self, workload_id: str) -> bool:
        count, index = self._shards
        return owns_workload(workload_id, shard_count=count, shard_index=index)

    async def attempt(self, workload_id: str, now: datetime) -> Tried:
        """One placement of ``workload_id``, unless its shape was refused in this generation."""
        shape = self.index.shape(workload_id)
        if shape is not None and self._refused.get(shape) == self.generation:
            return Tried.REFUSED
        generation = self.generation
        answer = await self.relocations.place(workload_id, now)
        if answer.placed:
            self.metrics.pending_placed.inc()
            return Tried.PLACED
        if not answer.refused:
            return Tried.SKIPPED
        if shape is not None:
            self._refused[shape] = generation
        await self._note_refusal(workload_id, answer.refused, now)
        return Tried.REFUSED

    async def pass_once(self) -> int:
        """Try the pending heads, oldest first (each at its own time); the number placed."""
        self.metrics.pending_passes.inc()
        generation = self.generation
        tour = PendingPass(self.index, skip=lambda s: self._refused.get(s) == generation)
        placed = 0
        while (workload_id := tour.next()) is not None:
            if not self.shell.leader.is_leader or not self.shell.mode.writable:
                break
            if not self.owns(workload_id):
                tour.placed(workload_id)
                continue
            tried = await self.attempt(workload_id, self.shell.clock.now())
            if tried is Tried.REFUSED:
                tour.refused(workload_id)
            else:
                placed += tried is Tried.PLACED
                tour.placed(workload_id)
        if placed:
            log.info("pending placer: placed=%d still_pending=%d shapes=%d", placed,
                     len(self.index), self.index.shapes())
        return placed

    async def run(self) -> None:
        """The leader task: a pass per wake-up (a capacity change), and one periodically."""
        while True:
            try:
                async with asyncio.timeout(self.periodic_s):
                    await self._wake.wait()
            except TimeoutError:
                self.capacity_changed()
            self._wake.clear()
            try:
                await self.pass_once()
            except Exception:
                # one bad record must not end placement for every pending workload
                log.exception("pending placer pass failed")

    async def _note_refusal(self, workload_id: str, reason: str, now: datetime) -> None:
        """Record why it fits nowhere, when the kinds of refusal changed (one event)."""

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_of(status):
                return None  # placed meanwhile
            event = mark_pending(status, workload_id, reason, now)
            return [event] if event is not None else None

        try:
            await self.shell.writer.update_status(workload_id, mutate, kind="reconcile",
                                                  fenced=True)
        except NotFound:
            return


def _any_change(old: Item[Node] | None, new: Item[Node] | None) -> bool:
    return True


def _became_alive(old: Item[bytes] | None, new: Item[bytes] | None) -> bool:
    return old is None and new is not None


def _shrank(old: Item[Allocation] | None, new: Item[Allocation] | None) -> bool:
    if old is None:
        return False
    if new is None:
        return True
    return (new.value.cpu_millicores < old.value.cpu_millicores
            or new.value.memory_mb < old.value.memory_mb)


class _Statuses:
    def __init__(self, placer: PendingPlacer) -> None:
        self.placer = placer

    def changed(self, item_id: str, old: Item[WorkloadStatus] | None,
                new: Item[WorkloadStatus] | None) -> None:
        self.placer.track(item_id)

    def reset(self, items: dict[str, Item[WorkloadStatus]]) -> None:
        self.placer.rebuild()


class _Specs:
    def __init__(self, placer: PendingPlacer) -> None:
        self.placer = placer

    def changed(self, item_id: str, old: Item[WorkloadSpec] | None,
                new: Item[WorkloadSpec] | None) -> None:
        self.placer.track(item_id)

    def reset(self, items: dict[str, Item[WorkloadSpec]]) -> None:
        self.placer.rebuild()


class _Capacity(Generic[R]):
    """A projection whose changes may free room (``freed(old, new)`` says which do)."""

    def __init__(self, placer: PendingPlacer,
                 freed: Callable[[Item[R] | None, Item[R] | None], bool]) -> None:
        self.placer = placer
        self.freed = freed

    def changed(self, item_id: str, old: Item[R] | None, new: Item[R] | None) -> None:
        if self.freed(old, new):
            self.placer.capacity_changed()

    def reset(self, items: dict[str, Item[R]]) -> None:
        self.placer.capacity_changed()
