"""The node commands as the servicer calls them: RegisterNode, Heartbeat and the operator
controls (drain, undrain, taints, labels), built over one set of shared parts.

Each command lives in its own module (``registration``, ``heartbeat``, ``drain``, ``marks``);
registration and heartbeats share the liveness leases (``leases``). This module only wires
them.
"""

from __future__ import annotations

from eventsource.clock import Clock
from eventsource.commit import Committer
from eventsource.etcd import AsyncEtcd
from eventsource.keepalives import KeepaliveBatcher
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.records import Node
from handlers.cluster.modes import ModeState
from handlers.identity.authz import Caller
from handlers.nodes.drain import Drain
from handlers.nodes.heartbeat import HeartbeatOutcome, Heartbeats
from handlers.nodes.leases import LivenessLeases
from handlers.nodes.marks import NodeMarks
from handlers.nodes.registration import RegisterOutcome, Registration
from handlers.nodes.usage import UsageSink
from handlers.settings.config import Settings
from handlers.workloads.relocation import Relocator
from handlers.writes.cas import StateWriter
from projections.cluster import ClusterProjection
from proto.persys.control.v1 import control_pb2


class NodeCommands:
    """The node aggregate's command handlers."""

    def __init__(
        self,
        *,
        etcd: AsyncEtcd,
        cluster: ClusterProjection,
        committer: Committer,
        writer: StateWriter,
        relocator: Relocator,
        usage: UsageSink,
        mode: ModeState,
        clock: Clock,
        layout: KeyLayout,
        settings: Settings,
        metrics: Metrics,
        keepalives: KeepaliveBatcher,
    ) -> None:
        leases = LivenessLeases(etcd=etcd, keepalives=keepalives, cluster=cluster, clock=clock,
                                layout=layout, settings=settings)
        self.registration = Registration(cluster=cluster, committer=committer, leases=leases,
                                         usage=usage, mode=mode, clock=clock, layout=layout,
                                         settings=settings, metrics=metrics)
        self.heartbeats = Heartbeats(cluster=cluster, committer=committer, writer=writer,
                                     leases=leases, usage=usage, mode=mode, clock=clock,
                                     settings=settings, metrics=metrics)
        self.drains = Drain(cluster=cluster, writer=writer, relocator=relocator, clock=clock)
        self.marks = NodeMarks(writer=writer, clock=clock)

    async def register(self, req: control_pb2.RegisterNodeRequest,
                       caller: Caller | None = None) -> RegisterOutcome:
        """RegisterNode (``registration.Registration``)."""
        return await self.registration.register(req, caller)

    async def heartbeat(self, req: control_pb2.HeartbeatRequest,
                        caller: Caller | None = None) -> HeartbeatOutcome:
        """Heartbeat (``heartbeat.Heartbeats``)."""
        return await self.heartbeats.heartbeat(req, caller)

    async def drain(self, node_id: str, reason: str) -> tuple[Node, int]:
        return await self.drains.drain(node_id, reason)

    async def undrain(self, node_id: str, reason: str) -> Node:
        return await self.drains.undrain(node_id, reason)

    async def taint(self, node_id: str, key: str, value: str, effect: str) -> Node:
        return await self.marks.taint(node_id, key, value, effect)

    async def untaint(self, node_id: str, key: str, effect: str) -> Node:
        return await self.marks.untaint(node_id, key, effect)

    async def set_label(self, node_id: str, key: str, value: str) -> Node:
        return await self.marks.set_label(node_id, key, value)

    async def delete_label(self, node_id: str, key: str) -> Node:
        return await self.marks.delete_label(node_id, key)
