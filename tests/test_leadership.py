"""Leadership holds exactly as long as it should, in one process, on real etcd:

* the keepalives keep up with a renew deadline shorter than TTL/3 (no flapping);
* a leader whose election key is deleted while its lease lives stops leading, so a successor
  never shares the role with it;
* a wall clock stepped back does not silence the leader loops (APScheduler times by it);
* a cluster whose state was lost starts in recovery before anything can write;
* an etcd that refuses writes (an alarm raised) puts the replica in degraded mode;
* a loss or a stop that meets a leader-loop cycle in flight ends it quietly.
"""

from __future__ import annotations

import asyncio
import datetime as real_datetime
import logging

import apscheduler.executors.base as apscheduler_executors
import apscheduler.schedulers.base as apscheduler_base
import pytest

import eventsource.clock as clock_module
import handlers.cluster.leadership as leadership_module
from eventsource.election import Session
from eventsource.etcd import AsyncEtcd, Delete, Put
from eventsource.keys import KeyLayout
from handlers.cluster.leadership import Loop
from handlers.cluster.modes import DEGRADED, NORMAL, RECOVERY, Probe, decide_mode
from tests.fixtures.harness import make_settings, running_scheduler
from tests.fixtures.metrics import counter_total
from tests.fixtures.waiting import wait_for


def test_keepalives_follow_the_shorter_of_ttl_and_renew_deadline() -> None:
    etcd = AsyncEtcd(["127.0.0.1:1"])
    try:
        assert Session(etcd, ttl=15).interval == 5.0
        assert Session(etcd, ttl=15, renew_deadline=10.0).interval == 5.0
        assert Session(etcd, ttl=6, renew_deadline=1.5).interval == 0.75
    finally:
        etcd.close()


async def test_a_short_renew_deadline_does_not_make_leadership_flap(
        etcd_server, redis_server, key_root, stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             leader_lease_ttl_s=6, leader_renew_deadline_s=1.5)
    async with running_scheduler(settings) as sched:
        await wait_for(lambda: sched.leader.is_leader, timeout=15, message="no leader")
        with pytest.raises(AssertionError):  # the flap does not come within 4 s
            await wait_for(lambda: not sched.leader.is_leader, timeout=4)
        assert counter_total(sched.metrics.leader_transitions, transition="gained") == 1


async def test_a_leader_whose_key_is_deleted_stops_leading(
        etcd_server, redis_server, key_root, stream_key) -> None:
    first = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="a",
                          leader_lease_ttl_s=10, leader_renew_deadline_s=7.0)
    second = first.with_overrides(instance_id="b")
    async with running_scheduler(first) as a, running_scheduler(second) as b:
        await wait_for(lambda: a.leader.is_leader or b.leader.is_leader, timeout=15)
        leader, standby = (a, b) if a.leader.is_leader else (b, a)
        lead = leader.leader.leadership
        assert lead is not None
        await leader.etcd.txn([], [Delete(lead.key)])  # by hand, while its lease lives
        # the lease lives on for 10 s: only the key check ends the old term this soon
        await wait_for(lambda: not leader.leader.is_leader
                       or leader.leader.leadership is not lead, timeout=4,
                       message="the old leader still leads with its key deleted")
        await wait_for(lambda: leader.leader.is_leader != standby.leader.is_leader,
                       timeout=20, message="no single leader after the deletion")


class SteppedDatetime(real_datetime.datetime):
    """``datetime`` whose now() is shifted by ``offset`` seconds (a wall clock step)."""

    offset = 0.0

    @classmethod
    def now(cls, tz=None):  # type: ignore[no-untyped-def,override]
        return real_datetime.datetime.now(tz) + real_datetime.timedelta(seconds=cls.offset)


async def test_a_wall_clock_stepped_back_does_not_silence_the_leader_loops(
        etcd_server, redis_server, key_root, stream_key, monkeypatch) -> None:
    for module in (apscheduler_base, apscheduler_executors, leadership_module, clock_module):
        monkeypatch.setattr(module, "datetime", SteppedDatetime)
    monkeypatch.setattr(SteppedDatetime, "offset", 0.0)
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             reconcile_interval_s=0.5)
    async with running_scheduler(settings) as sched:
        await wait_for(lambda: sched.leader.is_leader, timeout=15)
        cycles = sched.metrics.reconcile_cycles
        await wait_for(lambda: counter_total(cycles) >= 2, timeout=10)
        monkeypatch.setattr(SteppedDatetime, "offset", -60.0)  # NTP steps the clock back
        before = counter_total(cycles)
        await wait_for(lambda: counter_total(cycles) >= before + 3, timeout=10,
                       message="no reconcile cycle after the clock stepped back")


