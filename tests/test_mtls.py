"""mTLS end to end: the scheduler serving with client-certificate auth, the simulated agents
serving and calling with their own certificate, on real etcd and Redis.

What the Go version did is kept (every RPC needs a certificate from the CA; files reload when
they change; a broken reload keeps the last good files), and what it got wrong is not
(docs/compatibility.md, "Certificate authorization"): an agent's certificate may call only the
agent RPCs, and may speak only for the node at the host it names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from handlers.identity.authz import NodeBinding
from ops.sim.cli import add_sim_arguments, run_sim
from ops.sim.config import SimTls
from proto.persys.control.v1 import control_pb2 as pb
from proto.persys.control.v1 import control_pb2_grpc
from tests.fixtures.certs import Issued, TestCA
from tests.fixtures.harness import container_spec, make_settings, running_fleet, running_scheduler
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.slow


class Pki:
    """The CA, the scheduler's certificate, and the clients the tests present."""

    def __init__(self, directory: Path) -> None:
        self.ca = TestCA(directory / "ca")
        self.stranger_ca = TestCA(directory / "other", name="stranger-ca")
        self.scheduler = self.ca.issue("persys-scheduler", names=("127.0.0.1", "localhost"))
        self.agent = self.ca.issue("compute-agent", names=("127.0.0.1",))
        self.agent_elsewhere = self.ca.issue("compute-agent", names=("10.1.2.3", "node-far"))
        self.operator = self.ca.issue("persysctl")
        self.nameless = self.ca.issue("", names=("127.0.0.1",))
        self.stranger = self.stranger_ca.issue("compute-agent", names=("127.0.0.1",))
        # the scheduler's own files, which the reload test rewrites
        served = directory / "served"
        served.mkdir()
        self.served_ca = served / "ca.pem"
        self.served_cert = served / "scheduler.pem"
        self.served_key = served / "scheduler-key.pem"
        shutil.copy(self.ca.cert_path, self.served_ca)
        shutil.copy(self.scheduler.cert_path, self.served_cert)
        shutil.copy(self.scheduler.key_path, self.served_key)

    def sim_tls(self) -> SimTls:
        return SimTls(ca=self.ca.cert, cert=self.agent.cert, key=self.agent.key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def tls_settings(pki, etcd, redis, root, stream, **overrides):
    return make_settings(etcd, redis, root, stream, insecure=False,
                         tls_ca=str(pki.served_ca), tls_cert=str(pki.served_cert),
                         tls_key=str(pki.served_key), agent_tls_enabled=True,
                         **{"nodes_per_host": 8, **overrides})  # simulated agents share a host


def channel(address: str, ca: bytes, client: Issued | None) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        ca, client.key if client else None, client.cert if client else None)
    # a channel of its own: every test connection makes its own handshake
    return grpc.aio.secure_channel(address, creds,
                                   options=(("grpc.use_local_subchannel_pool", 1),))


class Clients:
    def __init__(self, address: str, pki: Pki) -> None:
        self.address = address
        self.pki = pki
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, client: Issued | None, ca: bytes | None = None
             ) -> control_pb2_grpc.AgentControlStub:
        ch = channel(self.address, ca or self.pki.ca.cert, client)
        self._channels.append(ch)
        return control_pb2_grpc.AgentControlStub(ch)

    async def healthy(self, client: Issued | None, ca: bytes | None = None) -> bool:
        """One health check on a new connection: False if the handshake fails."""
        ch = channel(self.address, ca or self.pki.ca.cert, client)
        code = grpc.StatusCode.OK
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=3)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        finally:
            await ch.close()
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), code
        return code == grpc.StatusCode.OK

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()


