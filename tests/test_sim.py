"""Unit tests of the simulated fleet (ops/sim/) against a tiny in-process AgentControl.

The fake control server here is a real grpc.aio server that records RegisterNode and Heartbeat
calls; nothing of the scheduler is involved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from ops.sim.cli import add_sim_arguments, run_sim
from ops.sim.config import NodeBehaviour
from ops.sim.fleet import Fleet
from ops.sim.node import LEADER_TERM_METADATA, NODE_ID_METADATA
from ops.sim.stats import StatsServer
from proto.persys.agent.v1 import agent_pb2, agent_pb2_grpc
from proto.persys.control.v1 import control_pb2, control_pb2_grpc
from tests.fixtures.waiting import wait_for

MIB = 1024 * 1024


class FakeControl(control_pb2_grpc.AgentControlServicer):
    """Records registrations and heartbeats; forgets nodes or rejects them on request."""

    def __init__(self) -> None:
        self.registers: list[control_pb2.RegisterNodeRequest] = []
        self.heartbeats: list[control_pb2.HeartbeatRequest] = []
        self.known: set[str] = set()
        self.accept = True
        self.interval_s = 1

    async def RegisterNode(self, request, context):
        self.registers.append(request)
        if not self.accept:
            return control_pb2.RegisterNodeResponse(accepted=False, reason="degraded")
        self.known.add(request.node_id)
        return control_pb2.RegisterNodeResponse(
            accepted=True, reason="registered", heartbeat_interval_seconds=self.interval_s
        )

    async def Heartbeat(self, request, context):
        if request.node_id not in self.known:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node {request.node_id} not found")
        self.heartbeats.append(request)
        return control_pb2.HeartbeatResponse(acknowledged=True)

    def registered_ids(self) -> list[str]:
        return [r.node_id for r in self.registers]

    def heartbeats_of(self, node_id: str) -> list[control_pb2.HeartbeatRequest]:
        return [h for h in self.heartbeats if h.node_id == node_id]


async def start_control() -> tuple[FakeControl, grpc.aio.Server, str]:
    fake = FakeControl()
    server = grpc.aio.server()
    control_pb2_grpc.add_AgentControlServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return fake, server, f"127.0.0.1:{port}"


@pytest.fixture
async def control() -> AsyncIterator[tuple[FakeControl, str]]:
    fake, server, address = await start_control()
    try:
        yield fake, address
    finally:
        await server.stop(0)


FleetFactory = Callable[..., Awaitable[Fleet]]


@pytest.fixture
async def make_fleet(control: tuple[FakeControl, str]) -> AsyncIterator[FleetFactory]:
    """Start fleets against the fake control server; every one is stopped at teardown."""
    fleets: list[Fleet] = []
    _, address = control

    async def make(**kwargs: Any) -> Fleet:
        kwargs.setdefault("count", 3)
        kwargs.setdefault("seed", 7)
        fleet = Fleet(address, **kwargs)
        fleets.append(fleet)
        await fleet.start()
        return fleet

    try:
        yield make
    finally:
        for fleet in fleets:
            await fleet.stop()


@pytest.fixture
async def agent() -> AsyncIterator[Callable[[int], agent_pb2_grpc.AgentServiceStub]]:
    """Stubs to node ports, over channels closed at teardown."""
    channels: list[grpc.aio.Channel] = []

    def stub(port: int) -> agent_pb2_grpc.AgentServiceStub:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return agent_pb2_grpc.AgentServiceStub(channel)

    try:
        yield stub
    finally:
        for channel in channels:
            await channel.close()


def container(
    workload_id: str,
    *,
    cpu_m: int = 500,
    memory_mb: int = 256,
    revision: str = "r1",
    stopped: bool = False,
) -> agent_pb2.ApplyWorkloadRequest:
    return agent_pb2.ApplyWorkloadRequest(
        id=workload_id,
        type=agent_pb2.WORKLOAD_TYPE_CONTAINER,
        revision_id=revision,
        desired_state=agent_pb2.DESIRED_STATE_STOPPED
        if stopped
        else agent_pb2.DESIRED_STATE_RUNNING,
        spec=agent_pb2.WorkloadSpec(
            container=agent_pb2.ContainerSpec(
                image="nginx",
                resources=agent_pb2.ResourceLimits(cpu_shares=cpu_m, memory_bytes=memory_mb * MIB),
            )
        ),
    )


def vm(workload_id: str, *, vcpus: int, memory_mb: int) -> agent_pb2.ApplyWorkloadRequest:
    return agent_pb2.ApplyWorkloadRequest(
        id=workload_id,
        type=agent_pb2.WORKLOAD_TYPE_VM,
        revision_id="r1",
        desired_state=agent_pb2.DESIRED_STATE_RUNNING,
        spec=agent_pb2.WorkloadSpec(
            vm=agent_pb2.VMSpec(name=workload_id, vcpus=vcpus, memory_mb=memory_mb)
        ),
    )


async def state_of(stub: agent_pb2_grpc.AgentServiceStub, workload_id: str) -> int:
    answer = await stub.GetWorkloadStatus(
        agent_pb2.GetWorkloadStatusRequest(id=workload_id), timeout=5
    )
    return answer.status.actual_state


# ----------------------------------------------------------------------------------------------
# Registration and heartbeats
# ----------------------------------------------------------------------------------------------


async def test_a_fleet_part_takes_its_own_index_range(
    control: tuple[FakeControl, str], make_fleet: FleetFactory
) -> None:
    # the bench runs a large fleet as several processes; their ids must not collide
    fake, _ = control
    fleet = await make_fleet(count=2, first=4)
    ids = [n.node_id for n in fleet.nodes]
    assert ids == ["sim-node-00004", "sim-node-00005"]
    await wait_for(lambda: sorted(set(fake.registered_ids())) == ids, message="registrations")
    with pytest.raises(ValueError, match="first"):
        Fleet("127.0.0.1:1", count=2, first=0)


async def test_all_nodes_register_and_heartbeat_at_the_scheduler_interval(
    control: tuple[FakeControl, str], make_fleet: FleetFactory
) -> None:
    fake, _ = control
    fleet = await make_fleet(
        behaviour=NodeBehaviour(cpu_millicores=4000, memory_mb=2048, labels={"zone": "a"})
    )
    ids = [n.node_id for n in fleet.nodes]
    assert ids == ["sim-node-00001", "sim-node-00002", "sim-node-00003"]

    await wait_for(lambda: sorted(set(fake.registered_ids())) == ids, message="registrations")
    async with asyncio.timeout(5):
        await fleet.wait_registered()
    first = next(r for r in fake.registers if r.node_id == ids[0])
    assert first.capabilities.cpu_total_millicores == 4000
    assert first.capabilities.memory_total_mb == 2048
    assert list(first.capabilities.supported_workload_types) == ["container", "compose", "vm"]
    assert list(first.capabilities.supported_storage_drivers) == ["local"]
    assert first.labels["zone"] == "a"
    assert first.agent_version == "sim"
    assert first.grpc_endpoint == f"127.0.0.1:{fleet.node(ids[0]).port}"
    assert first.timestamp.seconds > 0

    # One heartbeat right after registering, then on the interval the scheduler answered (1 s).
    await wait_for(
        lambda: all(len(fake.heartbeats_of(i)) >= 2 for i in ids),
        timeout=5,
        message="two heartbeats per node",
    )
    assert all(n.control.interval_s == 1.0 for n in fleet.nodes)
    stats = fleet.stats()
    assert stats["nodes"] == 3
    assert stats["registered"] == 3
    assert stats["control"]["register_ok"] == 3


async def test_rejected_registration_backs_off_then_succeeds(
    control: tuple[FakeControl, str], make_fleet: FleetFactory
) -> None:
    fake, _ = control
    fake.accept = False
    fleet = await make_fleet(count=2, heartbeat_interval_s=0.05)
    # 1 s after the first rejection, 2 s after the second: backoff_s is then 4 s for both.
    await wait_for(
        lambda: all(n.control.backoff_s >= 4.0 for n in fleet.nodes),
        timeout=5,
        message="two rejected attempts each",
    )
    assert all(not n.control.registered for n in fleet.nodes)
    assert fleet.stats()["control"]["register_rejected"] >= 4
    fake.accept = True
    async with asyncio.timeout(5):
        await fleet.wait_registered()
    await wait_for(lambda: len(fake.heartbeats) >= 2, message="heartbeats after registration")


async def test_failed_heartbeat_makes_the_node_register_again(
    control: tuple[FakeControl, str], make_fleet: FleetFactory
) -> None:
    fake, _ = control
    fleet = await make_fleet(count=2, heartbeat_interval_s=0.05)
    node_id = fleet.nodes[0].node_id
    await wait_for(lambda: fake.heartbeats_of(node_id), message="first heartbeat")
    fake.known.discard(node_id)  # the scheduler forgot it: Heartbeat answers NOT_FOUND
    await wait_for(
        lambda: fake.registered_ids().count(node_id) >= 2, timeout=5, message="re-registration"
    )
    assert fleet.stats()["control"]["heartbeat_errors"] >= 1


# ----------------------------------------------------------------------------------------------
# Agent API
# ----------------------------------------------------------------------------------------------


async def test_apply_is_async_then_running_and_reported_in_heartbeats(
    control: tuple[FakeControl, str], make_fleet: FleetFactory, agent: Any
) -> None:
    fake, _ = control
    fleet = await make_fleet(
        heartbeat_interval_s=0.05, behaviour=NodeBehaviour(apply_latency_s=0.1)
    )
    node = fleet.nodes[1]
    stub = agent(node.port)
    loop = asyncio.get_running_loop()
    began = loop.time()

    answer = await stub.ApplyWorkload(container("w1", cpu_m=500, memory_mb=256), timeout=5)
    assert answer.applied
    assert not answer.skipped
    assert answer.status.actual_state == agent_pb2.ACTUAL_STATE_PENDING
    assert answer.status.metadata["task_id"].startswith("apply-w1-")
    assert answer.status.metadata["task_status"] == "pending"

    pending = await stub.GetWorkloadStatus(agent_pb2.GetWorkloadStatusRequest(id="w1"), timeout=5)
    if pending.status.actual_state == agent_pb2.ACTUAL_STATE_PENDING:
        assert pending.status.metadata["task_id"] == answer.status.metadata["task_id"]

    async def running() -> bool:
        return await state_of(stub, "w1") == agent_pb2.ACTUAL_STATE_RUNNING

    await wait_for(running, timeout=5, message="w1 running")
    assert loop.time() - began >= 0.1
    assert node.workload_state("w1") == "Running"

    def reported() -> control_pb2.WorkloadStatus | None:
        for beat in reversed(fake.heartbeats_of(node.node_id)):
            for status in beat.workload_statuses:
                if status.workload_id == "w1" and status.state == "Running":
                    return status
        return None

    status = await wait_for(reported, timeout=5, message="heartbeat carrying w1 Running")
    assert status.usage.memory_bytes == 256 * MIB
    beat = next(b for b in reversed(fake.heartbeats_of(node.node_id)) if b.workload_statuses)
    assert beat.usage.cpu_used_millicores == 500
    assert beat.usage.memory_used_mb == 256
    assert [u.workload_id for u in beat.workload_usage] == ["w1"]

    # The same revision again is skipped; a new revision is a new (pending) apply.
    again = await stub.ApplyWorkload(container("w1", cpu_m=500, memory_mb=256), timeout=5)
    assert again.applied
    assert again.skipped
    assert again.status.actual_state == agent_pb2.ACTUAL_STATE_RUNNING
    changed = await stub.ApplyWorkload(container("w1", revision="r2"), timeout=5)
    assert changed.applied
    assert not changed.skipped
    assert changed.status.actual_state == agent_pb2.ACTUAL_STATE_PENDING
    assert fleet.stats()["applies"] == 3


async def test_failures_stopped_state_and_invalid_requests(
    make_fleet: FleetFactory, agent: Any
) -> None:
    behaviour = NodeBehaviour(apply_latency_s=0.0, failure_rate=1.0)
    fleet = await make_fleet(count=1, heartbeat_interval_s=0.05, behaviour=behaviour)
    node = fleet.nodes[0]
    stub = agent(node.port)

    await stub.ApplyWorkload(container("bad"), timeout=5)
    await wait_for(lambda: node.workload_state("bad") == "Failed", message="bad failed")
    status = await stub.GetWorkloadStatus(agent_pb2.GetWorkloadStatusRequest(id="bad"), timeout=5)
    assert "simulated runtime failure" in status.status.message
    heartbeat = node.heartbeat_request()
    assert heartbeat.workload_statuses[0].state == "Failed"
    assert heartbeat.workload_statuses[0].failure_reason == control_pb2.RUNTIME_ERROR

    await stub.ApplyWorkload(container("halt", stopped=True), timeout=5)
    await wait_for(lambda: node.workload_state("halt") == "Stopped", message="halt stopped")

    no_spec = await stub.ApplyWorkload(agent_pb2.ApplyWorkloadRequest(id="x"), timeout=5)
    assert not no_spec.applied
    no_id = await stub.ApplyWorkload(container(""), timeout=5)
    assert not no_id.applied


async def test_status_list_filter_delete_and_kill(make_fleet: FleetFactory, agent: Any) -> None:
    fleet = await make_fleet(
        count=1, heartbeat_interval_s=0.05, behaviour=NodeBehaviour(apply_latency_s=0.0)
    )
    node = fleet.nodes[0]
    stub = agent(node.port)

    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.GetWorkloadStatus(agent_pb2.GetWorkloadStatusRequest(id="nope"), timeout=5)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert "not found" in (missing.value.details() or "")

    await stub.ApplyWorkload(container("c1"), timeout=5)
    await stub.ApplyWorkload(container("c2"), timeout=5)
    await stub.ApplyWorkload(vm("v1", vcpus=1, memory_mb=512), timeout=5)
    everything = await stub.ListWorkloads(agent_pb2.ListWorkloadsRequest(), timeout=5)
    assert sorted(w.id for w in everything.workloads) == ["c1", "c2", "v1"]
    vms = await stub.ListWorkloads(
        agent_pb2.ListWorkloadsRequest(type=agent_pb2.WORKLOAD_TYPE_VM), timeout=5
    )
    assert [w.id for w in vms.workloads] == ["v1"]

    assert node.kill_workloads(["c1", "unknown"]) == 1
    deleted = await stub.DeleteWorkload(agent_pb2.DeleteWorkloadRequest(id="c2"), timeout=5)
    assert deleted.success
    absent = await stub.DeleteWorkload(agent_pb2.DeleteWorkloadRequest(id="c2"), timeout=5)
    assert absent.success
    left = await stub.ListWorkloads(agent_pb2.ListWorkloadsRequest(), timeout=5)
    assert [w.id for w in left.workloads] == ["v1"]

    health = await stub.HealthCheck(agent_pb2.HealthCheckRequest(), timeout=5)
    assert health.healthy
    actions = await stub.ListActions(agent_pb2.ListActionsRequest(limit=20), timeout=5)
    assert list(actions.actions) == []
    rpcs = fleet.stats()["rpcs"]
    assert rpcs["ApplyWorkload"] == 3
    assert rpcs["ListWorkloads"] == 3
    assert rpcs["GetWorkloadStatus"] == 1


async def test_wrong_node_is_refused_and_calls_without_metadata_are_served(
    make_fleet: FleetFactory, agent: Any
) -> None:
    fleet = await make_fleet(heartbeat_interval_s=0.05)
    me, other = fleet.nodes[0], fleet.nodes[1]
    stub = agent(me.port)
    request = agent_pb2.HealthCheckRequest()

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.HealthCheck(request, metadata=((NODE_ID_METADATA, other.node_id),), timeout=5)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "wrong node" in (refused.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.ApplyWorkload(
            container("w"), metadata=((NODE_ID_METADATA, other.node_id),), timeout=5
        )
    assert me.held == 0

    assert (await stub.HealthCheck(request, timeout=5)).healthy  # Go schedulers send none
    own = await stub.HealthCheck(request, metadata=((NODE_ID_METADATA, me.node_id),), timeout=5)
    assert own.healthy
    stats = fleet.stats()
    assert stats["wrong_node_refused"] == 2
    assert stats["rpcs"]["HealthCheck"] == 3
    assert stats["applies"] == 0


async def test_lower_leader_term_counts_as_double_apply(
    make_fleet: FleetFactory, agent: Any
) -> None:
    fleet = await make_fleet(heartbeat_interval_s=0.05)
    one, two = agent(fleet.nodes[0].port), agent(fleet.nodes[1].port)

    def term(value: int) -> tuple[tuple[str, str], ...]:
        return ((LEADER_TERM_METADATA, str(value)),)

    await one.ApplyWorkload(container("a"), metadata=term(5), timeout=5)
    await two.ApplyWorkload(container("b"), metadata=term(7), timeout=5)
    await two.ApplyWorkload(container("b2"), timeout=5)  # no term: never a double apply
    assert fleet.stats()["double_applies"] == 0

    await one.ApplyWorkload(container("c"), metadata=term(5), timeout=5)  # 5 < 7 seen by node 2
    stats = fleet.stats()
    assert stats["double_applies"] == 1
    assert stats["double_applies_node_scope"] == 0
    await two.ApplyWorkload(container("d"), metadata=term(6), timeout=5)  # 6 < 7 on node 2 too
    await two.ApplyWorkload(container("e"), metadata=term(7), timeout=5)
    stats = fleet.stats()
    assert stats["double_applies"] == 2
    assert stats["double_applies_node_scope"] == 1
    assert stats["max_term_seen"] == 7
    assert stats["applies"] == 6
    assert stats["applies_by_term"] == {"5": 2, "6": 1, "7": 2}


async def test_over_capacity_counts_pending_and_running_requests(
    make_fleet: FleetFactory, agent: Any
) -> None:
    small = NodeBehaviour(cpu_millicores=1000, memory_mb=1024, apply_latency_s=0.0)
    fleet = await make_fleet(count=2, heartbeat_interval_s=0.05, behaviour=small)
    node, other = fleet.nodes
    stub, other_stub = agent(node.port), agent(other.port)

    await stub.ApplyWorkload(container("a", cpu_m=600, memory_mb=100), timeout=5)
    assert fleet.stats()["over_capacity_nodes"] == 0
    await stub.ApplyWorkload(container("b", cpu_m=600, memory_mb=100), timeout=5)
    stats = fleet.stats()
    assert stats["over_capacity_nodes"] == 1
    assert stats["over_capacity_node_ids"] == [node.node_id]
    await stub.DeleteWorkload(agent_pb2.DeleteWorkloadRequest(id="b"), timeout=5)
    assert fleet.stats()["over_capacity_nodes"] == 0

    await other_stub.ApplyWorkload(container("m", cpu_m=100, memory_mb=2048), timeout=5)
    assert fleet.stats()["over_capacity_node_ids"] == [other.node_id]
    other.kill_workloads(["m"])
    await other_stub.ApplyWorkload(vm("v", vcpus=2, memory_mb=512), timeout=5)
    assert node.requested() == (600, 100)
    assert other.requested() == (2000, 512)
    assert fleet.stats()["over_capacity_nodes"] == 1

    # Stopped workloads hold nothing.
    await stub.ApplyWorkload(container("s", cpu_m=900, stopped=True), timeout=5)
    await wait_for(lambda: node.workload_state("s") == "Stopped", message="s stopped")
    assert node.requested() == (600, 100)


# ----------------------------------------------------------------------------------------------
# Crash, restart, shutdown
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# CLI contract
# ----------------------------------------------------------------------------------------------


def test_sim_arguments_defaults_and_validation() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(["--scheduler", "127.0.0.1:50051"])
    assert args.nodes == 20
    assert args.apply_latency == 0.2
    assert args.failure_rate == 0.0
    assert args.heartbeat_interval is None
    assert args.prefix == "sim-node-"
    assert args.first_index == 1
    assert (args.cpu, args.memory) == (8000, 16384)
    assert args.stats_port == 0
    assert args.seed is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduler", "x:1", "--failure-rate", "1.5"])
    with pytest.raises(SystemExit):
        parser.parse_args([])


async def test_run_sim_stops_cleanly_on_sigterm(capsys: pytest.CaptureFixture[str]) -> None:
    before = asyncio.all_tasks()
    fake, control_server, address = await start_control()
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(
        [
            "--scheduler",
            address,
            "--nodes",
            "2",
            "--prefix",
            "cli-",
            "--heartbeat-interval",
            "0.05",
            "--report-every",
            "0.05",
            "--seed",
            "3",
        ]
    )
    runner = asyncio.get_running_loop().create_task(run_sim(args))
    output: list[str] = []

    def ready() -> bool:
        output.append(capsys.readouterr().out)
        return '"sim_ready"' in "".join(output)

    try:
        await wait_for(ready, message="sim_ready line")
        await wait_for(lambda: len(set(fake.registered_ids())) == 2, message="cli registered")
        os.kill(os.getpid(), signal.SIGTERM)  # run_sim's handler is installed before sim_ready
        async with asyncio.timeout(10):
            assert await runner == 0
    finally:
        if not runner.done():
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await control_server.stop(0)
    output.append(capsys.readouterr().out)
    lines = [json.loads(line) for line in "".join(output).splitlines() if line.startswith("{")]
    assert lines[0]["event"] == "sim_ready"
    assert lines[0]["nodes"] == 2
    assert lines[-1]["event"] == "sim_stopped"
    assert lines[-1]["stats"]["nodes"] == 2
    assert set(fake.registered_ids()) == {"cli-00001", "cli-00002"}
    assert asyncio.all_tasks() - before == set()
