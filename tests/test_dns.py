"""Per-replica CoreDNS records, served by a real CoreDNS with the etcd plugin."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import dns.exception
import dns.resolver
import pytest

from eventsource.errors import Unavailable
from eventsource.etcd import AsyncEtcd, Delete
from eventsource.keys import KeyLayout
from handlers.cluster.dns import DnsRegistration
from ops.coredns import CoreDnsProcess, build_coredns, find_coredns_binary
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import control_stub, make_settings, running_scheduler
from tests.fixtures.replicas import ReplicaSet
from tests.fixtures.waiting import wait_for, wait_for_sync


@pytest.fixture
def coredns(etcd_private, key_root, tmp_path):
    binary = find_coredns_binary()
    if binary is None:
        # first run on a fresh machine: build it from the Go module proxy (minutes, once)
        try:
            binary = build_coredns()
        except (OSError, subprocess.SubprocessError) as exc:
            pytest.fail(f"this test needs a real CoreDNS and it could not be built: {exc}")
    proc = CoreDnsProcess(binary).start(tmp_path / "coredns", zone="persys.local",
                                        etcd_url=etcd_private.url, path=f"{key_root}/skydns")
    try:
        yield proc
    finally:
        proc.stop()


def _answers(port: int, name: str, rtype: str) -> list[str]:
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = ["127.0.0.1"]
    resolver.port = port
    resolver.lifetime = 2.0
    try:
        return sorted(str(r) for r in resolver.resolve(name, rtype))
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer, dns.exception.Timeout):
        return []


@pytest.mark.fault
@pytest.mark.timeout(1500)  # the first run on a fresh machine builds CoreDNS
def test_each_replica_has_its_own_records_and_a_killed_one_disappears(
    coredns, etcd_private, key_root, tmp_path
):
    replicas = ReplicaSet(tmp_path, {
        "ETCD_ENDPOINTS": etcd_private.endpoint, "SCHEDULER_ETCD_ROOT": key_root,
        "SCHEDULER_DNS_LEASE_TTL": "3", "SCHEDULER_LEADER_LEASE_TTL": "3",
        "DOMAIN": "persys.local"})
    try:
        for i in (1, 2, 3):
            replicas.add(f"dns-r{i}", SCHEDULER_ADVERTISE_IP=f"127.0.0.{i}").start()
        srv = wait_for_sync(
            lambda: (r := _answers(coredns.port, "_persys-scheduler.persys.local", "SRV"))
            and len(r) == 3 and r, timeout=15, message="three SRV records")
        ports = {int(a.split()[2]) for a in srv}
        assert ports == {r.grpc_port for r in replicas.replicas}
        a_records = _answers(coredns.port, "persys-scheduler.persys.local", "A")
        assert a_records == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]

        replicas.replicas[1].kill()  # no clean shutdown: the lease must expire
        wait_for_sync(lambda: len(_answers(coredns.port, "_persys-scheduler.persys.local",
                                           "SRV")) == 2, timeout=8,
                      message="the killed replica's SRV record expires with its lease")
        assert _answers(coredns.port, "persys-scheduler.persys.local", "A") == [
            "127.0.0.1", "127.0.0.3"]

        replicas.replicas[0].stop()  # clean shutdown deregisters at once
        wait_for_sync(lambda: len(_answers(coredns.port, "_persys-scheduler.persys.local",
                                           "SRV")) == 1, timeout=3,
                      message="a cleanly stopped replica removes its records")
    finally:
        replicas.stop_all()


async def test_a_node_registering_through_another_shard_key_leaves_no_old_record(
        etcd_server, redis_server, key_root, stream_key):
    """Replicas with different SCHEDULER_SHARD_KEYs write a node's agent record under their
    own key; moving to another leaves no stale record answering for the node."""
    caps = pb.NodeCapabilities(cpu_total_millicores=1000, memory_total_mb=1024)
    request = pb.RegisterNodeRequest(node_id="roamer", grpc_endpoint="127.0.0.1:9",
                                     capabilities=caps)
    keys = []
    for shard in ("shard-a", "shard-b"):
        settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                                 shard_key=shard)
        async with running_scheduler(settings) as sched, control_stub(
                f"127.0.0.1:{sched.grpc_port}") as stub:
            assert (await stub.RegisterNode(request)).accepted
            keys.append(sched.layout.skydns(settings.agents_discovery_domain, shard, "roamer"))
            assert await sched.etcd.get(keys[-1]) is not None
            if len(keys) == 2:
                assert await sched.etcd.get(keys[0]) is None


async def test_records_are_written_again_after_a_failed_write_or_a_deletion(etcd_server,
                                                                             key_root):
    """A failed first write is retried with a new lease (before, the empty lease was renewed
    forever and the replica stayed out of DNS), and records deleted under a live lease come
    back at the next renewal."""
    etcd = AsyncEtcd([etcd_server.endpoint])
    layout = KeyLayout(key_root)
    registration = DnsRegistration(etcd, layout, domain="persys.local", instance_id="r1",
                                   host="10.0.0.1", port=8085, ttl_s=3)
    txn = etcd.txn
    failures = [Unavailable("etcd leader election in progress")]

    async def failing_once(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return await txn(*args, **kwargs)

    etcd.txn = failing_once  # type: ignore[method-assign]
    task = asyncio.create_task(registration.run())
    try:
        async def registered() -> bool:
            kv = await etcd.get(registration.srv_key)
            return kv is not None and kv.lease == registration.lease != 0

        await wait_for(registered, timeout=15, message="records never written")
        await etcd.txn([], [Delete(registration.srv_key), Delete(registration.a_key)])
        await wait_for(registered, timeout=15, message="deleted records not written again")
        assert await etcd.get(registration.a_key) is not None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await registration.deregister()
        etcd.close()