@pytest.fixture
async def tls_scheduler(pki, etcd_server, redis_server, key_root, stream_key
                        ) -> AsyncIterator[tuple[object, Clients]]:
    settings = tls_settings(pki, etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        clients = Clients(f"127.0.0.1:{sched.grpc_port}", pki)
        try:
            yield sched, clients
        finally:
            await clients.close()


async def ready_count(stub) -> int:
    nodes = (await stub.ListNodes(pb.ListNodesRequest(), timeout=5)).nodes
    return sum(1 for n in nodes if n.status == "Ready")


def refused_count(sched, method: str) -> float:
    return sched.metrics.calls_refused.labels(method)._value.get()


async def test_agents_register_and_run_workloads_over_mtls(pki, tls_scheduler):
    _, clients = tls_scheduler
    operator = clients.stub(pki.operator)
    async with running_fleet(clients.address, 2, tls=pki.sim_tls()) as fleet:
        await fleet.wait_registered()
        await wait_for(lambda: _at_least(ready_count(operator), 2), message="2 Ready nodes")
        resp = await operator.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="tls-web", spec=container_spec()), timeout=10)
        assert resp.success, resp.error_message

        async def running() -> str | None:
            w = (await operator.GetWorkload(pb.GetWorkloadRequest(workload_id="tls-web"),
                                            timeout=5)).workload
            return w.assigned_node_id if w.status == "Running" else None

        # the scheduler reached the agent over TLS with its own certificate
        node_id = await wait_for(running, message="tls-web Running")
        assert fleet.node(node_id).workload_state("tls-web") is not None
        assert fleet.counters.control["heartbeats_ok"] > 0
        assert fleet.counters.control["register_rejected"] == 0


async def _at_least(value_coro, want: int) -> bool:
    return await value_coro >= want


async def test_every_call_needs_a_certificate_from_the_ca(pki, tls_scheduler):
    _, clients = tls_scheduler
    assert await clients.healthy(pki.operator)
    assert await clients.healthy(pki.agent)  # health stays open to agents
    assert not await clients.healthy(None)
    assert not await clients.healthy(pki.stranger)


