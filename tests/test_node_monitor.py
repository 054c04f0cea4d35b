"""The node monitor on real etcd and Redis with simulated nodes: a silent node goes NotReady
and its workloads move (with two replicas), a long NotReady node is removed, a node whose
heartbeat came back is neither, and a lost node's workloads move in one pass.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import pytest

from eventsource.etcd import Put
from handlers.app.server import Scheduler
from handlers.reconcile.registration import loops_of, monitor_interval_s
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import container_spec, control_stub, make_settings, running_fleet
from tests.fixtures.reconcile import QUIET, stack, until_leader
from tests.fixtures.reconcile import list_events as _list
from tests.fixtures.waiting import wait_for


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_silent_node_goes_not_ready_and_its_workloads_move_with_two_replicas(
        etcd_server, redis_server, key_root, stream_key):
    common = QUIET
    first = Scheduler(make_settings(etcd_server, redis_server, key_root, stream_key,
                                    instance_id="replica-a", **common))
    second = Scheduler(make_settings(etcd_server, redis_server, key_root, stream_key,
                                     instance_id="replica-b", **common))
    try:
        await first.start()
        await until_leader(first)
        await second.start()
        assert not second.leader.is_leader
        follower = f"127.0.0.1:{second.grpc_port}"
        # every heartbeat goes to the follower; the leader only sees the liveness keys
        async with running_fleet(follower, 4) as fleet, control_stub(follower) as stub:
            async with asyncio.timeout(30):
                await fleet.wait_registered()
            for replica in (first, second):
                await wait_for(lambda r=replica: sum(1 for n in r.cluster.nodes.values()
                                                     if n.status == "Ready") == 4, timeout=30)
            movable = [f"m-{i}" for i in range(8)]
            for wid in movable:
                resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                    workload_id=wid, spec=container_spec()))
                assert resp.success, resp.error_message
            local_spec = container_spec()
            local_spec.metadata["persys.storage.local"] = "true"
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(workload_id="pinned",
                                                                    spec=local_spec))
            assert resp.success
            everything = [*movable, "pinned"]

            def all_running() -> bool:
                for wid in everything:
                    item = first.cluster.statuses.get(wid)
                    if item is None or item.value.status != "Running":
                        return False
                return True

            await wait_for(all_running, timeout=30)
            victim_id = first.cluster.statuses.get("pinned").value.node_id  # type: ignore[union-attr]
            victim = fleet.node(victim_id)
            on_victim = sorted(first.cluster.workload_ids_on(victim_id))
            moving = [w for w in on_victim if w != "pinned"]
            assert moving, on_victim  # the spread score puts 2-3 of the 9 on every node
            loop = asyncio.get_running_loop()
            await victim.crash()
            crashed_at = loop.time()
            ttl = first.settings.node_lease_ttl_s
            bound = ttl + monitor_interval_s(first.settings) + 2.0
            await wait_for(lambda: first.cluster.nodes.get(victim_id).value.status  # type: ignore[union-attr]
                           == "NotReady", timeout=bound + 5, interval=0.05)
            elapsed = loop.time() - crashed_at
            assert elapsed <= bound, f"NotReady after {elapsed:.1f}s (lease TTL {ttl}s)"

            def moved() -> bool:
                for wid in moving:
                    st = first.cluster.statuses.get(wid).value  # type: ignore[union-attr]
                    if st.node_id == victim_id:
                        return False
                    if fleet.node(st.node_id).workload_state(wid) != "Running":
                        return False
                return True

            await wait_for(moved, timeout=20, message="movable workloads running elsewhere")
            assert first.cluster.statuses.get("pinned").value.node_id == victim_id  # type: ignore[union-attr]
            lost = await wait_for(lambda: _list(stub, "NodeLost", node_id=victim_id), timeout=10)
            assert lost[0].details["source"] == "monitor"
            assert lost[0].details["status"] == "NotReady"
            rescheduled = await wait_for(lambda: _list(stub, "Rescheduled", n=len(moving)),
                                         timeout=10)
            assert {e.details["previous_node"] for e in rescheduled} == {victim_id}
            skipped = await wait_for(lambda: _list(stub, "RescheduleSkipped",
                                                   workload_id="pinned"), timeout=10)
            assert skipped[0].details["persistence_class"] == "node-local"
            # the follower never ran a leader loop
            assert loops_of(second).reconcile.last_report is None
    finally:
        await second.stop()
        await first.stop()


async def test_long_not_ready_node_is_removed(etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_gc_after_s=600.0, **QUIET)
    async with stack(settings, 2) as s:
        victim = s.fleet.nodes[0]
        await victim.crash()
        await wait_for(lambda: s.sched.cluster.nodes.get(victim.node_id).value.status  # type: ignore[union-attr]
                       == "NotReady", timeout=20)
        # registered through a replica of another shard key: its DNS record lives there
        other = s.sched.layout.skydns(settings.agents_discovery_domain, "other-shard",
                                      victim.node_id)
        await s.sched.etcd.txn([], [Put(other, b'{"host": "127.0.0.1"}')])

        def relabel(node: Any) -> list[Any]:
            node.labels["scheduler_shard"] = "other-shard"
            return []

        await s.sched.writer.update_node(victim.node_id, relabel)
        monitor = s.loops.monitor

        async def monitor_at(seconds: float) -> Any:
            # the automatic monitor may be mid-tick: retry until this call is the one that runs
            report = await monitor.run_once(now=s.sched.clock.now() + timedelta(seconds=seconds))
            return None if report.skipped == "overlap" else report

        early = await wait_for(lambda: monitor_at(60), timeout=10)
        assert early.collected == []
        late = await wait_for(lambda: monitor_at(700), timeout=10)
        assert late.collected == [victim.node_id]
        await s.caught_up()
        assert s.sched.cluster.nodes.get(victim.node_id) is None
        assert await s.sched.etcd.get(s.sched.layout.node_status(victim.node_id)) is None
        skydns = s.sched.layout.skydns(settings.agents_discovery_domain, settings.shard_key,
                                       victim.node_id)
        assert await s.sched.etcd.get(skydns) is None
        assert await s.sched.etcd.get(other) is None
        left = await wait_for(lambda: s.events("NodeLeft", node_id=victim.node_id), timeout=10)
        assert left[0].details["status"] == "Removed"


async def test_a_node_whose_heartbeat_came_back_is_neither_lost_nor_removed(
    etcd_server, redis_server, key_root, stream_key
):
    """The monitor decides on a missing liveness key, then works through its plan for
    seconds; a heartbeat that recreated the key meanwhile cancels NotReady and removal."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_gc_after_s=600.0, **QUIET)
    async with stack(settings, 1) as s:
        node_id = s.fleet.nodes[0].node_id
        monitor = s.loops.monitor
        now = s.sched.clock.now()
        await wait_for(lambda: s.sched.cluster.alive.get(node_id) is not None, timeout=10)
        # the monitor's stale plan says the lease is gone; the node is heartbeating
        assert not await monitor.mark_not_ready(node_id, reason="lease expired",
                                                source="monitor", now=now)
        assert s.sched.cluster.nodes.get(node_id).value.status == "Ready"  # type: ignore[union-attr]
        # NotReady for another reason (its agent did not answer), and old enough to remove
        assert await monitor.mark_not_ready(node_id, reason="agent unreachable",
                                            source="reconciler", now=now)
        await s.caught_up()
        assert not await monitor._collect(node_id, now + timedelta(seconds=700))
        assert s.sched.cluster.nodes.get(node_id) is not None


