"""ApplyWorkload end to end: scheduler + 3 simulated nodes on real etcd and Redis."""

from __future__ import annotations

import base64
import json

import grpc
import pytest
import redis.asyncio as aioredis
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from eventsource.etcd import AsyncEtcd
from eventsource.keys import KeyLayout
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    container_spec,
    control_stub,
    make_settings,
    running_fleet,
    running_scheduler,
)
from tests.fixtures.waiting import wait_for


async def test_apply_runs_on_a_simulated_node(etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 3) as fleet, control_stub(address) as stub:
            await fleet.wait_registered()
            nodes = await wait_for(
                lambda: _ready_nodes(stub, 3), message="3 Ready nodes", timeout=10)
            assert len(nodes) == 3
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="web-1", spec=container_spec()))
            assert resp.success, resp.error_message

            async def running() -> bool:
                w = await stub.GetWorkload(pb.GetWorkloadRequest(workload_id="web-1"))
                return w.workload.status == "Running"

            await wait_for(running, message="web-1 Running", timeout=10)
            w = (await stub.GetWorkload(pb.GetWorkloadRequest(workload_id="web-1"))).workload
            holder = fleet.node(w.assigned_node_id)
            assert holder.workload_state("web-1") is not None

            async def events() -> set[str]:
                r = await stub.ListEvents(pb.ListEventsRequest(limit=100))
                return {e.type for e in r.events}

            seen = await wait_for(
                lambda: _has(events, {"NodeJoined", "WorkloadScheduled"}), timeout=10,
                message="NodeJoined and WorkloadScheduled events")
            assert seen


async def _ready_nodes(stub, want):
    r = await stub.ListNodes(pb.ListNodesRequest())
    ready = [n for n in r.nodes if n.status == "Ready"]
    return ready if len(ready) >= want else None


async def _has(fetch, wanted):
    got = await fetch()
    return got if wanted <= got else None


BAD_SPECS = [
    ("workload_id", pb.ApplyWorkloadRequest(workload_id="", spec=container_spec())),
    ("spec.resources.cpu_millicores",
     pb.ApplyWorkloadRequest(workload_id="bad-cpu", spec=container_spec(cpu_m=-1))),
    ("spec.resources.memory_mb",
     pb.ApplyWorkloadRequest(workload_id="bad-mem", spec=container_spec(mem_mb=-5))),
    ("spec.type", pb.ApplyWorkloadRequest(workload_id="bad-type", spec=pb.WorkloadSpec(
        type="unikernel", container=pb.ContainerSpec(image="x")))),
    ("spec.container.image", pb.ApplyWorkloadRequest(workload_id="no-image", spec=pb.WorkloadSpec(
        type="container", container=pb.ContainerSpec()))),
    ("spec", pb.ApplyWorkloadRequest(workload_id="huge", spec=pb.WorkloadSpec(
        type="container", container=pb.ContainerSpec(image="x", env={"BIG": "x" * 1_100_000})))),
    ("spec.compose.source_type", pb.ApplyWorkloadRequest(workload_id="git", spec=pb.WorkloadSpec(
        type="compose", compose=pb.ComposeSpec(source_type="git",
                                               git_repo="https://example.com/r.git")))),
    ("spec.container.privileged", pb.ApplyWorkloadRequest(workload_id="priv", spec=pb.WorkloadSpec(
        type="container", container=pb.ContainerSpec(image="x", privileged=True)))),
    ("spec.metadata[persys.vm_spec_b64].cloudInitConfig.password",
     pb.ApplyWorkloadRequest(workload_id="vm-pw", spec=pb.WorkloadSpec(type="vm", metadata={
         "persys.vm_spec_b64": base64.b64encode(json.dumps({
             "vcpus": 1, "memoryMb": 512,
             "cloudInitConfig": {"password": "hunter2"}}).encode()).decode()}))),
]


