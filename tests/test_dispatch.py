"""Post-commit agent calls: an apply committed by a leader loop is sent only while this replica
still leads, and carries its term. A real gRPC agent endpoint counts what arrives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from eventsource.clock import SystemClock
from eventsource.errors import NotLeader
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.records import Node, WorkloadSpec, WorkloadStatus
from handlers.agents.pool import AgentPool
from handlers.workloads.dispatch import Dispatcher
from projections.prefix import Item
from proto.persys.agent.v1 import agent_pb2, agent_pb2_grpc
from tests.fixtures.waiting import wait_for


class CountingAgent(agent_pb2_grpc.AgentServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.terms: list[str | None] = []

    async def ApplyWorkload(self, request: Any, context: Any) -> agent_pb2.ApplyWorkloadResponse:
        md = dict(context.invocation_metadata())
        self.terms.append(md.get("x-persys-leader-term"))
        return agent_pb2.ApplyWorkloadResponse(applied=True)


def projection_of(node: Item[Node], *specs: WorkloadSpec) -> Any:
    """The projections a dispatcher reads: ``node``, and ``specs`` placed on it."""
    spec_items = {s.id: Item(s, 1, 1, 0) for s in specs}
    status_items = {s.id: Item(WorkloadStatus(id=s.id, node_id=node.value.node_id,
                                              status="Scheduled"), 1, 1, 0) for s in specs}
    return SimpleNamespace(nodes=SimpleNamespace(get=lambda node_id: node),
                           specs=SimpleNamespace(get=spec_items.get),
                           statuses=SimpleNamespace(get=status_items.get))


@pytest.fixture
async def agent() -> AsyncIterator[tuple[CountingAgent, str]]:
    server = grpc.aio.server()
    servicer = CountingAgent()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_leader_apply_is_not_sent_after_leadership_is_lost(agent) -> None:
    servicer, endpoint = agent
    leading = {"term": 7}

    def guard() -> None:
        if leading["term"] is None:
            raise NotLeader("lost")

    pool = AgentPool(Metrics(), instance_id="r1", rpc_timeout=5.0, tls=None,
                     leader_term=lambda: leading["term"], guard=guard)
    node = Item(Node(node_id="n1", agent_endpoint=endpoint), 1, 1, 0)
    spec = WorkloadSpec(id="w1", type="container", image="nginx:1", desired_state="Running")
    dispatcher = Dispatcher(pool=pool, cluster=projection_of(node, spec), committer=None,  # type: ignore[arg-type]
                            writer=None, clock=SystemClock(),  # type: ignore[arg-type]
                            layout=KeyLayout(""))
    try:
        dispatcher.apply(spec, {}, "n1", "Running", leader_only=True)
        await wait_for(lambda: len(servicer.terms) == 1, message="the leader's apply was not sent")
        assert servicer.terms == ["7"]

        leading["term"] = None  # leadership lost between the commit and the send
        dispatcher.apply(spec, {}, "n1", "Running", leader_only=True)
        dispatcher.apply(spec, {}, "n1", "Running")  # an API command's apply is not gated
        await wait_for(lambda: len(servicer.terms) == 2, message="the API apply was not sent")
        await asyncio.gather(*list(dispatcher._tasks))
        assert servicer.terms == ["7", None]
    finally:
        await dispatcher.aclose()
        await pool.close()


class SlowAgent(agent_pb2_grpc.AgentServiceServicer):  # type: ignore[misc]
    """Answers applies and deletes after ``delay_s``, as a hypervisor creating a VM does."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.answered: list[str] = []

    async def ApplyWorkload(self, request: Any, context: Any) -> agent_pb2.ApplyWorkloadResponse:
        await asyncio.sleep(self.delay_s)  # allowed: the agent's latency, not a test waiting
        self.answered.append(f"apply {request.id}")
        return agent_pb2.ApplyWorkloadResponse(applied=True)

    async def DeleteWorkload(self, request: Any, context: Any
                             ) -> agent_pb2.DeleteWorkloadResponse:
        await asyncio.sleep(self.delay_s)  # allowed: the agent's latency
        self.answered.append(f"delete {request.id}")
        return agent_pb2.DeleteWorkloadResponse(success=True)


async def test_vm_applies_and_deletes_get_their_own_deadlines() -> None:
    server = grpc.aio.server()
    servicer = SlowAgent(delay_s=0.6)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    pool = AgentPool(Metrics(), instance_id="r1", rpc_timeout=0.2, tls=None,
                     delete_timeout=5.0)
    node = Item(Node(node_id="n1", agent_endpoint=endpoint), 1, 1, 0)
    vm = WorkloadSpec(id="vm-1", type="vm", vm={"vcpus": 1, "memoryMb": 64},
                      desired_state="Running")
    container = WorkloadSpec(id="c-1", type="container", image="x", desired_state="Running")
    recorded: list[str] = []
    dispatcher = Dispatcher(pool=pool, cluster=projection_of(node, vm, container),  # type: ignore[arg-type]
                            committer=None,  # type: ignore[arg-type]
                            writer=None, clock=SystemClock(),  # type: ignore[arg-type]
                            layout=KeyLayout(""), apply_timeout=0.2, vm_apply_timeout=5.0)

    async def record(spec: WorkloadSpec, node_id: str, *, error: str) -> None:
        recorded.append(spec.id)

    dispatcher._record_apply = record  # type: ignore[method-assign]
    try:
        dispatcher.apply(vm, {}, "n1", "Running")
        dispatcher.apply(container, {}, "n1", "Running")
        await asyncio.gather(*list(dispatcher._tasks))
        # the VM had the VM deadline; the container's 0.2 s passed before the agent answered
        assert "apply vm-1" in servicer.answered
        assert recorded == ["c-1"]
        deleted = await pool.delete("n1", endpoint, "vm-1")
        assert deleted.success
        # the channel the container's deadline retired was closed once its last call ended
        assert not pool._retired
        await asyncio.gather(*pool._closing)
    finally:
        await dispatcher.aclose()
        await pool.close()
        await server.stop(None)
