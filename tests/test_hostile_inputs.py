"""Inputs a hostile caller sends, against real servers: each is refused naming its field and
the reason (INVALID_ARGUMENT, or in-band for the persys RPCs that answer in-band), nothing is
written, and no answer is UNAVAILABLE or carries etcd's text."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from handlers.specs.fields import InvalidSpec, check_mount_path, validate_host
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import control_stub, make_settings, running_scheduler
from tests.fixtures.waiting import wait_for
from tests.test_input_limits import register_request


@pytest.mark.parametrize("host", [
    "a\x00b", "a\nb", "a..b", ".a", "a.", "evil\u202eexample", "a b", "-a", "[::1", "[x]",
    "a" * 254, "x.y..", "zero\u200bwidth"])
def test_hosts_that_are_not_hosts_are_refused(host: str) -> None:
    if host == "a.":  # a fully qualified name with its root dot is a host
        assert validate_host("grpc_endpoint", host) == host
        return
    with pytest.raises(InvalidSpec) as caught:
        validate_host("grpc_endpoint", host)
    assert caught.value.field == "grpc_endpoint"


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "::1", "agent-1.example.com",
                                  "node_7.local", "localhost"])
def test_hosts_are_taken(host: str) -> None:
    assert validate_host("grpc_endpoint", host) == host


@pytest.mark.parametrize(("path", "why"), [
    ("data", "absolute"), ("/a/../etc", "'..'"), ("/a\x00b", "control"),
    ("/a\nb", "control"), ("/" + "a" * 5000, "longer")])
def test_mount_paths_are_checked(path: str, why: str) -> None:
    with pytest.raises(InvalidSpec) as caught:
        check_mount_path("mount_path", path)
    assert why in caught.value.reason


async def _refused(call: object, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert (caught.value.details() or "").startswith(field), caught.value.details()


async def test_every_field_is_checked_at_the_edge(etcd_server, redis_server, key_root,
                                                  stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched, \
            control_stub(f"127.0.0.1:{sched.grpc_port}") as stub:
        for host in ("a\x00b", "a\nb", "a..b", "x\u202egro.live"):
            resp = await stub.RegisterNode(register_request("n-bad", endpoint=f"{host}:50051"))
            assert not resp.accepted
            assert resp.reason.startswith("grpc_endpoint:"), resp.reason
        resp = await stub.RegisterNode(register_request("n-bad", labels={"": "v"}))
        assert not resp.accepted
        assert resp.reason.startswith("labels[].key:"), resp.reason
        assert sched.cluster.nodes.get("n-bad") is None
        assert (await stub.RegisterNode(register_request("n1"))).accepted
        await wait_for(lambda: sched.cluster.nodes.get("n1") is not None)

        await _refused(stub.DrainNode(pb.DrainNodeRequest(node_id="n1", reason="r" * 100_000)),
                       "reason:")
        await _refused(stub.DrainNode(pb.DrainNodeRequest(node_id="n1",
                                                          reason="r" * 1_000_000)), "reason:")
        await _refused(stub.UndrainNode(pb.UndrainNodeRequest(node_id="n1", reason="\x00")),
                       "reason:")
        node = sched.cluster.nodes.get("n1")
        assert node is not None
        assert node.value.status != "Draining"
        assert len(node.value.status_reason) < 1024
        await _refused(stub.DeleteNodeLabel(pb.DeleteNodeLabelRequest(
            node_id="n1", key="scheduler_shard")), "key:")
        assert "scheduler_shard" in sched.cluster.nodes.get("n1").value.labels  # type: ignore
        await _refused(stub.DeleteNodeLabel(pb.DeleteNodeLabelRequest(node_id="n1", key=" ")),
                       "key:")
        await _refused(stub.GetNode(pb.GetNodeRequest(node_id="n" * 3_000_000)), "node_id:")
        await _refused(stub.GetWorkload(pb.GetWorkloadRequest(workload_id="w\x00")),
                       "workload_id:")

        # disks
        big_id = "d" * 3 * 1024 * 1024
        await _refused(stub.GetDisk(pb.GetDiskRequest(disk_id=big_id)), "disk_id:")
        await _refused(stub.DeleteDisk(pb.DeleteDiskRequest(disk_id=big_id)), "disk_id:")

        def disk(**fields: object) -> pb.CreateDiskRequest:
            base: dict[str, object] = {"name": "d1", "driver": "local", "size_gb": 10}
            base.update(fields)
            return pb.CreateDiskRequest(**base)  # type: ignore[arg-type]

        for fields, name in (
                ({"node_id": "nobody"}, "node_id:"),
                ({"node_id": "n\x00"}, "node_id:"),
                ({"mount_path": "relative/path"}, "mount_path:"),
                ({"mount_path": "/data/../../etc"}, "mount_path:"),
                ({"mount_path": "/data\x00"}, "mount_path:"),
                ({"size_gb": 2**63 - 1}, "size_gb:"),
                ({"fs_type": "ext4; rm -rf /"}, "fs_type:")):
            await _refused(stub.CreateDisk(disk(**fields)), name)
        assert list((await stub.ListDisks(pb.ListDisksRequest())).disks) == []
        made = await stub.CreateDisk(disk(node_id="n1", mount_path="/srv/d1"))
        assert made.disk.node_id == "n1"

        # event filters
        await _refused(stub.ListEvents(pb.ListEventsRequest(node_id="n" * 10_000)), "node_id:")


async def test_a_list_events_page_stays_under_4_mib(etcd_server, redis_server, key_root,
                                                    stream_key) -> None:
    """3,000 events of 2.6 kB each are 8 MB: the page ends at 3 MiB, and reading on after its
    last id gets the rest, none twice."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             redis_event_max_entries=10_000)
    async with running_scheduler(settings) as sched, \
            control_stub(f"127.0.0.1:{sched.grpc_port}") as stub:
        nodes = [f"n{i}" for i in range(10)]
        for node_id in nodes:
            assert (await stub.RegisterNode(register_request(node_id))).accepted
        await wait_for(lambda: all(sched.cluster.nodes.get(n) for n in nodes))

        async def label(node_id: str) -> None:
            for i in range(300):
                await stub.SetNodeLabel(pb.SetNodeLabelRequest(
                    node_id=node_id, key="k" * 250, value="ab"[i % 2] * 1024))

        await asyncio.gather(*(label(n) for n in nodes))

        async def relayed() -> bool:
            return bool(await sched.event_log.length() >= 3010)

        await wait_for(relayed, timeout=60, message="the events were not relayed")
        first = await stub.ListEvents(pb.ListEventsRequest(limit=10_000))
        everything = first.ByteSize()
        assert everything <= 3 * 1024 * 1024
        assert 1000 < len(first.events) < 3000, len(first.events)
        seen = [e.id for e in first.events]
        while True:
            page = await stub.ListEvents(pb.ListEventsRequest(limit=10_000,
                                                              after_id=seen[-1]))
            assert page.ByteSize() <= 3 * 1024 * 1024
            if not page.events:
                break
            everything += page.ByteSize()
            seen += [e.id for e in page.events]
        assert len(seen) == len(set(seen))
        assert everything > 4_000_000
        assert len(seen) >= 3000