async def test_the_monitor_moves_every_workload_of_a_lost_node_in_one_pass(
    etcd_server, redis_server, key_root, stream_key, caplog
):
    """Every move off one node rewrites that node's allocation: moves from one node go one at
    a time, so none is lost to another's compare (30 moves once left 22 to later cycles)."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 3) as s:
        ids = [f"burst-{i}" for i in range(60)]
        await s.apply(ids)
        await wait_for(lambda: all(s.agent_state(w) == "Running" for w in ids), timeout=60)
        await s.caught_up()
        counts: dict[str, int] = {}
        for w in ids:
            counts[s.status(w).node_id] = counts.get(s.status(w).node_id, 0) + 1
        victim = max(counts, key=lambda node_id: counts[node_id])
        assert counts[victim] >= 10, counts
        monitor = s.loops.monitor
        caplog.set_level(logging.WARNING, logger="persys.loops")
        await s.fleet.node(victim).crash()

        async def all_moved() -> bool:
            # the monitor's own schedule may run the pass first: either one moves them
            await monitor.run_once(now=s.sched.clock.now() + timedelta(seconds=60))
            await s.caught_up()
            return not [w for w in ids if s.status(w).node_id == victim]

        await wait_for(all_moved, timeout=40, message="the lost node's workloads were never "
                       "moved")
        failed = [r.getMessage() for r in caplog.records
                  if r.getMessage().startswith("failover of workload_id=")]
        assert not failed, failed
