"""High availability with real ``persys-scheduler serve`` processes on one etcd.

* kill -9 the leader: a standby leads and has started its first reconcile within TTL + 1 s;
* SIGSTOP the leader past its lease, let a standby take over, SIGCONT it: the old leader makes
  no leader-only etcd write and no agent apply afterwards;
* active-active, 2 shards x 2 replicas: every node is reconciled by exactly one replica, and
  still by exactly one after one replica per shard is killed.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from ops.sim.config import NodeBehaviour
from ops.sim.fleet import Fleet
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import container_spec, control_stub
from tests.fixtures.replicas import Replica, ReplicaSet
from tests.fixtures.waiting import wait_for, wait_for_sync

TTL = 3
LEADER_KINDS = ("leader", "reconcile", "monitor", "drift", "relocate", "node-monitor")


def _base_env(etcd, redis, key_root, stream_key) -> dict[str, str]:
    return {
        "ETCD_ENDPOINTS": etcd.endpoint, "REDIS_ADDR": redis.addr,
        "SCHEDULER_ETCD_ROOT": key_root, "SCHEDULER_EVENT_STREAM": stream_key,
        "SCHEDULER_LEADER_LEASE_TTL": str(TTL), "SCHEDULER_LEADER_RENEW_DEADLINE": "2",
        "SCHEDULER_RECONCILE_INTERVAL": "1", "SCHEDULER_HEARTBEAT_INTERVAL": "1",
        "SCHEDULER_NODE_LEASE_TTL": "10", "SCHEDULER_DNS_REGISTRATION": "false",
    }


def _cycles(replica: Replica) -> float:
    try:
        return replica.metric_sum("persys_scheduler_reconcile_cycles_total")
    except OSError:
        return 0.0


@pytest.mark.fault
@pytest.mark.timeout(180)
def test_kill_leader_standby_reconciles_within_ttl_plus_one(
    etcd_private, redis_private, key_root, stream_key, tmp_path
):
    replicas = ReplicaSet(tmp_path, _base_env(etcd_private, redis_private, key_root,
                                              stream_key))
    try:
        for i in range(3):
            replicas.add(f"ha-{i}").start()
        measured: list[float] = []
        for _ in range(2):
            leader = wait_for_sync(lambda: (ls := replicas.leaders()) and len(ls) == 1
                                   and ls[0], timeout=15, message="one leader")
            standbys = [r for r in replicas.replicas if r is not leader and r.running()]
            before = {r.name: _cycles(r) for r in standbys}
            killed_at = time.monotonic()
            leader.kill()

            def new_leader_reconciled(standbys=standbys, before=before) -> Replica | None:
                for r in standbys:
                    if r.is_leader() and _cycles(r) > before[r.name]:
                        return r
                return None

            successor = wait_for_sync(new_leader_reconciled, timeout=TTL + 6, interval=0.02,
                                      message="a standby leads and reconciles")
            elapsed = time.monotonic() - killed_at
            measured.append(elapsed)
            print(f"failover: {leader.name} killed -> {successor.name} reconciled in "
                  f"{elapsed:.2f}s (TTL {TTL}s)")
            replicas.add(f"{leader.name}-again").start()
        assert max(measured) < TTL + 1.0, measured
    finally:
        replicas.stop_all()


@pytest.mark.fault
@pytest.mark.timeout(180)
async def test_paused_leader_makes_no_write_and_no_apply_after_its_successor(
    etcd_private, redis_private, key_root, stream_key, tmp_path
):
    replicas = ReplicaSet(tmp_path, _base_env(etcd_private, redis_private, key_root,
                                              stream_key))
    fleet = None
    try:
        old = replicas.add("old").start()
        await wait_for(old.is_leader, timeout=15, message="first replica leads")
        new = replicas.add("new").start()
        # agents and API traffic go to the standby only: whatever the old leader does after
        # resuming, it does as (former) leader
        fleet = Fleet(new.address, count=6, prefix="ha-node-",
                      behaviour=NodeBehaviour(apply_latency_s=0.05), heartbeat_interval_s=1.0,
                      seed=3)
        await fleet.start()
        await asyncio.wait_for(fleet.wait_registered(), 20)
        async with control_stub(new.address) as stub:
            for i in range(12):
                resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                    workload_id=f"ha-w{i}", spec=container_spec()))
                assert resp.success, resp.error_message
        await wait_for(lambda: _cycles(old) >= 2, timeout=15, message="old leader reconciles")

        old.pause()
        paused_at = time.monotonic()
        await wait_for(new.is_leader, timeout=TTL + 8, message="the standby takes over")
        takeover = time.monotonic() - paused_at
        await wait_for(lambda: _cycles(new) >= 2, timeout=10, message="new leader reconciles")
        metrics_before = None
        old.resume()
        # the old leader notices it lost the lease and steps down
        await wait_for(lambda: old.health().get("leader") == "false", timeout=10,
                       message="old leader steps down")
        metrics_before = old.metrics()
        # give it a few of its former reconcile intervals to misbehave
        await wait_for(lambda: _cycles(new) >= 6, timeout=15, message="more cycles")
        metrics_after = old.metrics()

        def leader_commits(m: dict[str, float]) -> float:
            return sum(v for k, v in m.items() if k.startswith(
                "persys_scheduler_etcd_txns_total") and 'result="committed"' in k
                and any(f'kind="{kind}"' in k for kind in LEADER_KINDS))

        def agent_applies(m: dict[str, float]) -> float:
            return sum(v for k, v in m.items() if k.startswith(
                "persys_scheduler_agent_rpcs_total") and 'method="ApplyWorkload"' in k)

        print(f"takeover after SIGSTOP: {takeover:.2f}s; old leader commits before/after "
              f"resume: {leader_commits(metrics_before)}/{leader_commits(metrics_after)}")
        assert leader_commits(metrics_after) == leader_commits(metrics_before)
        assert agent_applies(metrics_after) == agent_applies(metrics_before)
        assert fleet.stats()["double_applies"] == 0
    finally:
        if fleet is not None:
            await fleet.stop()
        replicas.stop_all()


@pytest.mark.fault
@pytest.mark.timeout(180)
async def test_active_active_every_node_reconciled_by_exactly_one_replica(
    etcd_private, redis_private, key_root, stream_key, tmp_path
):
    env = _base_env(etcd_private, redis_private, key_root, stream_key)
    env.update({"SCHEDULER_HA_MODE": "active-active", "SCHEDULER_SHARD_COUNT": "2"})
    replicas = ReplicaSet(tmp_path, env)
    fleet = None
    try:
        shard = {}
        for index in (0, 1):
            for copy in ("a", "b"):
                r = replicas.add(f"s{index}{copy}", SCHEDULER_SHARD_INDEX=index).start()
                shard[r.name] = index
        fleet = Fleet(replicas.replicas[0].address, count=12, prefix="aa-node-",
                      behaviour=NodeBehaviour(apply_latency_s=0.05), heartbeat_interval_s=1.0,
                      seed=5)
        await fleet.start()
        await asyncio.wait_for(fleet.wait_registered(), 20)

        def drivers_per_node(since: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
            out: dict[str, set[str]] = {}
            for node in fleet.nodes:
                callers = {inst for (method, inst), n in node.callers.items()
                           if method == "ListWorkloads" and n > 0}
                out[node.node_id] = callers - (since or {}).get(node.node_id, set())
            return out

        def every_node_driven(since=None):
            d = drivers_per_node(since)
            return d if all(d.values()) else None

        await wait_for(lambda: len(replicas.leaders()) == 2, timeout=20,
                       message="one leader per shard")
        drivers = await wait_for(every_node_driven, timeout=20, message="all nodes reconciled")
        assert all(len(v) == 1 for v in drivers.values()), drivers
        assert {shard[next(iter(v))] for v in drivers.values()} == {0, 1}

        # kill the leader of each shard; the other replica of the shard takes over
        for leader in replicas.leaders():
            leader.kill()
        await wait_for(lambda: len(replicas.leaders()) == 2, timeout=TTL + 10,
                       message="both shards led again")
        for node in fleet.nodes:
            node.callers.clear()
        drivers = await wait_for(every_node_driven, timeout=20, message="all nodes again")
        assert all(len(v) == 1 for v in drivers.values()), drivers
        alive = {r.name for r in replicas.replicas if r.running()}
        assert set().union(*drivers.values()) <= alive
    finally:
        if fleet is not None:
            await fleet.stop()
        replicas.stop_all()


def test_shard_ownership_memo_answers_as_the_go_rule_and_stays_bounded(monkeypatch):
    """``LeaderGate.owns`` remembers answers (asked for every node several times per cycle);
    remembered or not, each answer is crc32(node id) mod count == index, and the memo starts
    over instead of growing past its bound."""
    from typing import Any

    from eventsource.keys import KeyLayout
    from handlers.cluster import leadership
    from handlers.cluster.leadership import LeaderGate, owns_node

    monkeypatch.setattr(leadership, "OWNERSHIP_MEMO_MAX", 50)
    nothing: Any = None
    gate = LeaderGate(nothing, KeyLayout("/t"), nothing, nothing, nothing, instance_id="r",
                      active_active=True, shard_count=3, shard_index=1, lease_ttl_s=10,
                      renew_deadline_s=6.0)
    ids = [f"node-{i}" for i in range(200)] + [" node-7 "]
    for _ in range(2):  # the second pass answers from the memo where it still holds the id
        for node_id in ids:
            assert gate.owns(node_id) == owns_node(node_id, active_active=True, shard_count=3,
                                                   shard_index=1)
            assert len(gate._owned) <= 50
    assert 0 < sum(gate.owns(n) for n in ids) < len(ids)