async def test_the_metrics_endpoint_answers_431_to_oversized_headers(
        etcd_server, redis_server, key_root, stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        for headers in (b"X-Big: " + b"a" * 70_000 + b"\r\n",  # one line over the buffer
                        b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(100))):
            reader, writer = await asyncio.open_connection("127.0.0.1", sched.http.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        reader, writer = await asyncio.open_connection("127.0.0.1", sched.http.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 OK")


async def test_a_malformed_body_is_invalid_argument_and_one_log_line(
        etcd_server, redis_server, key_root, stream_key, caplog) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{sched.grpc_port}")
        try:
            caplog.set_level(logging.WARNING)
            for method, streams in (("GetNode", False), ("RegisterNode", False),
                                    ("WatchEvents", True)):
                path = f"/persys.control.v1.AgentControl/{method}"
                for _ in range(20):
                    if streams:
                        call = channel.unary_stream(path)(b"\xff\xff\xff\x0f\x08")
                        with pytest.raises(grpc.aio.AioRpcError) as caught:
                            async for _item in call:
                                pass
                    else:
                        with pytest.raises(grpc.aio.AioRpcError) as caught:
                            await channel.unary_unary(path)(b"\xff\xff\xff\x0f\x08")
                    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "not a valid" in (caught.value.details() or "")
            # a well-formed call still works
            ok = await channel.unary_unary(
                "/persys.control.v1.AgentControl/GetClusterSummary",
                response_deserializer=pb.GetClusterSummaryResponse.FromString)(b"")
            assert ok.total_nodes == 0
        finally:
            await channel.close()
    lines = [r for r in caplog.records if "malformed request body" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
