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
from eventsource.records import Node, WorkloadSpec
from handlers.agents import AgentPool
from handlers.dispatch import Dispatcher
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
    cluster = SimpleNamespace(nodes=SimpleNamespace(get=lambda node_id: node))
    dispatcher = Dispatcher(pool=pool, cluster=cluster, committer=None,  # type: ignore[arg-type]
                            writer=None, clock=SystemClock(),  # type: ignore[arg-type]
                            layout=KeyLayout(""))
    spec = WorkloadSpec(id="w1", type="container", image="nginx:1")
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
