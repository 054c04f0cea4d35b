"""The simulated agents' AgentService (ops/sim/node.py, ops/sim/runtime.py): the asynchronous
apply, listing and delete, the wrong-node refusal, leader terms and capacity."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from ops.sim.config import NodeBehaviour
from ops.sim.node import LEADER_TERM_METADATA, NODE_ID_METADATA
from proto.persys.agent.v1 import agent_pb2
from proto.persys.control.v1 import control_pb2
from tests.fixtures.fakecontrol import MIB, FakeControl, FleetFactory, container, state_of, vm
from tests.fixtures.waiting import wait_for

pytest_plugins = ["tests.fixtures.simfleet"]


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
