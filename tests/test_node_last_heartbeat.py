"""``NodeView.last_heartbeat`` follows the heartbeats, though a heartbeat writes nothing to etcd.

Heartbeats only renew the node's liveness lease; their times go to Redis (beside the usage
telemetry) and to the receiving replica's memory. GetNode and ListNodes report the newest of
those and the node record's own ``lastHeartbeat``: on every replica, whichever one received the
heartbeat, and without Redis or with Redis hung (then from the replica's memory, promptly).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta

import redis.asyncio as aioredis

from eventsource.events import parse_rfc3339
from handlers.nodes.usage import UsageSink
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    control_stub,
    make_settings,
    running_fleet,
    running_scheduler,
    serving_fleet,
)
from tests.fixtures.waiting import wait_for

#: a heartbeat every 0.5 s; a view may lag behind the newest by one interval and a write
FRESH = timedelta(seconds=1.5)


def _age(view: pb.NodeView, asked: datetime) -> timedelta:
    return asked - view.last_heartbeat.ToDatetime(tzinfo=UTC)


async def _beat_a_while(fleet, since: datetime, beats: int = 4) -> None:
    """Until ``beats`` more heartbeats were answered and 3 s passed since ``since`` (so the
    registration's own time is too old to pass for a fresh heartbeat)."""
    ok_before = fleet.counters.control["heartbeats_ok"]
    await wait_for(lambda: fleet.counters.control["heartbeats_ok"] >= ok_before + beats
                   and datetime.now(UTC) > since + timedelta(seconds=3), timeout=15,
                   message="heartbeats answered")


async def test_getnode_last_heartbeat_advances_with_heartbeats(
        etcd_server, redis_server, key_root, stream_key):
    s = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with serving_fleet(s, 1, heartbeat_interval_s=0.5) as (sched, fleet, stub):
        registered_at = datetime.now(UTC)
        node_id = fleet.nodes[0].node_id
        await _beat_a_while(fleet, registered_at)
        asked = datetime.now(UTC)
        node = (await stub.GetNode(pb.GetNodeRequest(node_id=node_id))).node
        assert _age(node, asked) < FRESH, f"{_age(node, asked).total_seconds():.1f}s old"
        # the node record was not rewritten for it
        recorded = parse_rfc3339(sched.cluster.nodes.get(node_id).value.last_heartbeat)
        assert recorded is not None
        assert recorded <= registered_at


async def test_listnodes_last_heartbeat_advances_with_heartbeats(
        etcd_server, redis_server, key_root, stream_key):
    s = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with serving_fleet(s, 3, heartbeat_interval_s=0.5) as (_sched, fleet, stub):
        await _beat_a_while(fleet, datetime.now(UTC), beats=12)
        asked = datetime.now(UTC)
        nodes = (await stub.ListNodes(pb.ListNodesRequest())).nodes
        assert sorted(n.node_id for n in nodes) == sorted(n.node_id for n in fleet.nodes)
        ages = {n.node_id: round(_age(n, asked).total_seconds(), 1) for n in nodes}
        assert all(_age(n, asked) < FRESH for n in nodes), ages
        # the status filter still applies
        ready = (await stub.ListNodes(pb.ListNodesRequest(status="ready"))).nodes
        assert len(ready) == 3


async def test_a_replica_that_did_not_receive_the_heartbeats_reports_them(
        etcd_server, redis_server, key_root, stream_key):
    """Behind a load balancer a heartbeat reaches any replica: the others read it in Redis."""
    s1 = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r1")
    s2 = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r2")
    async with (
        running_scheduler(s1) as a,
        running_scheduler(s2) as b,
        running_fleet(f"127.0.0.1:{a.grpc_port}", 2, heartbeat_interval_s=0.5) as fleet,
        control_stub(f"127.0.0.1:{b.grpc_port}") as stub_b,
    ):
        await fleet.wait_registered()
        await wait_for(lambda: len(b.cluster.nodes.items) == 2, timeout=10,
                       message="replica b sees both nodes")
        await _beat_a_while(fleet, datetime.now(UTC), beats=8)
        received = {name: r.metrics.registry.get_sample_value(
            "persys_scheduler_heartbeats_total") for name, r in (("a", a), ("b", b))}
        assert received["a"], received
        assert received["b"] == 0, received
        asked = datetime.now(UTC)
        node_id = fleet.nodes[0].node_id
        node = (await stub_b.GetNode(pb.GetNodeRequest(node_id=node_id))).node
        assert _age(node, asked) < FRESH, f"{_age(node, asked).total_seconds():.1f}s old"
        listed = (await stub_b.ListNodes(pb.ListNodesRequest())).nodes
        ages = {n.node_id: round(_age(n, asked).total_seconds(), 1) for n in listed}
        assert len(listed) == 2
        assert all(_age(n, asked) < FRESH for n in listed), ages


async def test_without_redis_the_receiving_replica_reports_its_heartbeats(
        etcd_server, key_root, stream_key):
    s = make_settings(etcd_server, None, key_root, stream_key)
    async with serving_fleet(s, 1, heartbeat_interval_s=0.5) as (_sched, fleet, stub):
        await _beat_a_while(fleet, datetime.now(UTC))
        asked = datetime.now(UTC)
        node = (await stub.GetNode(pb.GetNodeRequest(node_id=fleet.nodes[0].node_id))).node
        assert _age(node, asked) < FRESH, f"{_age(node, asked).total_seconds():.1f}s old"


async def test_a_hung_redis_neither_fails_nor_stalls_node_reads(
        etcd_server, redis_private, key_root, stream_key):
    """Redis stopped (SIGSTOP: connections open, no answers): GetNode and ListNodes answer
    within the read bound, with the heartbeats this replica received."""
    s = make_settings(etcd_server, redis_private, key_root, stream_key)
    async with serving_fleet(s, 1, heartbeat_interval_s=0.5) as (_sched, fleet, stub):
        node_id = fleet.nodes[0].node_id
        since = datetime.now(UTC)
        redis_private.pause()
        try:
            await _beat_a_while(fleet, since)
            loop_time = asyncio.get_running_loop().time
            for _ in range(3):
                started = loop_time()
                asked = datetime.now(UTC)
                node = (await stub.GetNode(pb.GetNodeRequest(node_id=node_id),
                                           timeout=5)).node
                listed = (await stub.ListNodes(pb.ListNodesRequest(), timeout=5)).nodes
                took = loop_time() - started
                assert took < 2.0, f"GetNode + ListNodes took {took:.2f}s"
                assert _age(node, asked) < FRESH, f"{_age(node, asked).total_seconds()}s"
                assert [_age(n, asked) < FRESH for n in listed] == [True]
        finally:
            redis_private.resume()


async def test_heartbeat_times_in_redis_only_move_forward(redis_server, stream_key):
    """Two replicas' writers, a late batch carrying an older time: the newer time stays. A third
    replica reads both nodes in one call; its own memory counts only where it is newer."""
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    prefix = f"{stream_key}:heartbeat:"

    def sink() -> UsageSink:
        return UsageSink(client, meter_stream=f"{stream_key}:meter", meter_maxlen=10,
                         meter_enabled=False, heartbeat_prefix=prefix)

    a, b, c = sink(), sink(), sink()
    writers = [asyncio.ensure_future(s.run()) for s in (a, b)]
    t0 = datetime(2026, 11, 30, 12, 0, 0, 250_000, tzinfo=UTC)
    try:
        a.heartbeat("n1", t0 + timedelta(seconds=5))
        await wait_for(lambda: client.get(f"{prefix}n1"), message="a's time written")
        b.heartbeat("n1", t0 + timedelta(seconds=1))
        b.heartbeat("n2", t0 + timedelta(seconds=1))
        await wait_for(lambda: client.get(f"{prefix}n2"), message="b's batch written")
        assert 0 < await client.ttl(f"{prefix}n1") <= 7 * 24 * 3600
        c.heartbeat("n2", t0 + timedelta(seconds=9))  # c has no writer: its memory only
        assert await c.last_heartbeats(["n1", "n2", "n3"]) == {
            "n1": t0 + timedelta(seconds=5), "n2": t0 + timedelta(seconds=9)}
        assert await b.last_heartbeats(["n1"]) == {"n1": t0 + timedelta(seconds=5)}
        assert a.beats_dropped == b.beats_dropped == 0
    finally:
        for writer in writers:
            writer.cancel()
        for writer in writers:
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        await client.aclose()


async def test_node_controls_answer_without_reading_redis(
        etcd_server, redis_server, key_root, stream_key) -> None:
    """A label or taint change answers with the heartbeat this replica saw: it runs at
    hundreds per second and must not cost a Redis round trip each (GetNode makes one)."""
    s = make_settings(etcd_server, redis_server, key_root, stream_key)
    client = aioredis.from_url(redis_server.url)

    async def mgets() -> int:
        stats = await client.info("commandstats")
        return int(stats.get("cmdstat_mget", {}).get("calls", 0))

    try:
        async with serving_fleet(s, 1, heartbeat_interval_s=0.5) as (_sched, fleet, stub):
            node_id = fleet.nodes[0].node_id
            await _beat_a_while(fleet, datetime.now(UTC), beats=2)
            before = await mgets()
            for i in range(10):
                resp = await stub.SetNodeLabel(pb.SetNodeLabelRequest(
                    node_id=node_id, key="k", value=str(i)))
                assert resp.accepted
                assert _age(resp.node, datetime.now(UTC)) < FRESH  # seen here
            assert await mgets() == before
            await stub.GetNode(pb.GetNodeRequest(node_id=node_id))
            assert await mgets() == before + 1
    finally:
        await client.aclose()
