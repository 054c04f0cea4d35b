"""No path lets one node's agent act for another node: registration at another agent's
endpoint, a ListWorkloads answer claiming another node's workload, per-node certificates with
operator rights, and listings of made-up ids that would grow etcd.

Real etcd, Redis and scheduler, mTLS both ways (tests/test_mtls.py's PKI pattern).
"""

from __future__ import annotations

import types
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from handlers.identity.authz import NodeBinding
from handlers.reconcile.registration import loops_of
from ops.sim.config import SimTls
from proto.persys.agent.v1 import agent_pb2, agent_pb2_grpc
from proto.persys.control.v1 import control_pb2 as pb
from proto.persys.control.v1 import control_pb2_grpc
from tests.fixtures.certs import Issued, TestCA
from tests.fixtures.harness import container_spec, make_settings, running_fleet, running_scheduler
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.slow

CAPS = pb.NodeCapabilities(cpu_total_millicores=64000, memory_total_mb=1 << 20,
                           supported_workload_types=["container"])


class Pki:
    def __init__(self, d: Path) -> None:
        self.ca = TestCA(d / "ca")
        self.scheduler = self.ca.issue("persys-scheduler", names=("127.0.0.1", "localhost"))
        self.operator = self.ca.issue("persysctl")
        # the honest node's certificate: its host, and its node id (for the name binding)
        self.victim = self.ca.issue("compute-agent", names=("127.0.0.1", "sim-node-00001"))
        # the malicious agent's certificate: names neither the victim's host nor its id
        self.evil = self.ca.issue("compute-agent", names=("127.0.0.2", "evil-node"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("review-pki"))


def settings_for(pki, etcd, redis, root, stream, **overrides):
    return make_settings(
        etcd, redis, root, stream, insecure=False, tls_ca=str(pki.ca.cert_path),
        tls_cert=str(pki.scheduler.cert_path), tls_key=str(pki.scheduler.key_path),
        agent_tls_enabled=True, reconcile_interval_s=3600.0, drift_detect_interval_s=0.0,
        heartbeat_interval_s=10, node_lease_ttl_s=120, **overrides)


def stub(address: str, pki: Pki, client: Issued) -> tuple[grpc.aio.Channel,
                                                         control_pb2_grpc.AgentControlStub]:
    creds = grpc.ssl_channel_credentials(pki.ca.cert, client.key, client.cert)
    ch = grpc.aio.secure_channel(address, creds, options=(("grpc.use_local_subchannel_pool", 1),))
    return ch, control_pb2_grpc.AgentControlStub(ch)


def like_a_go_agent(node) -> None:
    """The Go compute-agent does not look at x-persys-node-id (only the simulator does)."""
    async def admit(self, method, context):
        self._counters.rpcs[method] += 1
        return None
    node._admit = types.MethodType(admit, node)


class EvilAgent(agent_pb2_grpc.AgentServiceServicer):
    """A malicious agent at its own host: claims to hold ``claimed`` and records applies."""

    def __init__(self, claimed: list[str]) -> None:
        self.claimed = claimed
        self.applies: list[agent_pb2.ApplyWorkloadRequest] = []

    async def ListWorkloads(self, request, context):
        return agent_pb2.ListWorkloadsResponse(workloads=[agent_pb2.WorkloadStatus(
            id=w, type=agent_pb2.WORKLOAD_TYPE_CONTAINER, revision_id="forged",
            desired_state=agent_pb2.DESIRED_STATE_RUNNING,
            actual_state=agent_pb2.ACTUAL_STATE_RUNNING) for w in self.claimed])

    async def ApplyWorkload(self, request, context):
        self.applies.append(request)
        return agent_pb2.ApplyWorkloadResponse(applied=True, status=agent_pb2.WorkloadStatus(
            id=request.id, actual_state=agent_pb2.ACTUAL_STATE_RUNNING))

    async def DeleteWorkload(self, request, context):
        return agent_pb2.DeleteWorkloadResponse(success=True)


async def serve_agent(agent: EvilAgent, cert: Issued, pki: Pki) -> tuple[grpc.aio.Server, int]:
    """``agent`` served with mTLS at its own host (127.0.0.2), as a node's agent is."""
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(agent, server)
    port = server.add_secure_port("127.0.0.2:0", grpc.ssl_server_credentials(
        [(cert.key, cert.cert)], root_certificates=pki.ca.cert, require_client_auth=True))
    await server.start()
    return server, port


async def placed_on_victim(sched, operator, victim, wid, spec) -> None:
    resp = await operator.ApplyWorkload(pb.ApplyWorkloadRequest(workload_id=wid, spec=spec),
                                        timeout=10)
    assert resp.success, resp.error_message
    await wait_for(lambda: victim.workload_state(wid) == "Running", message="running on victim")
    await wait_for(lambda: sched.leader.is_leader, timeout=15, message="leader")


async def cycle(sched, **kw):
    """One reconcile cycle of our own, once the automatic one (run on leadership gain) ended."""
    async def once():
        report = await loops_of(sched).reconcile.run_once(**kw)
        return None if report.skipped else report
    return await wait_for(once, message="a reconcile cycle of our own")


def owner(sched, wid: str) -> str:
    st = sched.cluster.statuses.get(wid).value
    return st.node_id or st.assigned_node


async def test_name_binding_refuses_a_node_registered_at_another_nodes_agent(
        pki, etcd_server, redis_server, key_root, stream_key):
    """SCHEDULER_NODE_BINDING=name checks only the node id: the endpoint is free. An agent
    registers its own node id at the victim's endpoint; the drift pass then sees the victim's
    workloads "on" the attacker's node at the owner's endpoint and re-binds them to it
    (rebind_assignment_to_rotated_node_id)."""
    s = settings_for(pki, etcd_server, redis_server, key_root, stream_key,
                     node_binding=NodeBinding.NAME)
    async with running_scheduler(s) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        op_ch, operator = stub(address, pki, pki.operator)
        evil_ch, evil = stub(address, pki, pki.evil)
        tls = SimTls(ca=pki.ca.cert, cert=pki.victim.cert, key=pki.victim.key)
        try:
            async with running_fleet(address, 1, tls=tls) as fleet:
                await fleet.wait_registered()
                victim = fleet.nodes[0]
                like_a_go_agent(victim)
                await placed_on_victim(sched, operator, victim, "w-victim", container_spec())

                reg = await evil.RegisterNode(pb.RegisterNodeRequest(
                    node_id="evil-node", grpc_endpoint=victim.endpoint, capabilities=CAPS),
                    timeout=5)
                await wait_for(lambda: sched.cluster.nodes.get("evil-node") is not None
                               or not reg.accepted, message="evil-node in projection")
                await cycle(sched, drift=True)

                assert owner(sched, "w-victim") == victim.node_id, (
                    f"registration accepted={reg.accepted}: the victim's workload now belongs "
                    f"to {owner(sched, 'w-victim')!r}")
        finally:
            await op_ch.close()
            await evil_ch.close()


async def test_a_listworkloads_answer_never_takes_over_another_nodes_workload(
        pki, etcd_server, redis_server, key_root, stream_key):
    """Default endpoint binding. A malicious agent, registered legitimately at its own host
    (127.0.0.2), answers ListWorkloads with the id of a workload that belongs to another
    node. When the owner does not list it at a drift pass (it restarted and lost it), the
    workload is re-assigned to the attacker (reassign_to_reporting_node), without a fit,
    taint or selector check; the next cycle sends the attacker the full spec."""
    s = settings_for(pki, etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(s) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        op_ch, operator = stub(address, pki, pki.operator)
        evil_ch, evil = stub(address, pki, pki.evil)
        agent = EvilAgent(["w-secret"])
        server, port = await serve_agent(agent, pki.evil, pki)
        tls = SimTls(ca=pki.ca.cert, cert=pki.victim.cert, key=pki.victim.key)
        try:
            async with running_fleet(address, 1, tls=tls) as fleet:
                await fleet.wait_registered()
                victim = fleet.nodes[0]
                spec = container_spec()
                spec.container.env["DB_PASSWORD"] = "hunter2"
                await placed_on_victim(sched, operator, victim, "w-secret", spec)

                reg = await evil.RegisterNode(pb.RegisterNodeRequest(
                    node_id="evil", grpc_endpoint=f"127.0.0.2:{port}", capabilities=CAPS),
                    timeout=5)
                assert reg.accepted, reg.reason  # its own host: allowed
                await wait_for(lambda: sched.cluster.nodes.get("evil") is not None)
                # the honest agent restarts and has lost its containers (a host reboot)
                await victim.crash()
                await victim.restart(keep_workloads=False)
                await wait_for(lambda: not victim.workload_ids(), message="victim empty")

                later = sched.clock.now() + timedelta(minutes=5)  # past the reapply guard
                await cycle(sched, drift=True, now=later)
                await cycle(sched, now=later)

                leaked = [a for a in agent.applies if a.id == "w-secret"]
                assert owner(sched, "w-secret") == victim.node_id
                assert not leaked, f"the attacker received {dict(leaked[0].spec.container.env)}"
        finally:
            await server.stop(None)
            await op_ch.close()
            await evil_ch.close()


async def test_name_binding_takes_agent_certificates_only(
        pki, etcd_server, redis_server, key_root, stream_key):
    """A per-node certificate whose common name is not an agent's would hold operator rights
    (drain any node): the name binding refuses it; an agent certificate naming the node works
    and holds agent rights only."""
    s = settings_for(pki, etcd_server, redis_server, key_root, stream_key,
                     node_binding=NodeBinding.NAME)
    node_a = pki.ca.issue("node-a", names=("127.0.0.1", "node-a"))
    agent_b = pki.ca.issue("compute-agent", names=("127.0.0.1", "node-b"))
    async with running_scheduler(s) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        a_ch, a = stub(address, pki, node_a)
        b_ch, b = stub(address, pki, agent_b)
        try:
            refused = await a.RegisterNode(pb.RegisterNodeRequest(
                node_id="node-a", grpc_endpoint="127.0.0.1:1", capabilities=CAPS), timeout=5)
            assert not refused.accepted
            assert "SCHEDULER_AGENT_CERT_NAMES" in refused.reason
            ok = await b.RegisterNode(pb.RegisterNodeRequest(
                node_id="node-b", grpc_endpoint="127.0.0.1:1", capabilities=CAPS), timeout=5)
            assert ok.accepted, ok.reason
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await b.DrainNode(pb.DrainNodeRequest(node_id="node-b"), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert sched.cluster.nodes.get("node-a") is None
        finally:
            await a_ch.close()
            await b_ch.close()


async def test_one_agents_listing_of_made_up_ids_leaves_no_records(
        pki, etcd_server, redis_server, key_root, stream_key):
    """Every id an agent lists that the scheduler does not know becomes a drift record
    (/drifts/<node>/<id>/orphan_on_agent) that is never deleted, plus an event: a single
    agent answering ListWorkloads with fresh made-up ids each drift pass fills etcd."""
    s = settings_for(pki, etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(s) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        evil_ch, evil = stub(address, pki, pki.evil)
        agent = EvilAgent([])
        server, port = await serve_agent(agent, pki.evil, pki)
        try:
            reg = await evil.RegisterNode(pb.RegisterNodeRequest(
                node_id="evil", grpc_endpoint=f"127.0.0.2:{port}", capabilities=CAPS),
                timeout=5)
            assert reg.accepted, reg.reason
            await wait_for(lambda: sched.cluster.nodes.get("evil") is not None)
            await wait_for(lambda: sched.leader.is_leader, timeout=15, message="leader")
            for batch in range(2):
                agent.claimed = [f"junk-{batch}-{i:04d}-" + "x" * 200 for i in range(400)]
                await cycle(sched, drift=True)
            kvs, _ = await sched.etcd.list_prefix(sched.layout.drifts_prefix)
            # each pass classifies at most MAX_ORPHANS_PER_NODE of them, and an id the
            # scheduler does not know gets an event but never a record
            assert not kvs, f"{len(kvs)} drift records from one agent's listings"
        finally:
            await server.stop(None)
            await evil_ch.close()