async def test_an_agent_certificate_calls_only_agent_rpcs(pki, tls_scheduler):
    sched, clients = tls_scheduler
    agent = clients.stub(pki.agent)
    before = refused_count(sched, "ApplyWorkload")
    calls = [
        agent.ApplyWorkload(pb.ApplyWorkloadRequest(workload_id="x", spec=container_spec())),
        agent.DrainNode(pb.DrainNodeRequest(node_id="sim-node-00001")),
        agent.GetBucketAccess(pb.GetBucketAccessRequest()),
        agent.ListNodes(pb.ListNodesRequest()),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "agent certificate" in info.value.details()
    assert refused_count(sched, "ApplyWorkload") == before + 1
    # a stream is refused the same way
    with pytest.raises(grpc.aio.AioRpcError) as streamed:
        async for _ in agent.WatchEvents(pb.WatchEventsRequest()):
            pass
    assert streamed.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # a certificate without a common name cannot be told from an agent's
    with pytest.raises(grpc.aio.AioRpcError) as nameless:
        await clients.stub(pki.nameless).ListNodes(pb.ListNodesRequest())
    assert nameless.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # the refused ApplyWorkload left nothing behind
    operator = clients.stub(pki.operator)
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await operator.GetWorkload(pb.GetWorkloadRequest(workload_id="x"), timeout=5)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    # handlers are wrapped once per method: who calls is still decided on every call
    await operator.ListNodes(pb.ListNodesRequest(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await agent.ListNodes(pb.ListNodesRequest(), timeout=5)
    assert again.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # and an agent's own RPC goes through
    reg = await agent.RegisterNode(pb.RegisterNodeRequest(
        node_id="tls-own", grpc_endpoint="127.0.0.1:1", capabilities=pb.NodeCapabilities(
            cpu_total_millicores=1000, memory_total_mb=1024)), timeout=5)
    assert reg.accepted, reg.reason


async def test_an_agent_cannot_speak_for_another_node(pki, tls_scheduler):
    sched, clients = tls_scheduler
    operator = clients.stub(pki.operator)
    intruder = clients.stub(pki.agent_elsewhere)
    async with running_fleet(clients.address, 1, tls=pki.sim_tls()) as fleet:
        await fleet.wait_registered()
        victim = fleet.nodes[0]
        await wait_for(lambda: _at_least(ready_count(operator), 1), message="node Ready")
        before = (await operator.GetNode(pb.GetNodeRequest(node_id=victim.node_id))).node

        caps = pb.NodeCapabilities(cpu_total_millicores=64000, memory_total_mb=1 << 20)
        # moving the live node to the intruder's host
        takeover = await intruder.RegisterNode(pb.RegisterNodeRequest(
            node_id=victim.node_id, grpc_endpoint="10.1.2.3:50051", capabilities=caps),
            timeout=5)
        assert not takeover.accepted
        assert takeover.reason.startswith("grpc_endpoint")
        assert "only once it is lost" in takeover.reason
        # claiming a host its certificate does not name
        forged = await intruder.RegisterNode(pb.RegisterNodeRequest(
            node_id="forged", grpc_endpoint="127.0.0.1:50051", capabilities=caps), timeout=5)
        assert not forged.accepted
        assert "not named by the client certificate" in forged.reason
        # heartbeating for it
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await intruder.Heartbeat(pb.HeartbeatRequest(node_id=victim.node_id), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert refused_count(sched, "Heartbeat") >= 1
        assert refused_count(sched, "RegisterNode") >= 2

        after = (await operator.GetNode(pb.GetNodeRequest(node_id=victim.node_id))).node
        assert after.grpc_endpoint == before.grpc_endpoint == victim.endpoint
        assert after.total_cpu_cores == before.total_cpu_cores
        listed = {n.node_id for n in (await operator.ListNodes(pb.ListNodesRequest())).nodes}
        assert "forged" not in listed
        # the intruder may still register a node of its own, at its own host
        own = await intruder.RegisterNode(pb.RegisterNodeRequest(
            node_id="far-node", grpc_endpoint="10.1.2.3:50051", capabilities=caps), timeout=5)
        assert own.accepted, own.reason

        # once the node is lost, another host may register it (a re-addressed machine). A
        # Draining node keeps its status when lost: its expired lease is what counts.
        drained = await operator.DrainNode(pb.DrainNodeRequest(node_id=victim.node_id))
        assert drained.accepted, drained
        await victim.crash()

        async def moved() -> bool:
            again = await intruder.RegisterNode(pb.RegisterNodeRequest(
                node_id=victim.node_id, grpc_endpoint="10.1.2.3:50051", capabilities=caps),
                timeout=5)
            return again.accepted

        await wait_for(moved, timeout=20, interval=0.5, message="registration once lost")
        node = (await operator.GetNode(pb.GetNodeRequest(node_id=victim.node_id))).node
        assert node.grpc_endpoint == "10.1.2.3:50051"


async def test_name_binding_and_an_operator_list(
        pki, etcd_server, redis_server, key_root, stream_key):
    settings = tls_settings(pki, etcd_server, redis_server, key_root, stream_key,
                            node_binding=NodeBinding.NAME, operator_cert_names=("persysctl",))
    async with running_scheduler(settings) as sched:
        clients = Clients(f"127.0.0.1:{sched.grpc_port}", pki)
        try:
            far = clients.stub(pki.agent_elsewhere)
            caps = pb.NodeCapabilities(cpu_total_millicores=1000, memory_total_mb=1024)
            ok = await far.RegisterNode(pb.RegisterNodeRequest(
                node_id="node-far", grpc_endpoint="10.1.2.3:1", capabilities=caps), timeout=5)
            assert ok.accepted, ok.reason
            # its own node, but at a host its certificate does not name (another agent's)
            elsewhere = await far.RegisterNode(pb.RegisterNodeRequest(
                node_id="node-far", grpc_endpoint="10.9.9.9:1", capabilities=caps), timeout=5)
            assert not elsewhere.accepted
            assert elsewhere.reason.startswith("grpc_endpoint")
            other = await far.RegisterNode(pb.RegisterNodeRequest(
                node_id="node-near", grpc_endpoint="10.1.2.3:1", capabilities=caps), timeout=5)
            assert not other.accepted
            assert other.reason.startswith("node_id")
            hb = await far.Heartbeat(pb.HeartbeatRequest(node_id="node-far"), timeout=5)
            assert hb.acknowledged
            # with SCHEDULER_OPERATOR_CERT_NAMES set, other names are refused the operator RPCs
            listed = await clients.stub(pki.operator).ListNodes(pb.ListNodesRequest(), timeout=5)
            assert "node-far" in {n.node_id for n in listed.nodes}
            gateway = clients.stub(pki.ca.issue("persys-gateway"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await gateway.ListNodes(pb.ListNodesRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "SCHEDULER_OPERATOR_CERT_NAMES" in info.value.details()
        finally:
            await clients.close()


async def test_certificate_files_reload_and_a_broken_reload_keeps_the_last_good(
        pki, tls_scheduler):
    _, clients = tls_scheduler
    assert await clients.healthy(pki.agent)
    # a new CA file takes effect at the next handshake: our agents' certificates now fail,
    # the stranger CA's pass
    shutil.copy(pki.stranger_ca.cert_path, pki.served_ca)
    _touch_later(pki.served_ca)
    await wait_for(lambda: _not(clients.healthy(pki.agent)), message="old CA refused")
    assert await clients.healthy(pki.stranger)
    # back to ours
    shutil.copy(pki.ca.cert_path, pki.served_ca)
    _touch_later(pki.served_ca)
    await wait_for(lambda: clients.healthy(pki.agent), message="our CA accepted again")
    # a half-written key and a key of another pair are not loaded: handshakes go on
    for broken in (pki.scheduler.key[: len(pki.scheduler.key) // 2], pki.operator.key):
        pki.served_key.write_bytes(broken)
        _touch_later(pki.served_key)
        assert await clients.healthy(pki.agent)
        assert await clients.healthy(pki.operator)
    shutil.copy(pki.scheduler.key_path, pki.served_key)
    _touch_later(pki.served_key)
    assert await clients.healthy(pki.agent)


async def _not(value_coro) -> bool:
    return not await value_coro


def _touch_later(path: Path) -> None:
    """Give the file a modification time unlike its last one, even within one clock tick."""
    stat = path.stat()
    ns = stat.st_mtime_ns + 1_000_000_000
    os.utime(path, ns=(ns, ns))


async def test_the_sim_command_speaks_mtls(pki, tls_scheduler, capsys):
    _, clients = tls_scheduler
    operator = clients.stub(pki.operator)
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args([
        "--scheduler", clients.address, "--nodes", "2", "--prefix", "tls-cli-",
        "--heartbeat-interval", "0.2", "--seed", "1",
        "--tls", str(pki.ca.cert_path), str(pki.agent.cert_path), str(pki.agent.key_path)])
    runner = asyncio.get_running_loop().create_task(run_sim(args))
    try:
        await wait_for(lambda: _at_least(ready_count(operator), 2), message="2 Ready nodes")
        os.kill(os.getpid(), signal.SIGTERM)  # run_sim's handler is installed by now
        async with asyncio.timeout(10):
            assert await runner == 0
    finally:
        if not runner.done():
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
    stopped = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")][-1]
    assert stopped["event"] == "sim_stopped"
    with pytest.raises(SystemExit, match="--tls"):
        await run_sim(parser.parse_args(["--scheduler", clients.address, "--tls", "/nonexistent",
                                         "/nonexistent", "/nonexistent"]))
