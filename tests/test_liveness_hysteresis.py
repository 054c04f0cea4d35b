"""A node alive by heartbeat but not answering dials is marked NotReady once, stays so while it
heartbeats, and is Ready again only after it answered SCHEDULER_NODE_READY_AFTER_DIALS dials
in a row (real etcd, Redis, scheduler and a real agent server that comes and goes)."""

from __future__ import annotations

import socket

import grpc

from handlers.reconcile.registration import loops_of
from proto.persys.agent.v1 import agent_pb2, agent_pb2_grpc
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import control_stub, make_settings, running_scheduler
from tests.fixtures.reconcile import QUIET
from tests.fixtures.waiting import wait_for


class QuietAgent(agent_pb2_grpc.AgentServiceServicer):
    async def ListWorkloads(self, request, context):
        return agent_pb2.ListWorkloadsResponse()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_undialable_node_is_marked_once_and_returns_after_answered_dials(
        etcd_server, redis_server, key_root, stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_ready_after_dials=3, agent_rpc_timeout_s=1.0, **QUIET)
    port = free_port()
    async with running_scheduler(settings) as sched, \
            control_stub(f"127.0.0.1:{sched.grpc_port}") as stub:
        await wait_for(lambda: sched.leader.is_leader, timeout=15, message="leader")
        reg = await stub.RegisterNode(pb.RegisterNodeRequest(
            node_id="flappy", grpc_endpoint=f"127.0.0.1:{port}",
            capabilities=pb.NodeCapabilities(cpu_total_millicores=1000, memory_total_mb=1024,
                                             supported_workload_types=["container"])))
        assert reg.accepted, reg.reason
        await wait_for(lambda: sched.cluster.nodes.get("flappy") is not None)
        reconcile = loops_of(sched).reconcile

        def status() -> str:
            item = sched.cluster.nodes.get("flappy")
            return item.value.status if item is not None else ""

        async def cycle() -> None:
            # a heartbeat before every cycle: alive by heartbeat throughout
            assert (await stub.Heartbeat(pb.HeartbeatRequest(node_id="flappy"))).acknowledged
            async def once():
                report = await reconcile.run_once()
                return None if report.skipped else report
            await wait_for(once, message="a reconcile cycle of our own")

        async def events(kind: str) -> list[pb.SchedulerEventView]:
            page = await stub.ListEvents(pb.ListEventsRequest(type=kind, node_id="flappy"))
            return list(page.events)

        await cycle()
        await wait_for(lambda: status() == "NotReady", message="marked for unanswered dials")
        for _ in range(4):  # heartbeats and failed dials: no flapping
            await cycle()
            assert status() == "NotReady"
        await wait_for(lambda: _len_is(events("NodeLost"), 1), message="one NodeLost")
        assert await events("NodeReady") == []

        # the agent answers from now on: Ready after the third answered dial, not before
        server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServiceServicer_to_server(QuietAgent(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            for _ in range(2):
                await cycle()
                assert status() == "NotReady"
            await server.stop(None)
            await cycle()  # unanswered again: the count starts over
            server = grpc.aio.server()
            agent_pb2_grpc.add_AgentServiceServicer_to_server(QuietAgent(), server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            for _ in range(2):
                await cycle()
                assert status() == "NotReady"
            await cycle()
            await wait_for(lambda: status() == "Ready", message="Ready after 3 answered dials")
            ready = await wait_for(lambda: events("NodeReady"), message="a NodeReady event")
            assert len(ready) == 1
            assert ready[0].details["source"] == "reconciler"
            assert len(await events("NodeLost")) == 1
        finally:
            await server.stop(None)


async def _len_is(events, n: int) -> bool:
    return len(await events) == n