@pytest.mark.parametrize(("field", "request_"), BAD_SPECS, ids=[f for f, _ in BAD_SPECS])
async def test_bad_input_is_answered_in_band_and_writes_nothing(
    etcd_server, redis_server, key_root, stream_key, field, request_
):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched, control_stub(
        f"127.0.0.1:{sched.grpc_port}"
    ) as stub:
        resp = await stub.ApplyWorkload(request_)
        assert not resp.success
        assert resp.failure_reason == pb.INVALID_SPEC
        assert resp.error_message.startswith(field), resp.error_message
        etcd = AsyncEtcd([etcd_server.endpoint])
        try:
            layout = KeyLayout(key_root)
            for prefix in (layout.specs_prefix, layout.statuses_prefix,
                           layout.assignments_prefix, layout.allocations_prefix):
                page = await etcd.range_prefix(prefix, count_only=True)
                assert page.count == 0, prefix
            outbox, _ = await etcd.list_prefix(layout.outbox_prefix)
            assert not [kv for kv in outbox if b"Workload" in kv.value]
            events = await stub.ListEvents(pb.ListEventsRequest(limit=1000))
            assert not [e for e in events.events if e.type.startswith("Workload")]
        finally:
            etcd.close()


async def test_no_node_fits_gives_insufficient_resources(etcd_server, redis_server, key_root,
                                                         stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 2) as fleet, control_stub(address) as stub:
            await fleet.wait_registered()
            await wait_for(lambda: _ready_nodes(stub, 2), timeout=10)
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="giant", spec=container_spec(cpu_m=10_000_000)))
            assert not resp.success
            assert resp.failure_reason == pb.INSUFFICIENT_RESOURCES
            assert "insufficient cpu" in resp.error_message
            assert "sim-node-00001" in resp.error_message


async def test_reflection_lists_the_control_service(etcd_server, key_root, stream_key):
    settings = make_settings(etcd_server, None, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{sched.grpc_port}")
        try:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)

            async def requests():
                yield reflection_pb2.ServerReflectionRequest(list_services="")
                yield reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="persys.control.v1.AgentControl")

            answers = [a async for a in stub.ServerReflectionInfo(requests())]
            names = {s.name for s in answers[0].list_services_response.service}
            assert "persys.control.v1.AgentControl" in names
            from google.protobuf import descriptor_pb2

            files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                     for raw in answers[1].file_descriptor_response.file_descriptor_proto]
            methods = {m.name for f in files for s in f.service if s.name == "AgentControl"
                       for m in s.method}
            assert {"RegisterNode", "Heartbeat", "ApplyWorkload", "WatchEvents",
                    "ListEvents", "CreateBucket"} <= methods
        finally:
            await channel.close()


async def test_events_without_redis_fail_precondition(etcd_server, key_root, stream_key):
    settings = make_settings(etcd_server, None, key_root, stream_key)
    async with running_scheduler(settings) as sched, control_stub(
        f"127.0.0.1:{sched.grpc_port}"
    ) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListEvents(pb.ListEventsRequest())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "REDIS_ADDR" in err.value.details()


