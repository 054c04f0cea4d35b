"""Two replicas and 64 concurrent callers fill 20 nodes to exactly their capacity, never over."""

from __future__ import annotations

import asyncio

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

NODES = 20
PER_NODE = 4  # 2000m / 500m
WORKLOADS = 100
CALLERS = 64


async def test_two_replicas_64_callers_fill_exactly_to_capacity(
    etcd_server, redis_server, key_root, stream_key
):
    s1 = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r1")
    s2 = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r2")
    behaviour = NodeBehaviour(cpu_millicores=2000, memory_mb=8192, apply_latency_s=0.05)
    async with (
        running_scheduler(s1) as a,
        running_scheduler(s2) as b,
        running_fleet(f"127.0.0.1:{a.grpc_port}", NODES, behaviour=behaviour) as fleet,
        control_stub(f"127.0.0.1:{a.grpc_port}") as stub_a,
        control_stub(f"127.0.0.1:{b.grpc_port}") as stub_b,
    ):
        await fleet.wait_registered()
        await wait_for(
            lambda: len(b.cluster.alive.items) == NODES and len(a.cluster.alive.items) == NODES,
            timeout=15,
            message="both replicas see every node alive",
        )
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(WORKLOADS):
            queue.put_nowait(i)
        answers: dict[str, pb.ApplyWorkloadResponse] = {}

        async def caller(n: int) -> None:
            stub = stub_a if n % 2 else stub_b
            while not queue.empty():
                i = queue.get_nowait()
                wid = f"fill-{i:03d}"
                answers[wid] = await stub.ApplyWorkload(
                    pb.ApplyWorkloadRequest(
                        workload_id=wid, spec=container_spec(cpu_m=500, mem_mb=256)
                    )
                )

        started = asyncio.get_running_loop().time()
        await asyncio.gather(*(caller(n) for n in range(CALLERS)))
        print("apply phase", asyncio.get_running_loop().time() - started)
        ok = [w for w, r in answers.items() if r.success]
        refused = {w: r for w, r in answers.items() if not r.success}
        assert len(answers) == WORKLOADS
        assert len(ok) == NODES * PER_NODE, {w: r.error_message for w, r in refused.items()}
        for wid, resp in refused.items():
            assert resp.failure_reason == pb.INSUFFICIENT_RESOURCES, wid
            assert "insufficient cpu" in resp.error_message, resp.error_message

        revision = await a.etcd.current_revision()
        rebuilt = await rebuild_cluster(a.etcd, a.layout, revision)
        assert check_invariants(rebuilt) == []
        for node_id, alloc in rebuilt.allocations.items.items():
            assert alloc.value.cpu_millicores == 2000, node_id
        await wait_for(
            lambda: fleet.stats()["workloads_held"] == NODES * PER_NODE,
            timeout=20,
            message="every placed workload reached its agent",
        )
        assert fleet.stats()["over_capacity_nodes"] == 0


async def test_concurrent_large_specs_are_each_committed(
    etcd_server, redis_server, key_root, stream_key
):
    # each spec is within ApplyWorkload's limit, but together they are more than one etcd
    # request may carry: the batcher must split them, not fail them all
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with (
        running_scheduler(settings) as sched,
        running_fleet(f"127.0.0.1:{sched.grpc_port}", 4) as fleet,
        control_stub(f"127.0.0.1:{sched.grpc_port}") as stub,
    ):
        await fleet.wait_registered()
        await wait_for(lambda: len(sched.cluster.alive.items) == 4, timeout=15,
                       message="every node alive")

        async def apply(i: int) -> pb.ApplyWorkloadResponse:
            spec = container_spec()
            spec.container.env["BLOB"] = f"{i}" * 600_000
            return await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id=f"large-{i}", spec=spec))

        answers = await asyncio.gather(*(apply(i) for i in range(4)))
        assert [a.error_message for a in answers if not a.success] == []
        assert all(a.success for a in answers)


async def test_a_node_drained_after_the_decision_is_not_committed_to(
    etcd_server, redis_server, key_root, stream_key
):
    """A placement queued for the group commit when its node is drained (or tainted) goes back
    to be decided again: the flush's node compare sees the drained record, so only the
    decision-time revision can tell the decision is stale."""
    s = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r1")
    async with (
        running_scheduler(s) as a,
        running_fleet(f"127.0.0.1:{a.grpc_port}", 2) as fleet,
        control_stub(f"127.0.0.1:{a.grpc_port}") as stub,
    ):
        await fleet.wait_registered()
        await wait_for(lambda: len(a.cluster.alive.items) == 2, timeout=15, message="alive")
        submit = a.batcher.submit
        drained: list[str] = []

        async def drain_then_submit(intent):  # type: ignore[no-untyped-def]
            # the operator's drain commits between the decision and the flush
            if not drained:
                drained.append(intent.node_id)
                await a.nodes.drain(intent.node_id, "maintenance")
            return await submit(intent)

        a.batcher.submit = drain_then_submit  # type: ignore[method-assign]
        resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w-drain", spec=container_spec()))
        assert resp.success, resp
        assert a.cluster.nodes.get(drained[0]).value.status == "Draining"  # type: ignore[union-attr]
        await wait_for(lambda: a.cluster.statuses.get("w-drain") is not None, timeout=10,
                       message="the placement in the projection")
        assert a.cluster.statuses.get("w-drain").value.node_id != drained[0]  # type: ignore[union-attr]
