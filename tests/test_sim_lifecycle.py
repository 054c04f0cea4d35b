"""A simulated node's crash and restart, and a fleet's clean shutdown with its stats served
over HTTP (ops/sim/fleet.py, ops/sim/stats.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from ops.sim.config import NodeBehaviour
from ops.sim.fleet import Fleet
from ops.sim.stats import StatsServer
from proto.persys.agent.v1 import agent_pb2, agent_pb2_grpc
from tests.fixtures.fakecontrol import FakeControl, FleetFactory, container, start_control
from tests.fixtures.waiting import wait_for

pytest_plugins = ["tests.fixtures.simfleet"]


async def test_crash_makes_rpcs_fail_and_restart_comes_back_on_the_same_port(
    control: tuple[FakeControl, str], make_fleet: FleetFactory, agent: Any
) -> None:
    fake, _ = control
    fleet = await make_fleet(heartbeat_interval_s=0.05, behaviour=NodeBehaviour(apply_latency_s=0))
    victim = fleet.nodes[0]
    stub = agent(victim.port)
    await stub.ApplyWorkload(container("w"), timeout=5)
    await wait_for(lambda: victim.workload_state("w") == "Running", message="w running")
    port = victim.port

    await victim.crash()
    assert not victim.alive
    with pytest.raises(grpc.aio.AioRpcError) as down:
        await stub.HealthCheck(agent_pb2.HealthCheckRequest(), timeout=2)
    assert down.value.code() == grpc.StatusCode.UNAVAILABLE
    silent_from = len(fake.heartbeats_of(victim.node_id))
    others = [n.node_id for n in fleet.nodes[1:]]
    marks = {i: len(fake.heartbeats_of(i)) for i in others}
    await wait_for(
        lambda: all(len(fake.heartbeats_of(i)) >= marks[i] + 3 for i in others),
        message="other nodes keep heartbeating",
    )
    # At most the heartbeat that was already in flight when the node crashed.
    assert len(fake.heartbeats_of(victim.node_id)) <= silent_from + 1
    assert fleet.stats()["alive"] == 2

    registrations = fake.registered_ids().count(victim.node_id)
    await victim.restart()
    assert victim.port == port
    assert victim.held == 0  # a restarted agent lost its workloads
    await wait_for(
        lambda: fake.registered_ids().count(victim.node_id) > registrations,
        message="registered again",
    )
    health = await stub.HealthCheck(agent_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True)
    assert health.healthy

    await stub.ApplyWorkload(container("kept"), timeout=5)
    await victim.crash()
    await victim.restart(keep_workloads=True)
    assert victim.workload_ids() == ["kept"]
    await wait_for(lambda: victim.workload_state("kept") == "Running", message="kept running")


async def test_stop_leaves_no_tasks_and_stats_are_served_over_http() -> None:
    # The control server lives in the test so that, once it is stopped too, any task left
    # behind can only be the fleet's.
    before = asyncio.all_tasks()
    _, control_server, address = await start_control()
    fleet = Fleet(
        address,
        count=3,
        heartbeat_interval_s=0.05,
        seed=1,
        behaviour=NodeBehaviour(apply_latency_s=0.5),
    )
    stats_server = StatsServer(fleet)
    channel: grpc.aio.Channel | None = None
    try:
        await fleet.start()
        async with asyncio.timeout(5):
            await fleet.wait_registered()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{fleet.nodes[0].port}")
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        await stub.ApplyWorkload(container("w"), timeout=5)
        port = await stats_server.start(0)

        async def get(path: str) -> tuple[str, dict[str, Any]]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            await writer.drain()
            raw = await reader.read()
            writer.close()
            await writer.wait_closed()
            head, _, body = raw.partition(b"\r\n\r\n")
            return head.decode().split("\r\n")[0], json.loads(body)

        status, body = await get("/stats")
        assert status == "HTTP/1.1 200 OK"
        assert body["nodes"] == 3
        assert body["workloads_held"] == 1
        assert "per_node" not in body
        _, body = await get("/stats?per_node=1")
        assert body["per_node"] == {
            fleet.nodes[0].node_id: 1,
            fleet.nodes[1].node_id: 0,
            fleet.nodes[2].node_id: 0,
        }
        status, _ = await get("/nope")
        assert status.startswith("HTTP/1.1 404")
    finally:
        if channel is not None:
            await channel.close()
        await stats_server.close()
        await fleet.stop()
        await control_server.stop(0)
    await fleet.stop()  # idempotent
    assert asyncio.all_tasks() - before == set()
    assert all(not n.alive for n in fleet.nodes)