async def test_heartbeat_usage_reaches_redis_in_the_go_format(
        etcd_server, redis_server, key_root, stream_key):
    """Usage from heartbeats: the per-workload key (TTL) and one meter entry per snapshot."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    workload_id = f"usage-{key_root.rsplit('/', 1)[-1]}"
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 1) as fleet, control_stub(address) as stub:
            await fleet.wait_registered()
            await wait_for(lambda: _ready_nodes(stub, 1), message="a Ready node", timeout=10)
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id=workload_id, spec=container_spec()))
            assert resp.success, resp.error_message
            key = f"persys:scheduler:usage:{workload_id}"
            raw = await wait_for(lambda: client.get(key), message="usage key", timeout=10)
            usage = json.loads(raw)
            assert usage["workloadId"] == workload_id
            assert 0 < await client.ttl(key) <= 600

            async def meter_entries():
                entries = await client.xrange(settings.meter_stream)
                return [f for _, f in entries if f.get("workload_id") == workload_id] or None

            fields = (await wait_for(meter_entries, message="meter entry", timeout=10))[0]
            assert set(fields) == {"event_id", "node_id", "workload_id", "revision_id",
                                   "reported_at", "payload"}
            assert fields["node_id"] == fleet.nodes[0].node_id
            payload = json.loads(fields["payload"])
            assert payload["event_id"] == fields["event_id"]
            assert payload["usage"]["workloadId"] == workload_id
            assert payload["revision_id"] == fields["revision_id"] != ""
    await client.aclose()


async def test_every_rpc_is_counted_with_its_method_and_code(etcd_server, key_root, stream_key):
    """grpc_server_requests_total / _duration_seconds: unary and streaming, success and abort."""
    settings = make_settings(etcd_server, None, key_root, stream_key)
    async with running_scheduler(settings) as sched, control_stub(
        f"127.0.0.1:{sched.grpc_port}"
    ) as stub:
        await stub.ListNodes(pb.ListNodesRequest())
        await stub.ListNodes(pb.ListNodesRequest())
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.ListEvents(pb.ListEventsRequest())
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in stub.WatchEvents(pb.WatchEventsRequest()):
                pass
        registry = sched.metrics.registry

        def count(method: str, code: str) -> float:
            return registry.get_sample_value(
                "persys_scheduler_grpc_server_requests_total",
                {"method": f"/persys.control.v1.AgentControl/{method}", "code": code}) or 0.0

        # codes as the Go version labelled them (grpc-go's names)
        await wait_for(lambda: count("WatchEvents", "FailedPrecondition") == 1,
                       message="the ended stream was not counted")
        assert count("ListNodes", "OK") == 2
        assert count("ListEvents", "FailedPrecondition") == 1
        assert registry.get_sample_value(
            "persys_scheduler_grpc_server_request_duration_seconds_count",
            {"method": "/persys.control.v1.AgentControl/ListNodes", "code": "OK"}) == 2


async def test_a_node_cannot_report_state_or_usage_for_another_nodes_workload(
        etcd_server, redis_server, key_root, stream_key):
    """A heartbeat naming a workload that runs elsewhere changes neither its status nor its
    usage telemetry: one node's agent never acts for another."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 2) as fleet, control_stub(address) as stub:
            await fleet.wait_registered()
            await wait_for(lambda: _ready_nodes(stub, 2), message="2 Ready nodes", timeout=10)
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="victim", spec=container_spec()))
            assert resp.success, resp.error_message

            async def running() -> pb.WorkloadView | None:
                w = (await stub.GetWorkload(pb.GetWorkloadRequest(workload_id="victim")))
                return w.workload if w.workload.status == "Running" else None

            holder = (await wait_for(running, message="victim Running", timeout=10))
            other = next(n.node_id for n in fleet.nodes if n.node_id != holder.assigned_node_id)
            before = await client.xrevrange(settings.meter_stream, count=1)
            mark = before[0][0] if before else "0"
            forged = await stub.Heartbeat(pb.HeartbeatRequest(
                node_id=other,
                workload_statuses=[pb.WorkloadStatus(workload_id="victim", state="Failed",
                                                     message="forged")],
                workload_usage=[pb.WorkloadUsageSnapshot(workload_id="victim",
                                                         source="forged", cpu_percent=99)]))
            assert forged.acknowledged
            w = (await stub.GetWorkload(pb.GetWorkloadRequest(workload_id="victim"))).workload
            assert w.status == "Running"

            # telemetry is written in arrival order: once the holder's next snapshot is in the
            # meter stream, a forged one accepted before it would be there too
            async def holder_reported_since() -> list[dict[str, str]] | None:
                entries = [f for i, f in await client.xrange(settings.meter_stream, min=mark)
                           if i != mark]
                return entries if any(f["node_id"] == holder.assigned_node_id
                                      for f in entries) else None

            entries = await wait_for(holder_reported_since, timeout=10,
                                     message="the holder's next usage snapshot")
            assert all(f["node_id"] != other for f in entries)
            assert "forged" not in (await client.get(
                "persys:scheduler:usage:victim") or "")
    await client.aclose()


