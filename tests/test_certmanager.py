"""The scheduler's certificate from Vault PKI (handlers/cluster/certificates.py), against a real
OpenBao.

The PKI engine is mounted per test at a unique path with a root CA and a role that issues
client-and-server certificates, as vault-manager sets up for persys services.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import stat
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from eventsource.metrics import Metrics
from handlers.agents.pool import AgentError, AgentPool, TlsFiles, is_handshake_failure
from handlers.cluster.certificates import CertConfig, CertManager, load_cert_config, rotate_at
from handlers.settings.buckets import VaultConfig
from handlers.vault.client import VaultKV
from ops.openbao import OpenBaoProcess
from proto.persys.agent.v1 import agent_pb2
from tests.fixtures.certs import TestCA
from tests.fixtures.storage import openbao_server
from tests.fixtures.waiting import wait_for

__all__ = ["openbao_server"]

ROLE = "persys-scheduler"


# -- against OpenBao ----------------------------------------------------------------------------

@pytest.fixture
def pki_mount(openbao_server: OpenBaoProcess) -> Iterator[str]:
    """A PKI engine with a root CA and the ``persys-scheduler`` role, unique to the test."""
    bao = openbao_server
    mount = f"pki-{uuid.uuid4().hex[:10]}"
    bao.api("POST", f"sys/mounts/{mount}", {"type": "pki", "config": {"max_lease_ttl": "87600h"}})
    bao.api("POST", f"{mount}/root/generate/internal",
            {"common_name": "persys-test-root", "ttl": "87600h", "key_type": "rsa"})
    bao.api("POST", f"{mount}/roles/{ROLE}", {
        "allow_any_name": True, "allow_ip_sans": True, "server_flag": True, "client_flag": True,
        "max_ttl": "72h", "key_type": "rsa", "key_bits": 2048})
    yield mount
    bao.api("DELETE", f"sys/mounts/{mount}")


def _config(bao: OpenBaoProcess, mount: str, tmp_path: Path, **overrides: object) -> CertConfig:
    values: dict[str, object] = {
        "vault": VaultConfig(addr=bao.addr, token=bao.root_token), "mount": mount, "role": ROLE,
        "ttl_s": 3600.0, "retry_interval_s": 0.2,
        "cert_path": str(tmp_path / "certs" / "scheduler.crt"),
        "key_path": str(tmp_path / "certs" / "scheduler-key.key"),
        "ca_path": str(tmp_path / "certs" / "ca.pem")}
    values.update(overrides)
    return CertConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
async def vault(openbao_server: OpenBaoProcess) -> AsyncIterator[VaultKV]:
    client = VaultKV(VaultConfig(addr=openbao_server.addr, token=openbao_server.root_token),
                     workers=1)
    yield client
    await client.close()


def _read(*paths: str) -> tuple[bytes, ...]:
    return tuple(Path(p).read_bytes() for p in paths)


def _write(files: dict[str, bytes]) -> None:
    for path, data in files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)


def _count(metrics: Metrics, why: str, result: str) -> float:
    value = metrics.registry.get_sample_value("persys_scheduler_cert_rotations_total",
                                              {"why": why, "result": result})
    return value or 0.0


async def test_the_issued_files_are_a_working_mtls_set_and_the_key_is_private(
        openbao_server: OpenBaoProcess, pki_mount: str, vault: VaultKV, tmp_path: Path) -> None:
    config = _config(openbao_server, pki_mount, tmp_path)
    metrics = Metrics()
    manager = CertManager(config, vault, metrics)

    assert await manager.ensure()

    assert manager.current is not None
    assert manager.current.serial
    assert stat.S_IMODE(os.stat(config.key_path).st_mode) == 0o600
    assert _count(metrics, "startup", "ok") == 1
    assert "PRIVATE KEY" not in repr(manager.current)
    assert not [p for p in (tmp_path / "certs").iterdir() if p.name.startswith(".")], \
        "temporary files left behind"
    # the three files serve and authenticate a TLS client, both ways
    ca, cert, key = _read(config.ca_path, config.cert_path, config.key_path)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True))
    await server.start()
    try:
        async with grpc.aio.secure_channel(
                f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca, key, cert)) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)



async def test_an_agent_dialing_persys_external_ip_accepts_the_issued_certificate(
        openbao_server: OpenBaoProcess, pki_mount: str, vault: VaultKV, tmp_path: Path) -> None:
    bao = openbao_server
    env = {"PERSYS_VAULT_ADDR": bao.addr, "PERSYS_VAULT_TOKEN": bao.root_token,
           "PERSYS_VAULT_PKI_MOUNT": pki_mount, "PERSYS_EXTERNAL_IP": "203.0.113.7"}
    config = load_cert_config(env, cert_path=str(tmp_path / "s.crt"),
                              key_path=str(tmp_path / "s.key"), ca_path=str(tmp_path / "ca.pem"),
                              advertise_ip="10.0.0.5")
    assert await CertManager(config, vault, Metrics()).ensure()

    sans = ssl._ssl._test_decode_cert(config.cert_path)["subjectAltName"]  # type: ignore[attr-defined]
    assert {("IP Address", "203.0.113.7"), ("IP Address", "10.0.0.5"),
            ("IP Address", "127.0.0.1")} <= set(sans), sans
    # what the agent does: dial the external address (here a loopback server standing in for
    # it) and verify the scheduler's certificate against that IP
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(config.cert_path, config.key_path)
    server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", 0, ssl=served)
    port = server.sockets[0].getsockname()[1]
    try:
        agent = ssl.create_default_context(cafile=config.ca_path)
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=agent,
                                                  server_hostname="203.0.113.7")
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()

async def test_forced_rotations_share_one_issue_and_are_rate_limited(
        openbao_server: OpenBaoProcess, pki_mount: str, vault: VaultKV, tmp_path: Path) -> None:
    metrics = Metrics()
    manager = CertManager(_config(openbao_server, pki_mount, tmp_path), vault, metrics)
    assert await manager.ensure()
    first = manager.current
    assert first is not None

    answers = await asyncio.gather(*(manager.force_rotate() for _ in range(5)))

    assert answers == [True] * 5
    assert _count(metrics, "forced", "ok") == 1, "concurrent callers must share one issue"
    assert manager.current is not None
    assert manager.current.serial != first.serial
    assert await manager.force_rotate() is False, "a second forced issue within the interval"
    assert _count(metrics, "forced", "ok") == 1


async def test_the_schedule_rotates_at_80_percent_of_the_lifetime(
        openbao_server: OpenBaoProcess, pki_mount: str, vault: VaultKV, tmp_path: Path) -> None:
    metrics = Metrics()
    offset = [0.0]
    manager = CertManager(_config(openbao_server, pki_mount, tmp_path), vault, metrics,
                          wall=lambda: __import__("time").time() + offset[0])
    assert await manager.ensure()
    first = manager.current
    assert first is not None
    runner = asyncio.create_task(manager.run())
    try:
        assert _count(metrics, "scheduled", "ok") == 0
        # the clock reaches 80 % of the hour-long certificate
        offset[0] = rotate_at(first.issued_at, first.expires_at) - first.issued_at + 1.0
        manager._wake.set()  # re-read the (moved) clock now instead of in an hour
        await wait_for(lambda: _count(metrics, "scheduled", "ok") >= 1, timeout=20,
                       message="no scheduled rotation")
        assert manager.current is not None
        assert manager.current.serial != first.serial
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await manager.aclose()


async def test_without_vault_a_start_waits_for_usable_files_or_stops_when_asked(
        tmp_path: Path) -> None:
    unreachable = VaultConfig(addr="http://127.0.0.1:9", token="t", timeout_s=2.0)
    config = CertConfig(vault=unreachable, retry_interval_s=0.2,
                        cert_path=str(tmp_path / "c.pem"), key_path=str(tmp_path / "k.pem"),
                        ca_path=str(tmp_path / "ca.pem"))
    metrics = Metrics()
    manager = CertManager(config, VaultKV(unreachable, workers=1), metrics)
    try:
        stop = asyncio.Event()
        waiting = asyncio.create_task(manager.ensure(stop=stop))
        await wait_for(lambda: _count(metrics, "startup", "failed") >= 2,
                       message="retries while Vault is down and there are no files")
        assert not waiting.done()
        _write({config.cert_path: b"garbage\n", config.key_path: b"garbage\n",
                config.ca_path: b"garbage\n"})
        await wait_for(lambda: _count(metrics, "startup", "failed") >= 4,
                       message="unusable files are not a certificate")
        assert not waiting.done()
        stop.set()
        assert await asyncio.wait_for(waiting, timeout=5) is False

        ca = TestCA(tmp_path / "ca")
        pair = ca.issue("persys-scheduler", names=("127.0.0.1",))
        _write({config.cert_path: pair.cert, config.key_path: pair.key,
                config.ca_path: ca.cert})
        assert await manager.ensure() is True, "usable files already there: start with them"
    finally:
        await manager.aclose()


async def test_a_stop_ends_the_start_during_a_vault_call_that_hangs(tmp_path: Path) -> None:
    """A Vault that accepts connections and never answers holds a call for seconds; asking the
    process to stop must not wait for it."""
    accepted = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        accepted.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    hanging = VaultConfig(addr=f"http://127.0.0.1:{port}", token="t", timeout_s=30.0)
    config = CertConfig(vault=hanging, retry_interval_s=0.2, cert_path=str(tmp_path / "c"),
                        key_path=str(tmp_path / "k"), ca_path=str(tmp_path / "a"))
    manager = CertManager(config, VaultKV(hanging, workers=1), Metrics())
    stop = asyncio.Event()
    try:
        waiting = asyncio.create_task(manager.ensure(stop=stop))
        await asyncio.wait_for(accepted.wait(), timeout=10)
        stop.set()
        assert await asyncio.wait_for(waiting, timeout=2) is False
    finally:
        for writer in held:
            writer.close()
        server.close()
        await manager.aclose()


async def _agent(bao: OpenBaoProcess, mount: str, handler) -> tuple[grpc.aio.Server, int, bytes]:
    """An agent whose certificate comes from Vault's CA and that requires client certificates
    from that CA; ``handler`` answers ListWorkloads."""
    issued = bao.api("POST", f"{mount}/issue/{ROLE}", {
        "common_name": "compute-agent", "ip_sans": "127.0.0.1", "ttl": "1h"})["data"]
    vault_ca = issued["issuing_ca"].encode()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "persys.agent.v1.AgentService",
        {"ListWorkloads": grpc.unary_unary_rpc_method_handler(handler)}),))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(issued["private_key"].encode(), issued["certificate"].encode())],
        root_certificates=vault_ca, require_client_auth=True))
    await server.start()
    return server, port, vault_ca


async def test_an_agent_that_refuses_our_certificate_gets_a_new_one_and_the_call_is_retried(
        openbao_server: OpenBaoProcess, pki_mount: str, vault: VaultKV, tmp_path: Path) -> None:
    """The agent's certificate comes from Vault's CA; the scheduler still holds files from an
    older CA, so the handshake fails; the pool asks for a new certificate and retries once."""
    answer = agent_pb2.ListWorkloadsResponse(
        workloads=[agent_pb2.WorkloadStatus(id="w-1")]).SerializeToString()

    async def list_workloads(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return answer

    server, port, vault_ca = await _agent(openbao_server, pki_mount, list_workloads)

    config = _config(openbao_server, pki_mount, tmp_path)
    old_ca = TestCA(tmp_path / "old-ca")
    old = old_ca.issue("persys-scheduler", names=("127.0.0.1",))
    _write({config.ca_path: old_ca.cert, config.cert_path: old.cert, config.key_path: old.key})
    metrics = Metrics()
    manager = CertManager(config, vault, metrics)
    tls = TlsFiles(config.ca_path, config.cert_path, config.key_path)
    pool = AgentPool(metrics, instance_id="test", rpc_timeout=10.0, tls=tls,
                     cert_rotator=manager.force_rotate)
    without = AgentPool(Metrics(), instance_id="test", rpc_timeout=10.0, tls=tls)
    try:
        with pytest.raises(AgentError) as refused:
            await without.list_workloads_raw("node-1", f"127.0.0.1:{port}")
        assert is_handshake_failure(refused.value.code, refused.value.details)

        raw = await pool.list_workloads_raw("node-1", f"127.0.0.1:{port}")

        assert raw == answer
        assert _count(metrics, "forced", "ok") == 1
        assert _read(config.ca_path)[0].strip() == vault_ca.strip()
    finally:
        await pool.close()
        await without.close()
        await server.stop(None)
        await manager.aclose()


@pytest.mark.slow
async def test_a_scheduler_serves_and_reaches_agents_with_its_vault_certificate(
        openbao_server: OpenBaoProcess, pki_mount: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, etcd_server, redis_server, key_root,
        stream_key) -> None:
    """PERSYS_VAULT_ENABLED end to end: no certificate files at start; the scheduler gets its
    own from Vault, serves mTLS with it, and Vault-certified agents register and run work."""
    from ops.sim.config import SimTls
    from proto.persys.control.v1 import control_pb2 as pb
    from proto.persys.control.v1 import control_pb2_grpc
    from tests.fixtures.harness import (
        container_spec,
        make_settings,
        running_fleet,
        running_scheduler,
    )

    bao = openbao_server
    for name, value in {"PERSYS_VAULT_ADDR": bao.addr, "PERSYS_VAULT_TOKEN": bao.root_token,
                        "PERSYS_VAULT_PKI_MOUNT": pki_mount, "PERSYS_VAULT_PKI_ROLE": ROLE,
                        "PERSYS_VAULT_CERT_TTL": "1h"}.items():
        monkeypatch.setenv(name, value)
    certs = tmp_path / "scheduler-certs"
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, insecure=False,
                             vault_enabled=True, agent_tls_enabled=True,
                             tls_ca=str(certs / "ca.pem"), tls_cert=str(certs / "tls.crt"),
                             tls_key=str(certs / "tls.key"),
                             nodes_per_host=2)  # the simulated agents share 127.0.0.1

    def issue(common_name: str) -> dict[str, str]:
        data: dict[str, str] = bao.api("POST", f"{pki_mount}/issue/{ROLE}", {
            "common_name": common_name, "ip_sans": "127.0.0.1", "ttl": "1h"})["data"]
        return data

    agent, operator = issue("compute-agent"), issue("persysctl")
    ca = agent["issuing_ca"].encode()
    async with running_scheduler(settings) as sched:
        assert sched.certs is not None
        assert sched.certs.current is not None
        assert _read(str(certs / "tls.key"))[0]
        address = f"127.0.0.1:{sched.grpc_port}"
        channel = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(
            ca, operator["private_key"].encode(), operator["certificate"].encode()))
        stub = control_pb2_grpc.AgentControlStub(channel)
        tls = SimTls(ca=ca, cert=agent["certificate"].encode(),
                     key=agent["private_key"].encode())
        try:
            async with running_fleet(address, 2, tls=tls) as fleet:
                await fleet.wait_registered()

                async def ready() -> bool:
                    nodes = (await stub.ListNodes(pb.ListNodesRequest(), timeout=5)).nodes
                    return sum(1 for n in nodes if n.status == "Ready") >= 2

                await wait_for(ready, timeout=20, message="2 Ready nodes")
                resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                    workload_id="vault-web", spec=container_spec()), timeout=10)
                assert resp.success, resp.error_message

                async def running() -> bool:
                    w = (await stub.GetWorkload(pb.GetWorkloadRequest(
                        workload_id="vault-web"), timeout=5)).workload
                    return w.status == "Running"

                # the scheduler reached the agent with its Vault certificate
                await wait_for(running, timeout=20, message="vault-web Running")
        finally:
            await channel.close()
    assert _count(sched.metrics, "startup", "ok") == 1


async def test_an_agent_that_refuses_our_client_certificate_gets_a_new_one(
        openbao_server: OpenBaoProcess, pki_mount: str, vault: VaultKV, tmp_path: Path) -> None:
    """Our CA file trusts the agent, but our certificate is from another CA: the agent refuses
    it (TLS 1.3 shows that as a closed socket while connecting); a new one, and one retry."""
    calls = []

    async def list_workloads(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls.append(1)
        return b""

    server, port, vault_ca = await _agent(openbao_server, pki_mount, list_workloads)
    config = _config(openbao_server, pki_mount, tmp_path)
    old_ca = TestCA(tmp_path / "old-ca")
    old = old_ca.issue("persys-scheduler", names=("127.0.0.1",))
    _write({config.ca_path: vault_ca, config.cert_path: old.cert, config.key_path: old.key})
    metrics = Metrics()
    manager = CertManager(config, vault, metrics)
    tls = TlsFiles(config.ca_path, config.cert_path, config.key_path)
    pool = AgentPool(metrics, instance_id="test", rpc_timeout=10.0, tls=tls,
                     cert_rotator=manager.force_rotate)
    try:
        await pool.list_workloads_raw("node-1", f"127.0.0.1:{port}")

        assert calls == [1]
        assert _count(metrics, "forced", "ok") == 1
    finally:
        await pool.close()
        await server.stop(None)


async def test_an_agent_answer_about_certificates_is_never_sent_twice(
        openbao_server: OpenBaoProcess, pki_mount: str, vault: VaultKV, tmp_path: Path) -> None:
    """UNAVAILABLE from the agent itself, mentioning a certificate: the call reached the agent,
    so neither a new certificate nor a second call."""
    calls = []

    async def list_workloads(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls.append(1)
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            "pull failed: x509: certificate signed by unknown authority")
        return b""

    server, port, _ = await _agent(openbao_server, pki_mount, list_workloads)
    config = _config(openbao_server, pki_mount, tmp_path)
    metrics = Metrics()
    manager = CertManager(config, vault, metrics)
    assert await manager.ensure()
    tls = TlsFiles(config.ca_path, config.cert_path, config.key_path)
    pool = AgentPool(metrics, instance_id="test", rpc_timeout=10.0, tls=tls,
                     cert_rotator=manager.force_rotate)
    try:
        with pytest.raises(AgentError, match="x509"):
            await pool.list_workloads_raw("node-1", f"127.0.0.1:{port}")

        assert calls == [1]
        assert _count(metrics, "forced", "ok") + _count(metrics, "forced", "failed") == 0
    finally:
        await pool.close()
        await server.stop(None)
