"""etcd over TLS with client-certificate auth: the client, its watches, and a whole scheduler
(projections, election, relay, placement) against a real etcd run with ``--client-cert-auth``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from eventsource.errors import StoreError
from eventsource.etcd import AsyncEtcd, Put
from eventsource.etcdtls import EtcdTls
from eventsource.watch import WatchStream
from handlers.settings.config import load_settings
from handlers.settings.reader import ConfigError
from ops.devstack.etcd import EtcdProcess
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.certs import TestCA
from tests.fixtures.harness import (
    container_spec,
    control_stub,
    make_settings,
    running_fleet,
    running_scheduler,
)
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.slow


class EtcdPki:
    def __init__(self, ca: TestCA, stranger: TestCA) -> None:
        member = ca.issue("etcd", names=("127.0.0.1", "localhost"))
        client = ca.issue("persys-scheduler")
        other = stranger.issue("persys-scheduler")
        self.member = EtcdTls(str(ca.cert_path), str(member.cert_path), str(member.key_path))
        self.client = EtcdTls(str(ca.cert_path), str(client.cert_path), str(client.key_path))
        self.no_cert = EtcdTls(str(ca.cert_path))
        self.stranger = EtcdTls(str(ca.cert_path), str(other.cert_path), str(other.key_path))


@pytest.fixture(scope="module")
def etcd_tls(tmp_path_factory) -> Iterator[tuple[EtcdProcess, EtcdPki]]:
    directory = tmp_path_factory.mktemp("etcd-tls")
    pki = EtcdPki(TestCA(directory / "ca"), TestCA(directory / "other", name="stranger"))
    proc = EtcdProcess(fast=True, tls=pki.member)
    try:
        proc.start(directory / "data")
        yield proc, pki
    finally:
        proc.stop()


async def test_the_client_and_its_watches_speak_tls(etcd_tls, key_root):
    proc, pki = etcd_tls
    assert proc.url.startswith("https://")
    etcd = AsyncEtcd([proc.endpoint], tls=pki.client)  # no scheme: https, because of tls
    try:
        assert etcd.base_url.startswith("https://")
        revision = await etcd.current_revision()
        watch = WatchStream(etcd.base_url, f"{key_root}/", revision + 1, tls=etcd.tls)
        try:
            result = await etcd.txn([], [Put(f"{key_root}/a", b"1")])
            assert result.succeeded
            got = await etcd.get(f"{key_root}/a")
            assert got is not None
            assert got.value == b"1"
            lease = await etcd.lease_grant(10)
            ttls = await etcd.lease_keepalive_many([lease])  # the streaming gateway call
            assert ttls[lease] > 0
            event = None
            async with asyncio.timeout(10):
                async for batch in watch:
                    if batch.events:
                        event = batch.events[0]
                        break
            assert event is not None
            assert event.kv.key == f"{key_root}/a"
        finally:
            watch.close()
    finally:
        etcd.close()


@pytest.mark.parametrize("who", ["no_cert", "stranger", "plain_http"])
async def test_etcd_refuses_a_client_without_a_certificate_from_its_ca(etcd_tls, who):
    proc, pki = etcd_tls
    if who == "plain_http":
        etcd = AsyncEtcd([f"http://{proc.endpoint}"], timeout=2.0)
    else:
        etcd = AsyncEtcd([proc.endpoint], timeout=2.0, tls=getattr(pki, who))
    try:
        with pytest.raises(StoreError):
            await etcd.current_revision()
    finally:
        etcd.close()


async def test_a_scheduler_runs_on_an_etcd_that_requires_client_certificates(
        etcd_tls, redis_server, key_root, stream_key):
    proc, pki = etcd_tls
    settings = make_settings(proc, redis_server, key_root, stream_key,
                             etcd_ca=pki.client.ca, etcd_cert=pki.client.cert,
                             etcd_key=pki.client.key)
    assert settings.etcd_tls == pki.client
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 2) as fleet, control_stub(address) as stub:
            await fleet.wait_registered()
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="tls-etcd", spec=container_spec()))
            assert resp.success, resp.error_message

            async def running() -> bool:
                w = await stub.GetWorkload(pb.GetWorkloadRequest(workload_id="tls-etcd"))
                return w.workload.status == "Running"

            await wait_for(running, timeout=15, message="Running on a TLS etcd")

            async def relayed() -> bool:  # the relay's watch and the stream
                events = await stub.ListEvents(pb.ListEventsRequest(limit=100))
                return "WorkloadScheduled" in {e.type for e in events.events}

            await wait_for(relayed, timeout=15, message="events relayed")
            health = sched.health()
            assert health["leader"] == "true", health


def test_settings_name_a_half_configured_etcd_tls(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="SCHEDULER_ETCD_CERT/SCHEDULER_ETCD_KEY"):
        load_settings({"SCHEDULER_ETCD_CERT": str(cert)}, insecure=True)
    with pytest.raises(ConfigError, match="SCHEDULER_ETCD_CA"):
        load_settings({"SCHEDULER_ETCD_CA": str(tmp_path / "missing.pem")}, insecure=True)
    assert load_settings({}, insecure=True).etcd_tls is None
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ConfigError, match="ETCD_ENDPOINTS"):
        load_settings({"SCHEDULER_ETCD_CA": str(ca), "ETCD_ENDPOINTS": "http://etcd:2379"},
                      insecure=True)
    assert load_settings({"SCHEDULER_ETCD_CA": str(ca), "ETCD_ENDPOINTS": "etcd:2379"},
                         insecure=True).etcd_tls == EtcdTls(str(ca))