async def test_odd_agent_reports_are_bounded_and_never_fail_the_heartbeat(
        etcd_server, redis_server, key_root, stream_key):
    """A crash-looping workload's long message is recorded once, bounded; a usage snapshot
    with an impossible time or a NaN does not fail the heartbeat that carries it."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 1) as fleet, control_stub(address) as stub:
            await fleet.wait_registered()
            await wait_for(lambda: _ready_nodes(stub, 1), message="1 Ready node", timeout=10)
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="loud", spec=container_spec()))
            assert resp.success, resp.error_message
            await wait_for(lambda: (item := sched.cluster.statuses.get("loud")) is not None
                           and item.value.status == "Running", message="loud Running")
            node_id = fleet.nodes[0].node_id
            message = "stack trace line\n" * 400  # 6,800 characters, every heartbeat
            odd_usage = pb.WorkloadUsageSnapshot(
                workload_id="loud", source="agent", cpu_percent=float("nan"),
                collected_at=Timestamp(seconds=2**40))
            revisions = []
            for _ in range(2):
                answer = await stub.Heartbeat(pb.HeartbeatRequest(
                    node_id=node_id,
                    workload_statuses=[pb.WorkloadStatus(workload_id="loud", state="Running",
                                                         message=message, usage=odd_usage)],
                    workload_usage=[odd_usage]))
                assert answer.acknowledged
                item = sched.cluster.statuses.get("loud")
                assert item is not None
                revisions.append(item.mod_revision)
            # written by the first heartbeat (the handler waits for its own write), not again
            assert revisions[0] == revisions[1]
            assert item.value.logs.count("stack trace line") < 100
            assert len(item.value.logs) <= 4096


async def test_node_labels_and_taints_are_bounded_and_named_when_refused(
        etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched, control_stub(
            f"127.0.0.1:{sched.grpc_port}") as stub:
        caps = pb.NodeCapabilities(cpu_total_millicores=1000, memory_total_mb=1024)
        crowded = await stub.RegisterNode(pb.RegisterNodeRequest(
            node_id="n-crowded", grpc_endpoint="127.0.0.1:9", capabilities=caps,
            labels={f"k{i}": "v" for i in range(300)}))
        assert not crowded.accepted
        assert crowded.reason.startswith("labels: more than 256")
        ok = await stub.RegisterNode(pb.RegisterNodeRequest(
            node_id="n-1", grpc_endpoint="127.0.0.1:9", capabilities=caps))
        assert ok.accepted, ok.reason
        await wait_for(lambda: sched.cluster.nodes.get("n-1") is not None, message="n-1")
        before = sched.cluster.nodes.get("n-1")
        assert before is not None
        refused = [
            ("label.value", stub.SetNodeLabel(pb.SetNodeLabelRequest(
                node_id="n-1", key="tier", value="x" * 2000))),
            ("label.key", stub.SetNodeLabel(pb.SetNodeLabelRequest(
                node_id="n-1", key="k" * 300, value="x"))),
            ("taint.key", stub.TaintNode(pb.TaintNodeRequest(
                node_id="n-1", taint=pb.NodeTaint(key="k" * 300, effect="NoSchedule")))),
            ("effect", stub.UntaintNode(pb.UntaintNodeRequest(
                node_id="n-1", key="gpu", effect="Bogus"))),
        ]
        for field, call in refused:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert (err.value.details() or "").startswith(field), err.value.details()
        # nothing the refusals carried was written (the record itself may be rewritten
        # meanwhile: n-1 sends no heartbeats, so the monitor marks it NotReady once its 5 s
        # lease expires, which a slow machine reaches within this test)
        after = sched.cluster.nodes.get("n-1").value
        assert (after.labels, after.taints) == (before.value.labels, before.value.taints)
        assert sched.cluster.nodes.get("n-crowded") is None


async def test_a_registered_node_is_placeable_as_soon_as_registration_answers(
        etcd_server, redis_server, key_root, stream_key):
    """Read-your-writes: RegisterNode answers only once this replica's projections show the
    node (an ApplyWorkload right after a fleet registered was once answered "no nodes
    registered")."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched, \
            control_stub(f"127.0.0.1:{sched.grpc_port}") as stub:
        for i in range(30):
            node_id = f"ryw-{i:02d}"
            reg = await stub.RegisterNode(pb.RegisterNodeRequest(
                node_id=node_id, grpc_endpoint=f"127.0.0.1:{20000 + i}",
                capabilities=pb.NodeCapabilities(cpu_total_millicores=4000,
                                                 memory_total_mb=4096)), timeout=5)
            assert reg.accepted, reg.reason
            # no await between the answer and the checks: the projections already show it
            assert sched.cluster.nodes.get(node_id) is not None, f"{node_id} not projected"
            assert sched.cluster.alive.get(node_id) is not None, f"{node_id} not alive"
