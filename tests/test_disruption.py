"""The disruption guard: which lost nodes may have their workloads moved, and when.

Pure decisions by table and Hypothesis; then, on real etcd and Redis with simulated nodes, a
rate-limited eviction (one lost node moves, the other waits and keeps its workloads when it
comes back) and a disruption hold (most nodes lost at once: NotReady, nothing moves).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventsource.etcd import Delete
from eventsource.records import WorkloadSpec, WorkloadStatus
from handlers.reconcile.disruption import (
    Bucket,
    EvictionGate,
    EvictionPolicy,
    decide_evictions,
    disrupted,
)
from handlers.reconcile.planner.inputs import NodeView
from handlers.reconcile.planner.workload import AWAIT_EVICTION, AWAIT_NODE, FAILOVER, plan_workload
from handlers.settings.config import load_settings
from handlers.settings.reader import ConfigError
from handlers.workloads.retry import RetryPolicy
from tests.fixtures.harness import make_settings
from tests.fixtures.reconcile import QUIET, Stack, stack
from tests.fixtures.waiting import wait_for

POLICY = EvictionPolicy(rate_per_s=0.5, burst=2, unhealthy_threshold=0.55)


def _decide(candidates: list[str], admitted: set[str] | None = None, *, unavailable: int = 1,
            owned: int = 100, tokens: float = 2.0, elapsed: float = 0.0,
            policy: EvictionPolicy = POLICY) -> Any:
    return decide_evictions(candidates, admitted or set(), unavailable=unavailable, owned=owned,
                            bucket=Bucket(tokens, 100.0), now=100.0 + elapsed, policy=policy)


# -- pure: tables -------------------------------------------------------------------------------


@pytest.mark.parametrize(("unavailable", "owned", "expected"), [
    (0, 0, False),
    (2, 2, False),      # fewer than MIN_UNHEALTHY is never a disruption
    (3, 5, True),       # 60% >= 55%
    (3, 6, False),      # 50%
    (55, 100, True),
    (54, 100, False),
    (1_376, 5_000, False),  # the 100,000-workload run: a rate limit, not a hold
])
def test_disruption_threshold(unavailable: int, owned: int, expected: bool) -> None:
    assert disrupted(unavailable, owned, POLICY) is expected


def test_burst_admits_oldest_first_and_the_rest_wait() -> None:
    d = _decide(["a", "b", "c"], unavailable=3)
    assert (d.newly, d.waiting, d.disrupted) == (("a", "b"), ("c",), False)
    assert d.admitted == {"a", "b"}
    assert d.bucket.tokens == 0.0


def test_tokens_refill_with_time_up_to_the_burst() -> None:
    assert _decide(["a", "b", "c"], tokens=0.0, elapsed=2.0, unavailable=3).newly == ("a",)
    assert _decide(["a", "b", "c"], tokens=0.0, elapsed=1.9, unavailable=3).newly == ()
    # a long quiet time refills to the burst, not beyond
    assert _decide(["a", "b", "c"], tokens=0.0, elapsed=3_600, unavailable=3).newly == ("a", "b")


def test_earlier_admissions_stay_without_a_token_and_recovered_nodes_drop_out() -> None:
    d = _decide(["b", "c"], {"a", "b"}, tokens=0.0, unavailable=2)
    assert d.admitted == {"b"}
    assert d.newly == ()
    assert d.waiting == ("c",)


def test_disruption_withdraws_every_admission() -> None:
    d = _decide(["a", "b", "c"], {"a"}, unavailable=60, owned=100)
    assert d.disrupted
    assert d.admitted == frozenset()
    assert d.newly == ()
    assert d.waiting == ("a", "b", "c")


def test_rate_zero_means_no_limit() -> None:
    unlimited = EvictionPolicy(rate_per_s=0.0, burst=1, unhealthy_threshold=1.0)
    d = _decide([f"n{i}" for i in range(50)], tokens=0.0, unavailable=50, policy=unlimited)
    assert len(d.newly) == 50
    assert d.waiting == ()


def test_gate_orders_by_first_seen_and_allows_nodes_without_a_record() -> None:
    gate = EvictionGate(EvictionPolicy(rate_per_s=0.001, burst=1, unhealthy_threshold=1.0))

    def views(*down: str) -> dict[str, NodeView]:
        return {n: NodeView(n, True, "NotReady" if n in down else "Ready", n not in down)
                for n in ("a", "b", "c", "d")}

    first = gate.update(views("c"), ["c"], now=1.0)
    assert first.newly == ("c",)
    second = gate.update(views("b", "c"), ["b", "c"], now=2.0)
    assert second.newly == ()
    assert second.waiting == ("b",)
    assert gate.allows("c", views("b", "c"))
    assert not gate.allows("b", views("b", "c"))
    assert gate.allows("gone", views("b", "c"))
    # c came back: it is no longer a candidate; b was lost before a (newer) and goes first
    third = gate.update(views("a", "b"), ["a", "b"], now=2_000.0)
    assert third.newly == ("b",)
    assert third.waiting == ("a",)


def test_plan_waits_for_admission_before_moving() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    spec = WorkloadSpec(id="w", type="container", desired_state="Running")
    status = WorkloadStatus(id="w", node_id="n1", status="Running")

    def plan(evictable: bool, spec: WorkloadSpec = spec) -> str:
        return plan_workload(spec, status, None, node_available=False, node_observed=False,
                             now=now, policy=RetryPolicy(), evictable=evictable).kind

    assert plan(True) == FAILOVER
    assert plan(False) == AWAIT_EVICTION
    local = WorkloadSpec(id="w", type="vm", desired_state="Running")
    assert plan(False, local) == AWAIT_NODE


# -- pure: the promise, for any sequence of decisions -------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sets(st.sampled_from("abcdefgh")), st.floats(0, 30),
                          st.integers(0, 10)), min_size=1, max_size=30),
       st.floats(0.01, 2.0), st.integers(1, 5))
def test_admissions_never_exceed_burst_plus_rate(steps: list[tuple[set[str], float, int]],
                                                 rate: float, burst: int) -> None:
    policy = EvictionPolicy(rate_per_s=rate, burst=burst, unhealthy_threshold=0.55)
    bucket = Bucket(float(burst), 0.0)
    admitted: frozenset[str] = frozenset()
    now = 0.0
    total = 0
    for lost, gap, healthy in steps:
        now += gap
        candidates = sorted(lost)
        d = decide_evictions(candidates, admitted, unavailable=len(lost),
                             owned=len(lost) + healthy, bucket=bucket, now=now, policy=policy)
        assert d.admitted <= set(candidates)
        assert set(d.newly).isdisjoint(admitted)
        if d.disrupted:
            assert not d.admitted
            assert not d.newly
        else:  # every candidate is admitted or waits, never both
            assert d.admitted | set(d.waiting) == set(candidates)
            assert d.admitted.isdisjoint(d.waiting)
        total += len(d.newly)
        assert total <= burst + rate * now + 1e-9
        bucket, admitted = d.bucket, d.admitted


# -- on real servers ----------------------------------------------------------------------------


def _gauge(gauge: Any) -> float:
    return float(next(iter(gauge.collect())).samples[0].value)


async def _spread(s: Stack, count: int) -> dict[str, list[str]]:
    ids = [f"w-{i}" for i in range(count)]
    await s.apply(ids)
    await s.caught_up()
    await s.running(ids)
    on: dict[str, list[str]] = {}
    for wid in ids:
        on.setdefault(s.status(wid).node_id, []).append(wid)
    return on


@pytest.mark.timeout(120)
async def test_rate_limited_eviction_moves_one_node_and_the_other_keeps_its_workloads(
        etcd_server, redis_server, key_root, stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_lease_ttl_s=3, node_eviction_rate=0.0001,
                             node_eviction_burst=1, **QUIET)
    async with stack(settings, 5) as s:
        on = await _spread(s, 10)
        first, second = sorted(on)[:2]
        await s.fleet.node(first).crash()
        await wait_for(lambda: all(s.status(w).node_id != first for w in on[first]),
                       timeout=20, message="the first lost node's workloads move")
        # and run where they moved: an apply still in flight to the second node when it
        # crashes would be lost with it, and its re-apply waits out the re-apply backoff
        await s.running(on[first])
        await s.fleet.node(second).crash()
        await wait_for(lambda: s.sched.cluster.nodes.get(second).value.status  # type: ignore[union-attr]
                       == "NotReady", timeout=20)
        metrics = s.sched.metrics
        await wait_for(lambda: _gauge(metrics.evictions_waiting) == 1, timeout=10)
        # what the second node holds now: the first node's workloads may have moved onto it
        held = sorted(w for ws in on.values() for w in ws if s.status(w).node_id == second)
        assert set(on[second]) <= set(held)
        report = await wait_for(lambda: _cycle(s), timeout=10)
        assert report.actions.get(AWAIT_EVICTION) == len(held)
        await s.caught_up()
        assert {s.status(w).node_id for w in held} == {second}
        moved = await s.events("Rescheduled")
        assert {e.details["previous_node"] for e in moved} == {first}

        await s.fleet.node(second).restart(keep_workloads=True)
        await wait_for(lambda: s.sched.cluster.nodes.get(second).value.status  # type: ignore[union-attr]
                       == "Ready", timeout=20)
        await wait_for(lambda: _gauge(metrics.evictions_waiting) == 0, timeout=10)
        await s.running(held)
        assert {s.status(w).node_id for w in held} == {second}


async def _cycle(s: Stack) -> Any:
    report = await s.loops.reconcile.run_once()
    return None if report.skipped else report


@pytest.mark.timeout(120)
async def test_most_nodes_lost_at_once_hold_every_eviction(
        etcd_server, redis_server, key_root, stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_lease_ttl_s=600, **QUIET)
    async with stack(settings, 5) as s:
        on = await _spread(s, 10)
        victims = sorted(on)[:3]
        for node_id in victims:
            await s.fleet.node(node_id).crash()
        # "at once": their liveness keys vanish in one revision (expiring leases would go one by
        # one, and a monitor tick between two of them rightly moves the first node's workloads)
        layout = s.sched.layout
        await s.sched.etcd.txn([], [Delete(layout.alive(n)) for n in victims])
        metrics = s.sched.metrics
        await wait_for(lambda: all(s.sched.cluster.nodes.get(n).value.status  # type: ignore[union-attr]
                                   == "NotReady" for n in victims), timeout=20)
        await wait_for(lambda: _gauge(metrics.evictions_held) == 1, timeout=10)
        report = await wait_for(lambda: _cycle(s), timeout=10)
        held = sum(len(on[n]) for n in victims)
        assert report.actions.get(AWAIT_EVICTION) == held
        assert await s.events("Rescheduled") == []
        assert len(await s.events("NodeLost")) == 3

        for node_id in victims:
            await s.fleet.node(node_id).restart(keep_workloads=True)
        await wait_for(lambda: _gauge(metrics.evictions_held) == 0, timeout=20)
        everything = [w for ids in on.values() for w in ids]
        await s.running(everything)
        assert {w: s.status(w).node_id for w in everything} == {
            w: n for n, ids in on.items() for w in ids}
        assert await s.events("Rescheduled") == []


def test_settings_read_and_reject_with_the_variable_named() -> None:
    settings = load_settings({"SCHEDULER_NODE_EVICTION_RATE": "0.5",
                              "SCHEDULER_NODE_EVICTION_BURST": "3",
                              "SCHEDULER_UNHEALTHY_NODE_THRESHOLD": "0.7"})
    assert (settings.node_eviction_rate, settings.node_eviction_burst,
            settings.unhealthy_node_threshold) == (0.5, 3, 0.7)
    defaults = load_settings({})
    assert (defaults.node_eviction_rate, defaults.node_eviction_burst,
            defaults.unhealthy_node_threshold) == (1.0, 10, 0.55)
    for name, value in [("SCHEDULER_NODE_EVICTION_RATE", "fast"),
                        ("SCHEDULER_NODE_EVICTION_RATE", "-1"),
                        ("SCHEDULER_UNHEALTHY_NODE_THRESHOLD", "1.5"),
                        ("SCHEDULER_UNHEALTHY_NODE_THRESHOLD", "nan"),
                        ("SCHEDULER_NODE_EVICTION_BURST", "0")]:
        with pytest.raises(ConfigError, match=name):
            load_settings({name: value})