async def test_a_cluster_that_lost_its_state_is_in_recovery_before_it_serves(
        etcd_server, redis_server, key_root, stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    etcd = AsyncEtcd([etcd_server.endpoint])
    try:
        await etcd.txn([], [Put(KeyLayout(key_root).initialized, b"2026-01-01T00:00:00Z")])
    finally:
        etcd.close()
    async with running_scheduler(settings) as sched:
        # right after start() returned: no window in which the mode still says normal
        assert sched.mode.mode == "recovery"
        assert not sched.mode.writable


async def test_an_etcd_that_refuses_writes_puts_the_replica_in_degraded_mode(
        etcd_private, redis_server, key_root, stream_key) -> None:
    """NOSPACE: etcd answers reads and refuses every write. The replica says so (degraded,
    mutations refused up front) instead of staying normal while every write fails."""
    settings = make_settings(etcd_private, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        await wait_for(lambda: sched.mode.mode == "normal", timeout=15)
        header = (await sched.etcd.post("/kv/range", {"key": "AA=="})).get("header", {})
        alarm = {"memberID": header["member_id"], "alarm": "NOSPACE"}
        await sched.etcd.post("/maintenance/alarm", {"action": "ACTIVATE", **alarm})
        try:
            await wait_for(lambda: sched.mode.mode == "degraded", timeout=15,
                           message="still normal with writes refused")
            assert "NOSPACE" in sched.mode.reason
        finally:
            await sched.etcd.post("/maintenance/alarm", {"action": "DEACTIVATE", **alarm})
        await wait_for(lambda: sched.mode.mode == "normal", timeout=15)


@pytest.mark.parametrize(("probe", "mode"), [
    (Probe(etcd_ok=True, initialized=True, has_state=True, allow_empty_state=False), NORMAL),
    (Probe(etcd_ok=True, initialized=True, has_state=True, allow_empty_state=False,
           alarms=("NOSPACE",)), DEGRADED),
    (Probe(etcd_ok=False, initialized=False, has_state=False, allow_empty_state=False,
           alarms=("NOSPACE",)), DEGRADED),
    (Probe(etcd_ok=True, initialized=True, has_state=False, allow_empty_state=False,
           alarms=("CORRUPT",)), DEGRADED),
    (Probe(etcd_ok=True, initialized=True, has_state=False, allow_empty_state=False), RECOVERY),
])
def test_mode_table(probe: Probe, mode: str) -> None:
    assert decide_mode(probe)[0] == mode


async def test_a_cycle_in_flight_at_a_loss_or_a_stop_ends_without_an_error(
        etcd_server, redis_server, key_root, stream_key, caplog) -> None:
    """APScheduler logs a job it cancels at shutdown as failed (ERROR, traceback): the
    loops' own cycles must be ended first, at a loss as at a stop."""
    caplog.set_level(logging.INFO)
    started: list[int] = []
    ended: list[int] = []

    async def blocker() -> None:
        started.append(1)
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(1)

    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             leader_lease_ttl_s=10, leader_renew_deadline_s=7.0)
    async with running_scheduler(settings) as sched:
        await wait_for(lambda: sched.leader.is_leader, timeout=15, message="no leader")
        sched.leader.loops.append(Loop("blocker", 3600.0, blocker))
        lead = sched.leader.leadership
        assert lead is not None
        await sched.etcd.txn([], [Delete(lead.key)])  # a loss, then leadership again
        await wait_for(lambda: started, timeout=20, message="the loop never ran")
        lead = sched.leader.leadership
        assert lead is not None
        await sched.etcd.txn([], [Delete(lead.key)])  # a loss with the cycle in flight
        await wait_for(lambda: ended and len(started) == 2, timeout=20,
                       message="the cycle was not ended at the loss, or no new leadership")
    # ... and the stop met the second one
    assert len(ended) == len(started) == 2
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failed, [r.getMessage() for r in failed]
