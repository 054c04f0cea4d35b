"""DrainNode and UndrainNode: an operator takes a node out of service (its workloads moved
off, each move one CAS transaction) and returns it.

Apart from the other operator controls because a drain moves workloads (through the
``Relocator``), while taints and labels only rewrite the node record. A Draining node stays
so through its agent's registrations and heartbeats; the heartbeat answer tells the agent.
"""

from __future__ import annotations

from typing import Any

from eventsource.clock import Clock
from eventsource.events import Event, rfc3339
from eventsource.records import Node
from handlers.nodes.statuses import DRAINING, READY
from handlers.workloads.relocation import Relocator
from handlers.writes.cas import StateWriter
from projections.cluster import ClusterProjection


class Drain:
    """The DrainNode and UndrainNode commands."""

    def __init__(self, *, cluster: ClusterProjection, writer: StateWriter,
                 relocator: Relocator, clock: Clock) -> None:
        self.cluster = cluster
        self.writer = writer
        self.relocator = relocator
        self.clock = clock

    async def _control(self, node_id: str, mutate: Any) -> Node:
        node, _ = await self.writer.update_node(node_id, mutate, kind="node-control")
        return node

    async def drain(self, node_id: str, reason: str) -> tuple[Node, int]:
        now = self.clock.now()
        stamp = rfc3339(now)

        already = {"draining": False}

        def mutate(node: Node) -> list[Event] | None:
            if node.status == DRAINING:
                already["draining"] = True
                return None
            node.status = DRAINING
            node.status_reason = reason or "node drain requested"
            node.status_updated_by = "operator"
            node.status_updated_at = stamp
            return [Event(type="NodeDraining", node_id=node_id, reason=node.status_reason,
                          details={"source": "operator"}, timestamp=now)]

        node = await self._control(node_id, mutate)
        moved = 0
        for workload_id in sorted(self.cluster.workload_ids_on(node_id)):
            outcome = await self.relocator.relocate(workload_id, from_node=node_id,
                                                    event_type="Relocated",
                                                    report_skip=not already["draining"])
            moved += outcome == "moved"
        return node, moved

    async def undrain(self, node_id: str, reason: str) -> Node:
        now = self.clock.now()
        stamp = rfc3339(now)

        def mutate(node: Node) -> list[Event] | None:
            if node.status == READY:
                return None
            node.status = READY
            node.status_reason = reason or "node returned to service"
            node.status_updated_by = "operator"
            node.status_updated_at = stamp
            return [Event(type="NodeReady", node_id=node_id, reason=node.status_reason,
                          details={"source": "operator"}, timestamp=now)]

        return await self._control(node_id, mutate)
