"""The reconcile loop on failing applies: the retry budget, a stop racing a planned re-apply,
a retry clearing a failure, and a node that lacks a runtime (real etcd, Redis and agents)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from handlers.reconcile.planner.workload import (
    BACKOFF_WAIT,
    COUNT_FAILURE,
    REAPPLY,
    TERMINAL,
)
from handlers.workloads.retry import REAPPLY_ATTEMPTS
from ops.sim.config import NodeBehaviour
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import make_settings
from tests.fixtures.reconcile import QUIET, last_apply, stack
from tests.fixtures.waiting import wait_for

# -- retry budget --------------------------------------------------------------------------------

#: (seconds after the first observed failure, the action of that cycle, attempts after it)
RETRY_SCHEDULE = [
    (0, COUNT_FAILURE, 1), (5, REAPPLY, 1), (10, COUNT_FAILURE, 2), (15, REAPPLY, 2),
    (20, COUNT_FAILURE, 3), (22, BACKOFF_WAIT, 3), (25, REAPPLY, 3), (30, COUNT_FAILURE, 4),
    (35, BACKOFF_WAIT, 4), (40, REAPPLY, 4), (45, COUNT_FAILURE, 4), (50, BACKOFF_WAIT, 4),
    (55, REAPPLY, 4), (60, COUNT_FAILURE, 4), (70, REAPPLY, 4), (75, COUNT_FAILURE, 4),
    (85, REAPPLY, 4), (90, COUNT_FAILURE, 4), (100, REAPPLY, 4), (105, COUNT_FAILURE, 4),
    (115, REAPPLY, 4), (120, COUNT_FAILURE, 5), (125, TERMINAL, 5), (300, TERMINAL, 5),
]


async def test_failing_apply_goes_retry_pending_then_failed_on_schedule(
        etcd_server, redis_server, key_root, stream_key):
    # rare heartbeats: a heartbeat mirrors the agent's "Failed" over "RetryPending", which is
    # harmless (failures are counted per apply attempt) but would blur the status assertions
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_lease_ttl_s=3600, heartbeat_interval_s=600, **QUIET)
    behaviour = NodeBehaviour(apply_latency_s=0.02, failure_rate=1.0)
    async with stack(settings, 1, behaviour=behaviour, heartbeat_interval_s=900) as s:
        await s.apply(["bad"])
        node = s.fleet.nodes[0]
        await wait_for(lambda: node.workload_state("bad") == "Failed", timeout=10)
        await s.caught_up()
        base = last_apply(s.status("bad")) + timedelta(seconds=1)
        seen: list[tuple[int, str, int, str]] = []
        for offset, _, _ in RETRY_SCHEDULE:
            await wait_for(lambda: node.workload_state("bad") == "Failed", timeout=10)
            applies = s.fleet.counters.rpcs["ApplyWorkload"]
            report = await s.loops.reconcile.run_once(now=base + timedelta(seconds=offset))
            assert report.skipped == ""
            [kind] = report.actions
            await s.caught_up()
            st = s.status("bad")
            sent = s.fleet.counters.rpcs["ApplyWorkload"] - applies
            assert sent == (1 if kind == REAPPLY else 0), (offset, kind)
            seen.append((offset, kind, st.retry.attempts, st.status))
            if kind == COUNT_FAILURE:
                want = "Failed" if st.retry.attempts >= 5 else "RetryPending"
                assert st.status == want, (offset, st.status)
                assert st.retry.attempts <= 4 or offset >= 120  # never exhausted inside grace
        assert [(o, k, a) for o, k, a, _ in seen] == RETRY_SCHEDULE
        final = s.status("bad")
        assert final.status == "Failed"
        assert final.status_info.actual_state == "Failed"
        assert final.metadata["last_action"] == "RetryExhausted"
        failed = await wait_for(lambda: s.events("WorkloadFailed", workload_id="bad"),
                                timeout=10)
        assert failed[0].details["attempts"] == "5"
        triggered = await s.events("RetryTriggered", workload_id="bad")
        assert len(triggered) == sum(1 for _, k, a in RETRY_SCHEDULE
                                     if k == COUNT_FAILURE and a < 5)


async def test_a_stop_after_the_plan_is_not_undone_by_the_planned_reapply(
        etcd_server, redis_server, key_root, stream_key):
    """The cycle plans a re-apply (the agent lost the workload); the user stops it before the
    action runs. The stale re-apply is not sent, and arms no re-apply guard."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_lease_ttl_s=3600, heartbeat_interval_s=600, **QUIET)
    async with stack(settings, 1, heartbeat_interval_s=900) as s:
        await s.apply(["svc"])
        await wait_for(lambda: s.agent_state("svc") == "Running", timeout=15)
        s.fleet.hold_control(True)
        node = s.holder("svc")
        node.kill_workloads(["svc"])
        await s.caught_up()
        now = last_apply(s.status("svc")) + timedelta(seconds=60)
        loop = s.loops.reconcile
        original = loop._apply

        async def stopped_first(action: Any, views: Any, report: Any, when: Any) -> bool:
            resp = await s.stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="svc", desired_state="stop"))
            assert resp.success, resp
            await s.caught_up()
            await wait_for(lambda: node.workload_state("svc") == "Stopped", timeout=10)
            result: bool = await original(action, views, report, when)
            return result

        loop._apply = stopped_first  # type: ignore[method-assign]
        try:
            report = await loop.run_once(now=now)
        finally:
            loop._apply = original  # type: ignore[method-assign]
        assert report.actions == {REAPPLY: 1}, report
        await s.caught_up()
        assert node.workload_state("svc") == "Stopped"
        assert REAPPLY_ATTEMPTS not in s.status("svc").metadata


