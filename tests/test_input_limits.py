"""Inputs that must be answered, not crash a handler or grow a record without bound: each is
refused naming its field (in-band for the persys RPCs, a status code for the new ones)."""

from __future__ import annotations

import asyncio
import base64

import grpc
import pytest

from handlers.app.server import Scheduler
from handlers.nodes.reports import USAGE_TEXT_MAX_CHARS
from handlers.nodes.reports import usage_dict as _usage_dict
from handlers.settings.config import load_settings
from handlers.specs.fields import LABELS_MAX, InvalidSpec
from handlers.specs.validation import parse_apply
from ops.cli import build_parser
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    control_stub,
    make_settings,
    running_fleet,
    running_scheduler,
)
from tests.fixtures.waiting import wait_for


def register_request(node_id: str, *, endpoint: str = "127.0.0.1:50051",
                     labels: dict[str, str] | None = None,
                     drivers: list[str] | None = None) -> pb.RegisterNodeRequest:
    return pb.RegisterNodeRequest(
        node_id=node_id, grpc_endpoint=endpoint, labels=labels or {},
        capabilities=pb.NodeCapabilities(cpu_total_millicores=4000, memory_total_mb=8192,
                                         supported_workload_types=["container"],
                                         supported_storage_drivers=drivers or []))


def test_usage_free_text_is_capped() -> None:
    usage = _usage_dict(pb.WorkloadUsageSnapshot(workload_id="w1", type="t" * 3_000_000,
                                                 source="\x01" * 3_000_000))
    assert len(usage["type"]) == USAGE_TEXT_MAX_CHARS
    assert len(usage["source"]) == USAGE_TEXT_MAX_CHARS


def test_a_redis_password_with_url_characters_is_taken_as_is() -> None:
    password = "Zk3s9/Qx+7=#a%41?"
    settings = load_settings({"REDIS_ADDR": "127.0.0.1:1", "REDIS_PASSWORD": password,
                              "ETCD_ENDPOINTS": "127.0.0.1:2"}, insecure=True)
    scheduler = Scheduler(settings)
    assert scheduler.redis is not None
    assert scheduler.redis.connection_pool.connection_kwargs["password"] == password


@pytest.mark.parametrize(("argv", "insecure"), [
    (["serve"], False), (["serve", "-insecure"], True), (["serve", "-insecure=true"], True),
    (["serve", "-insecure=false"], False), (["serve", "--insecure=1"], True)])
def test_insecure_flag_reads_like_go(argv: list[str], insecure: bool) -> None:
    assert build_parser().parse_args(argv).insecure is insecure


def test_a_deeply_nested_vm_spec_is_an_invalid_spec() -> None:
    nested = ('{"disks":' + "[" * 50_000).encode()
    req = pb.ApplyWorkloadRequest(
        workload_id="vm-1", spec=pb.WorkloadSpec(type="vm", metadata={
            "persys.vm_spec_b64": base64.b64encode(nested).decode()}))
    with pytest.raises(InvalidSpec) as caught:
        parse_apply(req, created_at="2026-12-01T00:00:00Z")
    assert caught.value.field == "spec.metadata[persys.vm_spec_b64]"


async def test_registration_inputs_are_bounded(etcd_server, redis_server, key_root,
                                               stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched, \
            control_stub(f"127.0.0.1:{sched.grpc_port}") as stub:
        resp = await stub.RegisterNode(register_request("n1", endpoint="127.0.0.1:5\u00b2"))
        assert not resp.accepted
        assert resp.reason.startswith("grpc_endpoint:")
        resp = await stub.RegisterNode(register_request("n1", drivers=["d" * 65]))
        assert not resp.accepted
        assert "supported_storage_drivers" in resp.reason
        # labels merge with those stored: the total stays bounded
        first = {f"a{i}": "v" for i in range(LABELS_MAX)}
        assert (await stub.RegisterNode(register_request("n1", labels=first))).accepted
        more = await stub.RegisterNode(register_request(
            "n1", labels={f"b{i}": "v" for i in range(10)}))
        assert not more.accepted
        assert more.reason.startswith("labels:")
        await wait_for(lambda: sched.cluster.nodes.get("n1") is not None)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SetNodeLabel(pb.SetNodeLabelRequest(node_id="n1", key="one-more",
                                                           value="v"))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "labels already" in (caught.value.details() or "")
        # an existing label can still change
        changed = await stub.SetNodeLabel(pb.SetNodeLabelRequest(node_id="n1", key="a1",
                                                                 value="w"))
        assert changed.accepted


async def test_reads_answer_unavailable_while_etcd_is_down(etcd_private, redis_server,
                                                           key_root, stream_key) -> None:
    settings = make_settings(etcd_private, redis_server, key_root, stream_key,
                             etcd_timeout_s=1.0)
    async with running_scheduler(settings) as sched, \
            control_stub(f"127.0.0.1:{sched.grpc_port}") as stub:
        await asyncio.to_thread(etcd_private.pause)
        try:
            for call in (stub.GetNode(pb.GetNodeRequest(node_id="nobody")),
                         stub.GetWorkload(pb.GetWorkloadRequest(workload_id="nothing"))):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        finally:
            await asyncio.to_thread(etcd_private.resume)


async def test_workload_records_that_would_not_fit_etcd_are_invalid_specs(
        etcd_server, redis_server, key_root, stream_key) -> None:
    """The request limit counts protobuf bytes; JSON escapes control characters sixfold, so a
    spec under it can still be too large to store. And updates merge their metadata into the
    status: it stays bounded instead of growing until no write of the workload fits."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched, \
            running_fleet(f"127.0.0.1:{sched.grpc_port}", 1) as fleet, \
            control_stub(f"127.0.0.1:{sched.grpc_port}") as stub:
        # a real (simulated) agent: the reconcile loop marks a node it cannot list NotReady
        await fleet.wait_registered()
        await wait_for(lambda: len(sched.cluster.alive.items) == 1)
        spec = pb.WorkloadSpec(type="container", container=pb.ContainerSpec(
            image="busybox:1", env={"BLOB": "\x01" * 300_000}),
            resources=pb.ResourceRequirements(cpu_millicores=100, memory_mb=64))
        resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(workload_id="w-big",
                                                                spec=spec))
        assert not resp.success
        assert resp.failure_reason == pb.INVALID_SPEC
        assert resp.error_message.startswith("spec:"), resp.error_message
        assert sched.cluster.specs.get("w-big") is None
        base = pb.WorkloadSpec(type="container", container=pb.ContainerSpec(image="busybox:1"),
                               resources=pb.ResourceRequirements(cpu_millicores=100,
                                                                 memory_mb=64))
        answers = []
        for round_ in range(5):
            base.container.image = f"busybox:1.{round_}"
            base.metadata.clear()
            base.metadata.update({f"k{round_}-{i}": "v" for i in range(150)})
            answers.append(await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="w-meta", spec=base)))
        assert [a.success for a in answers[:3]] == [True, True, True]
        assert not answers[3].success
        assert answers[3].failure_reason == pb.INVALID_SPEC
        assert answers[3].error_message.startswith("spec.metadata:")


def test_the_redis_password_is_not_in_the_settings_repr() -> None:
    from handlers.settings.config import load_settings

    settings = load_settings({"REDIS_ADDR": "127.0.0.1:6379", "REDIS_PASSWORD": "s3cr3t-pw"},
                             insecure=True)
    assert settings.redis_password == "s3cr3t-pw"
    assert "s3cr3t-pw" not in repr(settings)
