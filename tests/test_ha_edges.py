"""Adversarial HA review: leadership hand-over, re-campaign, shard ownership and the
reservations of leader-loop placements, on real etcd and Redis."""

from __future__ import annotations

import time

import pytest

from eventsource.errors import NotLeader, Unavailable
from eventsource.etcd import Delete
from handlers.app.server import Scheduler
from handlers.app.start_errors import StartError
from handlers.cluster.leadership import KEY_CHECK_S
from tests.fixtures.harness import make_settings, running_scheduler
from tests.fixtures.reconcile import QUIET, stack
from tests.fixtures.waiting import wait_for


async def test_a_reconcile_placement_whose_commit_fails_leaves_no_reservation(
        etcd_server, redis_server, key_root, stream_key, monkeypatch) -> None:
    """The reconcile loop's placement reserves capacity, then commits. A commit that fails
    with anything but a Conflict (etcd unavailable or timing out, the cycle cancelled by a lost
    leadership) must release the hold, as ApplyWorkload's and the relocator's placements do;
    otherwise the node looks fuller to every later placement of this replica for the whole
    reservation TTL (90 s by default)."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 2) as s:
        sched = s.sched
        await s.apply(["orphan"])
        await s.running(["orphan"])
        await s.unassign("orphan")

        real_commit = sched.committer.commit

        async def failing_commit(change, **kwargs):  # type: ignore[no-untyped-def]
            if change.kind == "reconcile":
                raise Unavailable("etcd request timed out (injected)")
            return await real_commit(change, **kwargs)

        monkeypatch.setattr(sched.committer, "commit", failing_commit)
        report = await s.loops.reconcile.run_once()
        assert report.actions == {"Assign": 1}
        assert report.failed["Assign"] == 1
        assert sched.placer.reservations.holds() == {}
        assert dict(sched.placer.reservations.by_node) == {}


async def test_a_stopped_leader_hands_over_well_before_its_lease_ttl(
        etcd_server, redis_server, key_root, stream_key) -> None:
    """A clean shutdown revokes the leader's lease: the standby must not wait out the TTL."""
    first = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="a",
                          leader_lease_ttl_s=15, leader_renew_deadline_s=10.0)
    second = first.with_overrides(instance_id="b")
    async with running_scheduler(first) as a:
        await wait_for(lambda: a.leader.is_leader, timeout=15, message="a never led")
        b_cm = running_scheduler(second)
        b = await b_cm.__aenter__()
        try:
            assert not b.leader.is_leader
            stopped_at = time.monotonic()
            await a.stop()
            await wait_for(lambda: b.leader.is_leader, timeout=14,
                           message="standby did not take over before the TTL")
            took = time.monotonic() - stopped_at
        finally:
            await b_cm.__aexit__(None, None, None)
    assert took < 6.0, took


@pytest.mark.fault
@pytest.mark.timeout(120)
async def test_a_replica_leads_again_after_an_etcd_outage_longer_than_its_ttl(
        etcd_private, redis_server, key_root, stream_key) -> None:
    settings = make_settings(etcd_private, redis_server, key_root, stream_key,
                             leader_lease_ttl_s=3, leader_renew_deadline_s=2.0)
    async with running_scheduler(settings) as sched:
        await wait_for(lambda: sched.leader.is_leader, timeout=15, message="no leader")
        etcd_private.pause()
        try:
            await wait_for(lambda: not sched.leader.is_leader, timeout=10,
                           message="still leader with etcd stopped")
            # demoted: the term ended and its session was closed (not revived)
            await wait_for(lambda: sched.leader.leadership is None, timeout=15,
                           message="never demoted with etcd stopped")
        finally:
            etcd_private.resume()
        await wait_for(lambda: sched.leader.is_leader, timeout=30,
                       message="never re-campaigned after the outage")


@pytest.mark.timeout(120)
async def test_a_replica_with_other_shard_settings_fails_at_start_and_leads_nothing(
        etcd_server, redis_server, key_root, stream_key) -> None:
    """A rolling change of SCHEDULER_SHARD_COUNT (2 -> 3) would run old and new replicas
    together, each leading shards of its own topology: crc32 % 2 == 0 and crc32 % 3 == 1 map
    some nodes to both. An invalid shard topology fails at start (docs/compatibility.md,
    "Shard topology"): the new replica is refused, naming the settings, while an old one
    campaigns."""
    old = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="old-0",
                        ha_mode="active-active", shard_count=2, shard_index=0)
    new = old.with_overrides(instance_id="new-1", shard_count=3, shard_index=1)
    async with running_scheduler(old) as a:
        await wait_for(lambda: a.leader.is_leader, timeout=15, message="old-0 never led")
        refused = Scheduler(new)
        try:
            with pytest.raises(StartError, match=r"SCHEDULER_SHARD_COUNT=3.*"
                               r"SCHEDULER_SHARD_COUNT=2"):
                await refused.start()
            assert refused.leader.leadership is None
        finally:
            await refused.stop()
        # the failover election (no shards) is another topology too
        failover = old.with_overrides(instance_id="fo", ha_mode="failover", shard_count=1,
                                      shard_index=0)
        refused = Scheduler(failover)
        try:
            with pytest.raises(StartError, match="SCHEDULER_HA_MODE=failover"):
                await refused.start()
        finally:
            await refused.stop()
        assert a.leader.is_leader


@pytest.mark.timeout(120)
async def test_the_shard_settings_change_once_every_replica_has_stopped(
        etcd_server, redis_server, key_root, stream_key) -> None:
    """Stop every replica, change the settings, start them: the new topology is recorded by
    the first to start, and the replicas of the old one are then refused."""
    old = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="old-0",
                        ha_mode="active-active", shard_count=2, shard_index=0)
    new = old.with_overrides(instance_id="new-1", shard_count=3, shard_index=1)
    async with running_scheduler(old) as a:
        await wait_for(lambda: a.leader.is_leader, timeout=15, message="old-0 never led")
    async with running_scheduler(new) as b:
        await wait_for(lambda: b.leader.is_leader, timeout=15, message="new-1 never led")
        record = await b.etcd.get(b.layout.topology)
        assert record is not None
        assert record.value == b'{"haMode":"active-active","shardCount":3}'
        late = Scheduler(old)
        try:
            with pytest.raises(StartError, match="SCHEDULER_SHARD_COUNT=2"):
                await late.start()
        finally:
            await late.stop()


async def test_a_leader_whose_key_is_deleted_guards_agent_calls_at_most_a_second_more(
        etcd_server, redis_server, key_root, stream_key) -> None:
    """docs/operations.md: a leader whose election key is deleted by hand stops leading at its
    next key check (every second). Its successor campaigns at once, so for up to that second
    both pass the agent-RPC guard (the lease still lives); never longer."""
    first = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="a",
                          leader_lease_ttl_s=10, leader_renew_deadline_s=7.0)
    second = first.with_overrides(instance_id="b")
    async with running_scheduler(first) as a:
        await wait_for(lambda: a.leader.is_leader, timeout=15, message="a never led")
        async with running_scheduler(second) as b:
            lead = a.leader.leadership
            assert lead is not None
            await a.etcd.txn([], [Delete(lead.key)])
            await wait_for(lambda: b.leader.is_leader, interval=0.001, timeout=10)

            def guards() -> bool:
                try:
                    a.agents.guard()
                except NotLeader:
                    return False
                return True

            overlap_started = time.monotonic()
            await wait_for(lambda: not guards(), interval=0.001, timeout=10)
            overlap = time.monotonic() - overlap_started
            assert overlap < KEY_CHECK_S + 0.5, f"both passed the guard for {overlap:.3f}s"
