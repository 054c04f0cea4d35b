"""What one agent certificate may claim, against a real scheduler with mTLS: in ``endpoint``
binding one live node per agent endpoint host (more only by SCHEDULER_NODES_PER_HOST), no
capacity beyond the configured maxima, and a capacity change of a live node is an event."""

from __future__ import annotations

import grpc
import pytest

from handlers.identity.authz import NodeBinding, refuse_crowded_host
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.waiting import wait_for
from tests.test_agent_identity import (  # noqa: F401 - pki is a fixture
    CAPS,
    EvilAgent,
    pki,
    serve_agent,
    settings_for,
    stub,
)

pytestmark = pytest.mark.slow


def caps(cpu_m: int = 4000, mem_mb: int = 8192) -> pb.NodeCapabilities:
    return pb.NodeCapabilities(cpu_total_millicores=cpu_m, memory_total_mb=mem_mb,
                               supported_workload_types=["container"])


def test_the_host_rule_is_a_pure_decision() -> None:
    kw = {"node_id": "b", "host": "10.0.0.1", "limit": 1}
    assert refuse_crowded_host(NodeBinding.ENDPOINT, live_at_host=[], **kw) is None
    assert refuse_crowded_host(NodeBinding.ENDPOINT, live_at_host=["b"], **kw) is None
    assert "SCHEDULER_NODES_PER_HOST" in (
        refuse_crowded_host(NodeBinding.ENDPOINT, live_at_host=["a"], **kw) or "")
    assert refuse_crowded_host(NodeBinding.NAME, live_at_host=["a"], **kw) is None
    assert refuse_crowded_host(NodeBinding.OFF, live_at_host=["a"], **kw) is None


