"""Workloads that fit nowhere are stored Pending and placed when capacity appears (real etcd,
Redis and simulated agents)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from handlers.app.server import Scheduler
from handlers.reconcile.registration import loops_of
from ops.replay import check_invariants, rebuild_cluster
from ops.sim.config import NodeBehaviour
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    container_spec,
    control_stub,
    make_settings,
    running_fleet,
    running_scheduler,
)
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

NODES = 4
SMALL = 500  # millicores: 4 per node
BEHAVIOUR = NodeBehaviour(cpu_millicores=2000, memory_mb=8192, apply_latency_s=0.05)


@contextlib.asynccontextmanager
async def full_fleet(settings: Any) -> AsyncIterator[tuple[Scheduler, Any, Any]]:
    """A leading scheduler whose NODES nodes are full with running workloads fill-00..15."""
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, NODES, behaviour=BEHAVIOUR) as fleet, \
                control_stub(address) as stub:
            await fleet.wait_registered()
            await wait_for(lambda: sched.leader.is_leader, timeout=15)
            for i in range(NODES * 4):
                resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                    workload_id=f"fill-{i:02d}", spec=container_spec(cpu_m=SMALL)))
                assert resp.success, resp.error_message
            yield sched, fleet, stub


async def status(stub: Any, workload_id: str) -> pb.WorkloadView:
    return (await stub.GetWorkload(pb.GetWorkloadRequest(workload_id=workload_id))).workload


async def events_of(stub: Any, kind: str) -> list[pb.SchedulerEventView]:
    return list((await stub.ListEvents(pb.ListEventsRequest(type=kind, limit=10_000))).events)


async def placed(stub: Any, ids: list[str]) -> list[str]:
    return [w for w in ids if (await status(stub, w)).assigned_node_id]


async def no_node_over_capacity(sched: Scheduler) -> None:
    rebuilt = await rebuild_cluster(sched.etcd, sched.layout,
                                    await sched.etcd.current_revision())
    assert check_invariants(rebuilt) == []
    for node_id, alloc in rebuilt.allocations.items.items():
        assert alloc.value.cpu_millicores <= BEHAVIOUR.cpu_millicores, node_id


async def test_pending_workloads_wait_and_are_placed_in_submission_order(
        etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with full_fleet(settings) as (sched, _fleet, stub):
        pending = [f"pending-{i:02d}" for i in range(50)]
        for wid in pending:
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id=wid, spec=container_spec(cpu_m=SMALL)))
            assert not resp.success
            assert resp.failure_reason == pb.INSUFFICIENT_RESOURCES
            assert resp.error_message.startswith("stored as Pending, placed when capacity "
                                                 "appears: no suitable node: 0/4 nodes fit: "
                                                 "4 insufficient cpu")
        for wid in pending:
            view = await status(stub, wid)
            assert view.status == "Pending"
            assert view.assigned_node_id == ""
            assert view.reason.code == "Unschedulable"
            assert "0/4 nodes fit: 4 insufficient cpu" in view.reason.message
            assert "0/4 nodes fit" in view.failure_reason
        listed = (await stub.ListWorkloads(pb.ListWorkloadsRequest(status="Pending"))).workloads
        assert {w.workload_id for w in listed if not w.assigned_node_id} == set(pending)
        await wait_for(lambda: len(loops_of(sched).reconcile.pending.index) == 50, timeout=5)

        freed = time.monotonic()
        for i in range(10):
            resp = await stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id=f"fill-{i:02d}"))
            assert resp.success
        await wait_for(lambda: _count(placed(stub, pending), 10), timeout=10)
        took = time.monotonic() - freed
        print(f"10 capacity slots freed -> 10 pending placed in {took:.2f} s")
        assert took < 2.0
        assert sorted(await placed(stub, pending)) == pending[:10]  # submission order

        async with running_fleet(f"127.0.0.1:{sched.grpc_port}", 1, prefix="late-node-",
                                 behaviour=BEHAVIOUR) as late:
            await late.wait_registered()
            await wait_for(lambda: _count(placed(stub, pending), 14), timeout=10,
                           message="a new node takes 4 more")
            assert sorted(await placed(stub, pending)) == pending[:14]
            await no_node_over_capacity(sched)
            # one WorkloadPending per workload, never one per attempt
            assert sorted(e.workload_id for e in await events_of(stub, "WorkloadPending")) \
                == pending
            await wait_for(lambda: all_running(stub, pending[:14]), timeout=20)


async def _count(ids: Any, n: int) -> bool:
    return len(await ids) >= n


async def all_running(stub: Any, ids: list[str]) -> bool:
    return all([(await status(stub, w)).status == "Running" for w in ids])


async def test_a_huge_workload_at_the_head_does_not_block_smaller_ones(
        etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with full_fleet(settings) as (_sched, _fleet, stub):
        huge = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="huge", spec=container_spec(cpu_m=64_000)))
        assert "stored as Pending" in huge.error_message
        small = [f"small-{i}" for i in range(3)]
        for wid in small:
            await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id=wid, spec=container_spec(cpu_m=SMALL)))
        for wid in ("fill-00", "fill-01"):
            await stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id=wid))
        await wait_for(lambda: _count(placed(stub, small), 2), timeout=10)
        assert await placed(stub, small) == small[:2]
        assert (await status(stub, "huge")).status == "Pending"


async def test_pending_max_and_refuse_are_honoured(etcd_server, redis_server, key_root,
                                                   stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, pending_max=2)
    async with full_fleet(settings) as (sched, _fleet, stub):
        for i in range(2):
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id=f"p{i}", spec=container_spec(cpu_m=SMALL)))
            assert "stored as Pending" in resp.error_message
        await wait_for(lambda: len(sched.cluster.workloads.unassigned) == 2, timeout=5)
        over = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="p2", spec=container_spec(cpu_m=SMALL)))
        assert not over.success
        assert over.failure_reason == pb.INSUFFICIENT_RESOURCES
        assert "not stored: 2 workloads pending already (SCHEDULER_PENDING_MAX)" \
            in over.error_message
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await status(stub, "p2")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    refuse = make_settings(etcd_server, redis_server, key_root + "-refuse", stream_key,
                           unplaceable="refuse")
    async with full_fleet(refuse) as (sched, _fleet, stub):
        resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="r0", spec=container_spec(cpu_m=SMALL)))
        assert not resp.success
        assert "not stored: SCHEDULER_UNPLACEABLE=refuse" in resp.error_message
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await status(stub, "r0")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_two_active_active_replicas_place_each_pending_workload_once(
        etcd_server, redis_server, key_root, stream_key):
    common = {"ha_mode": "active-active", "shard_count": 2}
    s1 = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r1",
                       shard_index=0, **common)
    s2 = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r2",
                       shard_index=1, **common)
    async with (
        running_scheduler(s1) as a,
        running_scheduler(s2) as b,
        running_fleet(f"127.0.0.1:{a.grpc_port}", NODES, behaviour=BEHAVIOUR) as fleet,
        control_stub(f"127.0.0.1:{a.grpc_port}") as stub_a,
        control_stub(f"127.0.0.1:{b.grpc_port}") as stub_b,
    ):
        await fleet.wait_registered()
        await wait_for(lambda: a.leader.is_leader and b.leader.is_leader, timeout=20)
        await wait_for(lambda: len(b.cluster.alive.items) == NODES, timeout=15)
        for i in range(NODES * 4):
            resp = await (stub_a if i % 2 else stub_b).ApplyWorkload(
                pb.ApplyWorkloadRequest(workload_id=f"fill-{i:02d}",
                                        spec=container_spec(cpu_m=SMALL)))
            assert resp.success, resp.error_message
        pending = [f"aa-{i:02d}" for i in range(20)]
        await asyncio.gather(*((stub_a if i % 2 else stub_b).ApplyWorkload(
            pb.ApplyWorkloadRequest(workload_id=wid, spec=container_spec(cpu_m=SMALL)))
            for i, wid in enumerate(pending)))
        for i in range(8):
            await stub_a.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id=f"fill-{i:02d}"))
        await wait_for(lambda: _count(placed(stub_a, pending), 8), timeout=15)
        assert len(await placed(stub_a, pending)) == 8
        scheduled = [e.workload_id for e in await events_of(stub_a, "WorkloadScheduled")
                     if e.workload_id in pending]
        assert sorted(scheduled) == sorted(set(scheduled))  # each placed once
        assert len(scheduled) == 8
        await no_node_over_capacity(a)


async def test_a_restart_of_every_replica_loses_no_pending_workload(
        etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with full_fleet(settings) as (_sched, _fleet, stub):
        for i in range(3):
            await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id=f"kept-{i}", spec=container_spec(cpu_m=SMALL)))
    async with running_scheduler(settings) as again:
        address = f"127.0.0.1:{again.grpc_port}"
        async with running_fleet(address, NODES, behaviour=BEHAVIOUR) as fleet, \
                control_stub(address) as stub:
            await fleet.wait_registered()
            await wait_for(lambda: again.leader.is_leader, timeout=15)
            kept = [f"kept-{i}" for i in range(3)]
            for wid in kept:
                assert (await status(stub, wid)).status in ("Pending", "Scheduled", "Running")
            for i in range(3):
                await stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id=f"fill-{i:02d}"))
            await wait_for(lambda: _count(placed(stub, kept), 3), timeout=15)


async def test_a_deleted_workload_reads_deleting_until_its_agent_confirms(
        etcd_server, redis_server, key_root, stream_key):
    slow = NodeBehaviour(cpu_millicores=2000, memory_mb=8192, apply_latency_s=0.05,
                         delete_latency_s=1.5)
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             agent_status_poll_interval_s=0.2)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 1, behaviour=slow) as fleet, \
                control_stub(address) as stub:
            await fleet.wait_registered()
            await wait_for(lambda: sched.leader.is_leader, timeout=15)
            await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="slow-delete", spec=container_spec(cpu_m=SMALL)))
            await wait_for(lambda: all_running(stub, ["slow-delete"]), timeout=15)
            resp = await stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id="slow-delete"))
            assert resp.success
            asked = time.monotonic()
            assert (await status(stub, "slow-delete")).status == "Deleting"

            async def gone() -> bool:
                try:
                    await status(stub, "slow-delete")
                except grpc.aio.AioRpcError as exc:
                    return exc.code() == grpc.StatusCode.NOT_FOUND
                return False

            await wait_for(gone, timeout=15, message="state removed once the agent let go")
            assert time.monotonic() - asked >= 1.0  # it read Deleting while the agent held it
