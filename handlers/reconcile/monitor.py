"""The node monitor: lost nodes to NotReady, their workloads moved, long-lost nodes removed.

Why apart: the monitor reads only projections (cheap, every few seconds) and acts on nodes,
not on workloads. It turns a Ready node whose liveness key expired into NotReady
(``NodeLost``, source ``monitor``), moves its movable workloads (``Rescheduled``; node-local
ones get ``RescheduleSkipped`` once) once the disruption guard admits the node
(``handlers.reconcile.disruption``: a rate, and a hold while most of the shard looks down) and
removes nodes NotReady for longer than ``SCHEDULER_NODE_GC_AFTER`` (``NodeLeft``). Which nodes
is decided purely (``handlers.reconcile.planner.monitor``). It pauses as the reconcile loop does.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from eventsource.commit import Change
from eventsource.errors import StoreError
from eventsource.etcd import Compare, Delete
from eventsource.events import Event
from handlers.reconcile.disruption import EvictionGate
from handlers.reconcile.parts import SchedulerParts
from handlers.reconcile.planner.monitor import NodeCheck, plan_node_monitor
from handlers.reconcile.shell import BODY_SHARE, NOT_READY, LoopShell, run_bounded

log = logging.getLogger("persys.loops")


@dataclass(slots=True)
class MonitorReport:
    """What one node monitor run did (returned to tests)."""

    skipped: str = ""
    lost: list[str] = field(default_factory=list)
    relocations: Counter[str] = field(default_factory=Counter)
    collected: list[str] = field(default_factory=list)
    #: lost nodes admitted for eviction by this run, and those still waiting
    evicted: tuple[str, ...] = ()
    evictions_waiting: int = 0
    disrupted: bool = False


class NodeMonitor(LoopShell):
    """Liveness -> NotReady + failover; long NotReady -> removal.

    Go's rules: docs/compatibility.md, "Node lifecycle"; liveness: docs/architecture.md,
    "Leadership, sharding and liveness"."""

    name = "node-monitor"

    def __init__(self, scheduler: SchedulerParts, interval_s: float,
                 evictions: EvictionGate) -> None:
        super().__init__(scheduler, evictions)
        self.interval_s = interval_s
        self._lock = asyncio.Lock()

    async def __call__(self) -> None:
        try:
            async with asyncio.timeout(BODY_SHARE * self.interval_s):
                await self.run_once()
        except TimeoutError:
            log.warning("node monitor exceeded %.1fs; the next tick continues",
                        BODY_SHARE * self.interval_s)

    def checks(self) -> list[NodeCheck]:
        alive = self.cluster.alive
        out: list[NodeCheck] = []
        for node_id, item in self.cluster.nodes.items.items():
            if not self.leader.owns(node_id):
                continue
            gone = alive.get(node_id) is None and alive.revision >= item.mod_revision
            out.append(NodeCheck(node_id, item.value.status, gone, item.value.status_updated_at))
        return out

    async def run_once(self, *, now: datetime | None = None) -> MonitorReport:
        paused = self._paused()
        if paused:
            return MonitorReport(skipped=paused)
        if self._lock.locked():
            return MonitorReport(skipped="overlap")
        async with self._lock:
            when = now or self.clock.now()
            report = MonitorReport()
            plan = plan_node_monitor(self.checks(), now=when,
                                     gc_after_s=self.settings.node_gc_after_s)
            ttl = self.settings.node_lease_ttl_s

            async def lose(node_id: str) -> None:
                changed = await self.mark_not_ready(
                    node_id, reason=f"liveness lease expired (no heartbeat for {ttl}s)",
                    source="monitor", now=when)
                if changed:
                    report.lost.append(node_id)

            await run_bounded(plan.lost, self.concurrency, lose)
            decision = self.decide_evictions(self.node_views(), when)
            report.evicted = decision.newly
            report.evictions_waiting = len(decision.waiting)
            report.disrupted = decision.disrupted
            await run_bounded(decision.newly, self.concurrency,
                              lambda node_id: self._relocate_all(node_id, report))
            for node_id in plan.collect:
                if await self._collect(node_id, when):
                    report.collected.append(node_id)
            return report

    async def _relocate_all(self, node_id: str, report: MonitorReport) -> None:
        async def move(workload_id: str) -> None:
            try:
                outcome = await self.relocator.relocate(workload_id, from_node=node_id,
                                                        event_type="Rescheduled", fenced=True)
            except StoreError as exc:
                log.warning("failover of workload_id=%s from node_id=%s failed: %s "
                            "(reconcile retries)", workload_id, node_id, exc)
                outcome = "error"
            report.relocations[outcome] += 1

        await run_bounded(sorted(self.cluster.workload_ids_on(node_id)), self.concurrency, move)

    async def _collect(self, node_id: str, now: datetime) -> bool:
        """Remove a long-NotReady node: its records, its empty allocation, its DNS record."""
        item = self.cluster.nodes.get(node_id)
        if item is None or item.value.status != NOT_READY or self.cluster.alive.get(node_id):
            return False
        # the record lives under the shard key of the replica the node registered through
        shards = {item.value.labels.get("scheduler_shard") or self.settings.shard_key,
                  self.settings.shard_key}
        change = Change(
            kind="monitor",
            # a heartbeat since the plan recreated the liveness key: the node is back
            compares=[Compare.mod(self.layout.node(node_id), item.mod_revision),
                      Compare.absent(self.layout.alive(node_id))],
            deletes=[Delete(self.layout.node(node_id), category="node"),
                     Delete(self.layout.node_status(node_id), category="node"),
                     *(Delete(self.layout.skydns(self.settings.agents_discovery_domain,
                                                 shard, node_id), category="dns")
                       for shard in sorted(shards))],
            events=[Event(type="NodeLeft", node_id=node_id, timestamp=now,
                          reason=f"NotReady for longer than {self.settings.node_gc_after_s:.0f}s",
                          details={"status": "Removed"})])
        alloc = self.cluster.allocations.get(node_id)
        if alloc is not None and not alloc.value.workloads:
            change.compares.append(Compare.mod(self.layout.allocation(node_id),
                                               alloc.mod_revision))
            change.deletes.append(Delete(self.layout.allocation(node_id), category="allocation"))
        try:
            await self.committer.commit(change, fenced=True)
        except StoreError as exc:
            log.info("node not removed node_id=%s: %s", node_id, exc)
            return False
        await self.agents.forget(node_id)
        log.warning("node removed node_id=%s", node_id)
        return True