async def test_one_certificate_cannot_capture_placements(
        pki, etcd_server, redis_server, key_root, stream_key):  # noqa: F811
    from tests.fixtures.harness import running_scheduler

    s = settings_for(pki, etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(s) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        op_ch, operator = stub(address, pki, pki.operator)
        evil_ch, evil = stub(address, pki, pki.evil)
        # a real agent at the host, so the reconcile pass finds the node reachable (Ready)
        server, port = await serve_agent(EvilAgent([]), pki.evil, pki)
        try:
            first = await evil.RegisterNode(pb.RegisterNodeRequest(
                node_id="evil-1", grpc_endpoint=f"127.0.0.2:{port}", capabilities=CAPS),
                timeout=5)
            assert first.accepted, first.reason
            for node_id, other_port in (("evil-2", port + 1), ("evil-3", port)):
                more = await evil.RegisterNode(pb.RegisterNodeRequest(
                    node_id=node_id, grpc_endpoint=f"127.0.0.2:{other_port}",
                    capabilities=CAPS),
                    timeout=5)
                assert not more.accepted
                assert "SCHEDULER_NODES_PER_HOST" in more.reason, more.reason
                assert "'evil-1'" in more.reason
                assert sched.cluster.nodes.get(node_id) is None
            # the node itself re-registers freely
            assert (await evil.RegisterNode(pb.RegisterNodeRequest(
                node_id="evil-1", grpc_endpoint=f"127.0.0.2:{port}", capabilities=CAPS),
                timeout=5)).accepted

            # capacity claims beyond the maxima: refused in-band, nothing written
            for claim, field in ((caps(cpu_m=1 << 62), "capabilities.cpu_total_millicores"),
                                 (caps(mem_mb=1 << 62), "capabilities.memory_total_mb")):
                resp = await evil.RegisterNode(pb.RegisterNodeRequest(
                    node_id="evil-1", grpc_endpoint=f"127.0.0.2:{port}", capabilities=claim),
                    timeout=5)
                assert not resp.accepted
                assert resp.reason.startswith(field), resp.reason
                assert "SCHEDULER_NODE_MAX_" in resp.reason
            node = sched.cluster.nodes.get("evil-1")
            assert node is not None
            assert node.value.total_cpu == CAPS.cpu_total_millicores / 1000

            # a capacity change of the live node is an event
            changed = await evil.RegisterNode(pb.RegisterNodeRequest(
                node_id="evil-1", grpc_endpoint=f"127.0.0.2:{port}",
                capabilities=caps(cpu_m=8000, mem_mb=16384)), timeout=5)
            assert changed.accepted, changed.reason

            async def capacity_events() -> list[pb.SchedulerEventView]:
                page = await operator.ListEvents(pb.ListEventsRequest(
                    type="NodeCapacityChanged", node_id="evil-1"), timeout=5)
                return list(page.events)

            events = await wait_for(capacity_events, message="a NodeCapacityChanged event")
            assert len(events) == 1
            assert events[0].details["cpu_millicores"] == "8000"
            assert events[0].details["previous_cpu_millicores"] == str(
                CAPS.cpu_total_millicores)
            assert events[0].details["memory_mb"] == "16384"
        finally:
            await server.stop(None)
            await op_ch.close()
            await evil_ch.close()


async def test_more_nodes_per_host_only_by_the_setting(
        pki, etcd_server, redis_server, key_root, stream_key):  # noqa: F811
    from tests.fixtures.harness import running_scheduler

    s = settings_for(pki, etcd_server, redis_server, key_root, stream_key, nodes_per_host=2)
    async with running_scheduler(s) as sched:
        evil_ch, evil = stub(f"127.0.0.1:{sched.grpc_port}", pki, pki.evil)
        servers = [await serve_agent(EvilAgent([]), pki.evil, pki) for _ in range(3)]
        try:
            answers = [await evil.RegisterNode(pb.RegisterNodeRequest(
                node_id=f"evil-{i}", grpc_endpoint=f"127.0.0.2:{port}",
                capabilities=CAPS), timeout=5) for i, (_, port) in enumerate(servers)]
            assert [a.accepted for a in answers] == [True, True, False], [
                a.reason for a in answers]
        finally:
            for server, _ in servers:
                await server.stop(None)
            await evil_ch.close()


@pytest.mark.parametrize(("subject", "names"), [
    ("CN=a", ["a"]), ("CN=compute-agent,CN=persysctl", ["compute-agent", "persysctl"]),
    ("O=x+CN=a,OU=y", ["a"]), (r"CN=a\,CN=b", [r"a\,CN=b"]), ("O=only", []),
    ("2.5.4.3=a,cn=b", ["a", "b"])])
def test_subject_common_names(subject: str, names: list[str]) -> None:
    from handlers.identity.authz import subject_common_names

    assert subject_common_names(subject) == names


async def test_a_subject_with_two_common_names_is_refused(
        pki, etcd_server, redis_server, key_root, stream_key):  # noqa: F811
    """grpc reads the first CN, Go's x509 the last: a certificate with an operator's CN and an
    agent's is neither, whichever comes first; refused for operator and agent RPCs alike."""
    from tests.fixtures.harness import running_scheduler

    s = settings_for(pki, etcd_server, redis_server, key_root, stream_key)
    twins = [pki.ca.issue("persysctl", names=("127.0.0.2",),
                          more_common_names=("compute-agent",)),
             pki.ca.issue("compute-agent", names=("127.0.0.2",),
                          more_common_names=("persysctl",))]
    async with running_scheduler(s) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        for twin in twins:
            ch, caller = stub(address, pki, twin)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await caller.ListNodes(pb.ListNodesRequest(), timeout=5)
                assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "2 common names" in (caught.value.details() or "")
                reg = await caller.RegisterNode(pb.RegisterNodeRequest(
                    node_id="twin", grpc_endpoint="127.0.0.2:50051", capabilities=CAPS),
                    timeout=5)
                assert not reg.accepted
                assert "2 common names" in reg.reason
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await caller.Heartbeat(pb.HeartbeatRequest(node_id="twin"), timeout=5)
                assert caught.value.code() in (grpc.StatusCode.PERMISSION_DENIED,
                                               grpc.StatusCode.NOT_FOUND)
            finally:
                await ch.close()
        assert sched.cluster.nodes.get("twin") is None
        # a certificate with one common name still works
        op_ch, operator = stub(address, pki, pki.operator)
        try:
            await operator.ListNodes(pb.ListNodesRequest(), timeout=5)
        finally:
            await op_ch.close()


def test_one_host_has_one_key() -> None:
    from projections.cluster import HostIndex

    assert HostIndex.key("[::ffff:127.0.0.2]") == HostIndex.key("127.0.0.2") == "127.0.0.2"
    assert HostIndex.key("[0:0::1]") == HostIndex.key("::1")
    assert HostIndex.key("Agent-1.Example.com.") == "agent-1.example.com"


async def test_two_replicas_cannot_both_add_a_node_to_one_host(
        pki, etcd_server, redis_server, key_root, stream_key):  # noqa: F811
    """Two new node ids at one host, registered at once through two replicas: each replica's
    projections show the host free, and the host's claim key lets only one of them in."""
    import asyncio
    from dataclasses import replace

    from tests.fixtures.harness import running_scheduler

    s = settings_for(pki, etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(replace(s, instance_id="replica-a")) as a, \
            running_scheduler(replace(s, instance_id="replica-b")) as b:
        channels = []
        try:
            callers = []
            for sched in (a, b):
                ch, evil = stub(f"127.0.0.1:{sched.grpc_port}", pki, pki.evil)
                channels.append(ch)
                callers.append(evil)
            answers = await asyncio.gather(*(caller.RegisterNode(pb.RegisterNodeRequest(
                node_id=f"racer-{i}", grpc_endpoint=f"127.0.0.2:{50051 + i}",
                capabilities=CAPS), timeout=10) for i, caller in enumerate(callers)))
            assert sorted(x.accepted for x in answers) == [False, True], [
                x.reason for x in answers]
            refused = next(x for x in answers if not x.accepted)
            assert "SCHEDULER_NODES_PER_HOST" in refused.reason, refused.reason
            winner = f"racer-{[x.accepted for x in answers].index(True)}"
            for sched in (a, b):
                await wait_for(lambda sched=sched: sched.cluster.nodes.get(winner) is not None,
                               message="the winner in both replicas' projections")
                assert [n for n in sched.cluster.nodes.items if n.startswith("racer-")] == [
                    winner]
        finally:
            for ch in channels:
                await ch.close()
