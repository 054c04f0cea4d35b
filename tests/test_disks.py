"""The disk API over real etcd."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from eventsource.etcd import Put
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import control_stub, make_settings, running_scheduler
from tests.fixtures.waiting import wait_for


@pytest.fixture
async def api(etcd_server, key_root, stream_key):
    async with running_scheduler(make_settings(etcd_server, None, key_root, stream_key)) as s, \
            control_stub(f"127.0.0.1:{s.grpc_port}") as stub:
        yield s, stub


async def test_disk_lifecycle(api):
    sched, stub = api
    # a local disk is pinned to a registered node
    assert (await stub.RegisterNode(pb.RegisterNodeRequest(
        node_id="n1", grpc_endpoint="127.0.0.1:50051",
        capabilities=pb.NodeCapabilities(cpu_total_millicores=1000, memory_total_mb=1024)))
    ).accepted
    await wait_for(lambda: sched.cluster.nodes.get("n1") is not None)
    created = (await stub.CreateDisk(pb.CreateDiskRequest(name="data-1", driver="ceph_rbd",
                                                          size_gb=20))).disk
    assert created.id.startswith("disk-")
    assert (created.driver, created.phase, created.device) == ("ceph-rbd", "Available",
                                                               "rbd:data-1")
    assert (created.fs_type, created.access_mode, created.retain_policy,
            created.mount_path) == ("ext4", "ReadWriteOnce", "Delete", "/data")
    local = (await stub.CreateDisk(pb.CreateDiskRequest(name="scratch", driver="local",
                                                        node_id="n1"))).disk
    assert (local.phase, local.size_gb, local.node_id) == ("Pending", 1, "n1")
    listed = (await stub.ListDisks(pb.ListDisksRequest())).disks
    assert {d.name for d in listed} == {"data-1", "scratch"}
    got = (await stub.GetDisk(pb.GetDiskRequest(disk_id=created.id))).disk
    assert got == created
    assert (await stub.DeleteDisk(pb.DeleteDiskRequest(disk_id=created.id))).success
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetDisk(pb.GetDiskRequest(disk_id=created.id))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("request_", "field"), [
    (pb.CreateDiskRequest(name="", driver="local"), "name"),
    (pb.CreateDiskRequest(name="Bad Name!", driver="local"), "name"),
    (pb.CreateDiskRequest(name="d", driver=""), "driver"),
    (pb.CreateDiskRequest(name="d", driver="floppy"), "driver"),
    (pb.CreateDiskRequest(name="d", driver="local", size_gb=-1), "size_gb"),
    (pb.CreateDiskRequest(name="d", driver="nfs", node_id="n1"), "node_id"),
    (pb.CreateDiskRequest(name="d", driver="local", retain_policy="Maybe"), "retain_policy"),
])
async def test_bad_disk_requests_name_the_field(api, request_, field):
    _, stub = api
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CreateDisk(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)


async def test_referenced_disk_needs_force_and_unknown_is_not_found(api):
    sched, stub = api
    disk = (await stub.CreateDisk(pb.CreateDiskRequest(name="shared", driver="nfs"))).disk
    key = sched.layout.volume(disk.id)
    record = json.loads((await sched.etcd.get(key)).value)
    record["workloadRefs"] = ["w-1"]
    await sched.etcd.txn([], [Put(key, json.dumps(record).encode())])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.DeleteDisk(pb.DeleteDiskRequest(disk_id=disk.id))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (await stub.DeleteDisk(pb.DeleteDiskRequest(disk_id=disk.id, force=True))).success
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.DeleteDisk(pb.DeleteDiskRequest(disk_id="disk-nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert (await stub.CreateDisk(pb.CreateDiskRequest(name="shared", driver="nfs"))).disk.id
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CreateDisk(pb.CreateDiskRequest(name="shared", driver="nfs"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_concurrent_creates_of_one_name_make_one_disk(api):
    _sched, stub = api

    async def create(name: str) -> str:
        try:
            await stub.CreateDisk(pb.CreateDiskRequest(name=name, driver="nfs", size_gb=1))
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "OK"

    # eight callers race for one name (and two others take names of their own)
    codes = await asyncio.gather(*(create("shared") for _ in range(8)),
                                 create("own-1"), create("own-2"))
    assert sorted(codes[:8]) == ["ALREADY_EXISTS"] * 7 + ["OK"]
    assert codes[8:] == ["OK", "OK"]
    listed = (await stub.ListDisks(pb.ListDisksRequest())).disks
    assert sorted(d.name for d in listed) == ["own-1", "own-2", "shared"]
