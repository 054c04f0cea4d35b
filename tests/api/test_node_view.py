"""NodeView: the Go fields keep their Go meaning (total minus what the agent reported in
use); the allocations placement counts are in the fields this scheduler adds."""

from __future__ import annotations

from eventsource.records import Allocation, Node
from handlers.api.convert import node_view
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import container_spec, leading_fleet, make_settings
from tests.fixtures.waiting import wait_for


def test_the_go_fields_mean_usage_and_the_new_ones_allocations() -> None:
    node = Node(node_id="n1", status="Ready", total_cpu=8.0, total_memory=16384)
    allocation = Allocation(node_id="n1")
    allocation.add("w1", 2000, 1024)
    view = node_view(node, allocation, alive=True, used=(500, 300))
    assert (view.available_cpu_cores, view.available_memory_mb) == (7.5, 16084)
    assert (view.used_cpu_cores, view.used_memory_mb, view.usage_reported) == (0.5, 300, True)
    assert (view.allocated_cpu_cores, view.allocated_memory_mb) == (2.0, 1024)
    assert (view.allocatable_cpu_cores, view.allocatable_memory_mb) == (6.0, 15360)
    unknown = node_view(node, allocation, alive=True)
    assert (unknown.available_cpu_cores, unknown.available_memory_mb) == (8.0, 16384)
    assert not unknown.usage_reported


async def test_list_nodes_shows_reported_usage_and_allocations(etcd_server, redis_server,
                                                               key_root, stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with leading_fleet(settings, 1) as (_sched, _fleet, stub):
        resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w", spec=container_spec(cpu_m=1000, mem_mb=512)))
        assert resp.success, resp.error_message

        async def shown() -> pb.NodeView | None:
            view = (await stub.ListNodes(pb.ListNodesRequest())).nodes[0]
            return view if view.usage_reported and view.used_cpu_cores > 0 else None

        view = await wait_for(shown, timeout=20, message="the agent's usage in ListNodes")
        assert view.allocated_cpu_cores == 1.0
        assert view.allocated_memory_mb == 512
        assert view.available_cpu_cores == view.total_cpu_cores - view.used_cpu_cores
        got = (await stub.GetNode(pb.GetNodeRequest(node_id=view.node_id))).node
        assert got.usage_reported