async def test_a_retry_clears_a_non_retryable_failure_reason(
        etcd_server, redis_server, key_root, stream_key):
    """``failure_reason`` (the agent's, merged into the status) halts re-applies; RetryWorkload
    clears it, or the next cycle would mark the running workload Failed again."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_lease_ttl_s=3600, heartbeat_interval_s=600, **QUIET)
    async with stack(settings, 1, heartbeat_interval_s=900) as s:
        await s.apply(["img"])
        await wait_for(lambda: s.agent_state("img") == "Running", timeout=15)
        s.fleet.hold_control(True)
        node = s.holder("img")

        def agent_said_invalid_image(status: Any) -> list[Any]:
            status.metadata["failure_reason"] = "INVALID_IMAGE"
            return []

        await s.sched.writer.update_status("img", agent_said_invalid_image)
        node.kill_workloads(["img"])
        await s.caught_up()
        now = last_apply(s.status("img")) + timedelta(seconds=60)
        await s.loops.reconcile.run_once(now=now)
        await s.caught_up()
        assert s.status("img").status == "Failed"
        resp = await s.stub.RetryWorkload(pb.RetryWorkloadRequest(workload_id="img"))
        assert resp.accepted
        await s.caught_up()
        await wait_for(lambda: node.workload_state("img") == "Running", timeout=10)
        assert "failure_reason" not in s.status("img").metadata
        await s.loops.reconcile.run_once(now=now + timedelta(seconds=120))
        await s.caught_up()
        assert s.status("img").status != "Failed"


async def test_a_node_without_the_runtime_gets_no_more_of_that_type(
        etcd_server, redis_server, key_root, stream_key):
    """An apply answered "runtime not available" takes that type off the node and unassigns
    the workload (Pending, allocation released, Rescheduled); the next cycle places it on a
    node that can run it (docs/compatibility.md, "Runtime unsupported")."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_lease_ttl_s=3600, heartbeat_interval_s=600, **QUIET)
    async with stack(settings, 2, heartbeat_interval_s=900) as s:
        await s.apply(["rt"])
        await wait_for(lambda: s.agent_state("rt") == "Running", timeout=15)
        s.fleet.hold_control(True)
        broken = s.holder("rt")
        broken.behaviour = dataclasses.replace(broken.behaviour, missing_runtimes=["container"])
        broken.kill_workloads(["rt"])
        await s.caught_up()
        now = last_apply(s.status("rt")) + timedelta(seconds=60)
        await s.loops.reconcile.run_once(now=now)
        await s.caught_up()
        status = s.status("rt")
        assert (status.node_id, status.status) == ("", "Pending")
        assert status.metadata["last_action"] == "RuntimeUnsupportedReschedulePending"
        node = s.sched.cluster.nodes.get(broken.node_id).value  # type: ignore[union-attr]
        assert "container" not in node.supported_workload_types
        alloc = s.sched.cluster.allocations.get(broken.node_id)
        assert alloc is None or "rt" not in alloc.value.workloads
        await s.loops.reconcile.run_once(now=now + timedelta(seconds=1))
        await s.caught_up()
        assert s.status("rt").node_id not in ("", broken.node_id)
        await wait_for(lambda: s.agent_state("rt") == "Running", timeout=15)
        moved = await wait_for(lambda: s.events("Rescheduled", workload_id="rt"), timeout=10)
        assert moved[0].node_id == broken.node_id
