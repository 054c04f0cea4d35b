"""Workloads using standalone disks (``persys.disk.ids``) end to end: scheduler, simulated
fleet, real etcd. See handlers/storage/attachments.py for the rules."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from eventsource.etcd import Put
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

pytestmark = pytest.mark.slow
FIELD = "spec.metadata[persys.disk.ids]"


def with_disks(workload_id: str, *disk_ids: str) -> pb.ApplyWorkloadRequest:
    spec = container_spec()
    spec.metadata["persys.disk.ids"] = ",".join(disk_ids)
    return pb.ApplyWorkloadRequest(workload_id=workload_id, spec=spec)


@pytest.fixture
async def cluster(etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        # the nodes mount network disks too, so a workload using one may move
        behaviour = NodeBehaviour(apply_latency_s=0.05, storage_drivers=["local", "nfs"])
        async with (running_fleet(address, 3, behaviour=behaviour) as fleet,
                    control_stub(address) as stub):
            await fleet.wait_registered()

            async def ready() -> bool:
                nodes = (await stub.ListNodes(pb.ListNodesRequest())).nodes
                return sum(n.status == "Ready" for n in nodes) == 3

            await wait_for(ready, message="3 Ready nodes")
            yield sched, fleet, stub


async def assigned(stub, workload_id):
    w = await stub.GetWorkload(pb.GetWorkloadRequest(workload_id=workload_id))
    return w.workload.assigned_node_id


async def get_disk(stub, disk_id):
    return (await stub.GetDisk(pb.GetDiskRequest(disk_id=disk_id))).disk


async def test_a_workload_takes_its_disk_and_gives_it_back(cluster):
    sched, _, stub = cluster
    disk = (await stub.CreateDisk(pb.CreateDiskRequest(name="db-data", driver="local",
                                                       size_gb=10))).disk
    resp = await stub.ApplyWorkload(with_disks("db", disk.id))
    assert resp.success, resp.error_message
    node_id = await assigned(stub, "db")
    got = await get_disk(stub, disk.id)
    assert (list(got.workload_refs), got.node_id, got.phase) == (["db"], node_id, "Attached")
    spec = sched.cluster.specs.get("db").value
    assert [(v["name"], v["disk_id"]) for v in spec.managed_volumes] == [("db-data", disk.id)]

    async def running() -> bool:
        w = await stub.GetWorkload(pb.GetWorkloadRequest(workload_id="db"))
        return w.workload.status == "Running"

    await wait_for(running, message="db Running")

    # a ReadWriteOnce disk has one user
    second = await stub.ApplyWorkload(with_disks("db-2", disk.id))
    assert not second.success
    assert second.failure_reason == pb.INVALID_SPEC
    assert second.error_message.startswith(FIELD)
    assert "used by workload 'db'" in second.error_message
    # nor can an existing workload change its disks
    other = (await stub.CreateDisk(pb.CreateDiskRequest(name="other", driver="local"))).disk
    changed = await stub.ApplyWorkload(with_disks("db", other.id))
    assert not changed.success
    assert changed.error_message.startswith(FIELD)
    # an update that keeps them keeps the volume
    same = with_disks("db", disk.id)
    same.spec.container.image = "nginx:2"
    updated = await stub.ApplyWorkload(same)
    assert updated.success, updated.error_message
    assert [v["disk_id"] for v in sched.cluster.specs.get("db").value.managed_volumes] == [
        disk.id]

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.DeleteDisk(pb.DeleteDiskRequest(disk_id=disk.id))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    assert (await stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id="db"))).success

    async def released() -> bool:
        d = await get_disk(stub, disk.id)
        return not d.workload_refs and d.phase == "Provisioned"

    await wait_for(released, timeout=15, message="disk released by the deleted workload")
    assert (await get_disk(stub, disk.id)).node_id == node_id  # its data stays there
    assert (await stub.DeleteDisk(pb.DeleteDiskRequest(disk_id=disk.id))).success


async def test_a_pinned_local_disk_places_the_workload_on_its_node(cluster):
    sched, fleet, stub = cluster
    target = fleet.nodes[2].node_id
    disk = (await stub.CreateDisk(pb.CreateDiskRequest(name="pinned", driver="local",
                                                       node_id=target))).disk
    for i in range(3):  # whatever the workload id would hash to
        resp = await stub.ApplyWorkload(with_disks(f"pinned-{i}", disk.id))
        if i == 0:
            assert resp.success, resp.error_message
            assert await assigned(stub, "pinned-0") == target
        else:
            assert not resp.success  # ReadWriteOnce
    # CreateDisk refuses a node that is not registered: a disk whose node was removed since
    gone = (await stub.CreateDisk(pb.CreateDiskRequest(name="elsewhere", driver="local",
                                                       node_id=target))).disk
    kv = await sched.etcd.get(sched.layout.volume(gone.id))
    record = json.loads(kv.value)
    record["nodeId"] = "no-such-node"
    await sched.etcd.txn([], [Put(kv.key, json.dumps(record).encode())])
    resp = await stub.ApplyWorkload(with_disks("stranded", gone.id))
    assert not resp.success
    assert "no-such-node" in resp.error_message
    compose = with_disks("composed", disk.id)
    compose.spec.ClearField("container")
    compose.spec.type = "compose"
    compose.spec.compose.inline_yaml = "services: {}"
    refused = await stub.ApplyWorkload(compose)
    assert not refused.success
    assert "compose workloads cannot use disks" in refused.error_message
    missing = await stub.ApplyWorkload(with_disks("ghost", "disk-missing"))
    assert not missing.success
    assert missing.error_message.startswith(FIELD)
    assert "not found" in missing.error_message


async def test_a_drained_workload_takes_its_network_disk_along(cluster):
    _, _, stub = cluster
    disk = (await stub.CreateDisk(pb.CreateDiskRequest(name="shared-data", driver="nfs",
                                                       size_gb=5))).disk
    resp = await stub.ApplyWorkload(with_disks("mover", disk.id))
    assert resp.success, resp.error_message
    first = await assigned(stub, "mover")
    assert list((await get_disk(stub, disk.id)).attached_nodes) == [first]

    await stub.DrainNode(pb.DrainNodeRequest(node_id=first, reason="maintenance"))

    async def moved_away() -> bool:
        return await assigned(stub, "mover") not in ("", first)

    await wait_for(moved_away, message="mover relocated off the drained node")
    second = await assigned(stub, "mover")
    got = await get_disk(stub, disk.id)
    assert list(got.attached_nodes) == [second]
    assert list(got.workload_refs) == ["mover"]


async def test_concurrent_workloads_for_one_disk_get_it_once(cluster):
    sched, _, stub = cluster
    disk = (await stub.CreateDisk(pb.CreateDiskRequest(name="contended", driver="local"))).disk
    answers = await asyncio.gather(*(stub.ApplyWorkload(with_disks(f"c-{i}", disk.id))
                                     for i in range(8)))
    winners = [f"c-{i}" for i, a in enumerate(answers) if a.success]
    assert len(winners) == 1, [a.error_message for a in answers]
    assert list((await get_disk(stub, disk.id)).workload_refs) == winners
    for i, answer in enumerate(answers):
        if not answer.success:
            assert sched.cluster.specs.get(f"c-{i}") is None


async def test_a_workload_that_named_its_disk_before_attachment_releases_it(cluster):
    """A record written before disks were attached here (or by the Go version): the disk
    lists the workload, its metadata names the disk, its spec has no volume for it."""
    sched, _, stub = cluster
    disk = (await stub.CreateDisk(pb.CreateDiskRequest(name="legacy", driver="nfs",
                                                       access_mode="ReadWriteMany"))).disk
    assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
        workload_id="old", spec=container_spec()))).success

    def names_disk(status):
        status.metadata["persys.disk.ids"] = disk.id
        return []

    await sched.writer.update_status("old", names_disk)
    kv = await sched.etcd.get(sched.layout.volume(disk.id))
    record = json.loads(kv.value)
    record["workloadRefs"] = ["old"]
    await sched.etcd.txn([], [Put(kv.key, json.dumps(record).encode())])
    # re-applying with the disk it names is no change of disks
    again = with_disks("old", disk.id)
    again.spec.container.image = "nginx:3"
    assert (await stub.ApplyWorkload(again)).success
    assert (await stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id="old"))).success

    async def released() -> bool:
        return not (await get_disk(stub, disk.id)).workload_refs

    await wait_for(released, timeout=15, message="the older record's disk released")


async def test_a_disk_name_never_reaches_a_second_workload_past_its_access_mode(cluster):
    """The agent knows a volume by driver and name: an inline volume with a disk's name, or a
    disk made again under the name of one force-deleted while attached, would be that disk's
    backing volume on a second workload. Both are refused, naming the field."""
    _, _, stub = cluster
    disk = (await stub.CreateDisk(pb.CreateDiskRequest(name="pgdata", driver="nfs"))).disk
    assert (await stub.ApplyWorkload(with_disks("w1", disk.id))).success
    spec = container_spec()
    spec.container.managed_volumes.add(name="pgdata", driver="nfs", size_gb=1)
    inline = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(workload_id="w2", spec=spec))
    assert not inline.success
    assert inline.failure_reason == pb.INVALID_SPEC
    assert inline.error_message.startswith("spec.managed_volumes[0].name:")
    await stub.DeleteDisk(pb.DeleteDiskRequest(disk_id=disk.id, force=True))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.CreateDisk(pb.CreateDiskRequest(name="pgdata", driver="nfs"))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "w1" in (caught.value.details() or "")
    # another driver's volume of that name is another volume
    other = await stub.CreateDisk(pb.CreateDiskRequest(name="pgdata", driver="local"))
    assert other.disk.id
