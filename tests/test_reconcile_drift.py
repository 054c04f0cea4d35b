"""Drift detection and remediation on real etcd and Redis with simulated nodes.

Each test drives the cycles that detect drift itself (``run_once(drift=True)``), on the stack
of ``tests.fixtures.reconcile``. What is checked: docs/compatibility.md, "Drift detection" and
"Drift adoption".
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from eventsource.etcd import Put
from eventsource.records import WorkloadSpec, WorkloadStatus, encode
from handlers.reconcile import planning as loops_module
from handlers.reconcile.planner.workload import REAPPLY
from tests.fixtures.harness import make_settings
from tests.fixtures.metrics import counter_total
from tests.fixtures.reconcile import QUIET, agent_apply, stack
from tests.fixtures.waiting import wait_for


async def test_drift_waits_for_projections_that_show_etcd_before_the_listing(
        etcd_server, redis_server, key_root, stream_key, monkeypatch):
    """A workload another replica created (in etcd, and on its agent) while this replica's
    projections were frozen behind etcd is no orphan: drift is skipped until they catch up."""
    monkeypatch.setattr(loops_module, "DRIFT_FRESHNESS_WAIT_S", 0.3)
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_lease_ttl_s=3600, heartbeat_interval_s=600, **QUIET)
    async with stack(settings, 1, heartbeat_interval_s=900) as s:
        s.fleet.hold_control(True)
        await s.caught_up()
        node = s.fleet.nodes[0]
        cluster = s.sched.cluster
        held: list[Any] = []
        fold = cluster.apply
        cluster.apply = held.append  # type: ignore[method-assign]  # the watch falls behind
        spec = WorkloadSpec(id="fresh", type="container", image="rogue:1",
                            desired_state="Running", revision_id="rev-f")
        status = WorkloadStatus(id="fresh", node_id=node.node_id, assigned_node=node.node_id,
                                status="Running")
        layout = s.sched.layout
        await s.sched.etcd.txn([], [Put(layout.spec("fresh"), encode(spec)),
                                    Put(layout.status("fresh"), encode(status))])
        await agent_apply(node.endpoint, "fresh", "rev-f")
        report = await s.loops.reconcile.run_once(drift=True)
        assert not report.drift
        assert report.drifts == []
        assert "fresh" in node.workload_ids()
        # caught up: drift runs, and the workload is known (the projection may need a progress
        # notification to pass a revision written outside its root: the real wait applies)
        cluster.apply = fold  # type: ignore[method-assign]
        for batch in held:
            fold(batch)
        monkeypatch.setattr(loops_module, "DRIFT_FRESHNESS_WAIT_S", 5.0)
        report = await s.loops.reconcile.run_once(drift=True)
        assert report.drift
        assert not any(f.workload_id == "fresh" for f in report.drifts)
        assert "fresh" in node.workload_ids()


async def test_each_drift_type_is_detected_and_remediated(etcd_server, redis_server, key_root,
                                                          stream_key):
    # heartbeats are rare here (the fleet's seeded spread puts the next ones minutes away), so
    # the drift the test injects is not repaired by a heartbeat before the cycle sees it
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_lease_ttl_s=3600, heartbeat_interval_s=600, **QUIET)
    async with stack(settings, 2, heartbeat_interval_s=900) as s:
        ids = ["killed", "relabelled", "old-rev", "moved"]
        await s.apply(ids)
        await wait_for(lambda: all(s.agent_state(w) == "Running" for w in ids), timeout=15)
        # from here on no heartbeat at all: the first one after registration is spread over
        # the interval and could otherwise land in this test's few seconds (a rare flake)
        s.fleet.hold_control(True)
        await s.caught_up()
        a_node = s.holder("moved")
        other = next(n for n in s.fleet.nodes if n is not a_node)
        # missing_on_agent
        s.holder("killed").kill_workloads(["killed"])
        # orphan_on_agent (unknown to the scheduler) and an adoption (runs on the other node)
        await agent_apply(other.endpoint, "stray", "rev-x")
        a_node.kill_workloads(["moved"])
        moved_rev = s.sched.cluster.specs.get("moved").value.revision_id  # type: ignore[union-attr]
        await agent_apply(other.endpoint, "moved", moved_rev)
        # revision_mismatch: the agent runs another revision
        await agent_apply(s.holder("old-rev").endpoint, "old-rev", "rev-old")

        # state_mismatch: the scheduler believes Stopped while the agent runs it
        def to_stopped(st: Any) -> list[Any]:
            st.status = "Stopped"
            st.status_info.actual_state = "Stopped"
            return []

        await s.sched.writer.update_status("relabelled", to_stopped)
        await wait_for(lambda: all(
            n.workload_state(w) == "Running" for n, w in
            ((other, "stray"), (other, "moved"), (s.holder("old-rev"), "old-rev"))), timeout=10)
        await s.caught_up()
        # past the 45 s default guard of every apply so far (nothing is "in flight")
        now = s.sched.clock.now() + timedelta(seconds=60)

        report = await s.loops.reconcile.run_once(now=now, drift=True)
        assert report.drift
        found = {(f.drift_type, f.workload_id, f.action) for f in report.drifts}
        assert found == {
            ("missing_on_agent", "killed", "retry_and_reconcile"),
            ("orphan_on_agent", "stray", "delete_orphan_on_agent"),
            ("orphan_on_agent", "moved", "reassign_to_reporting_node"),
            ("revision_mismatch", "old-rev", "reapply_scheduler_revision"),
            ("state_mismatch", "relabelled", "align_scheduler_status"),
        }
        await s.caught_up()
        # remediated
        assert other.workload_state("stray") is None
        assert s.status("moved").node_id == other.node_id
        assert s.status("relabelled").status == "Running"
        await wait_for(lambda: s.holder("killed").workload_state("killed") == "Running",
                       timeout=10)
        spec_rev = s.sched.cluster.specs.get("old-rev").value.revision_id  # type: ignore[union-attr]
        await wait_for(lambda: _agent_revision(s.holder("old-rev"), "old-rev") == spec_rev,
                       timeout=10)
        allocation = s.sched.cluster.allocations.get(other.node_id)
        assert allocation is not None
        assert "moved" in allocation.value.workloads
        # records under /drifts/ and DriftDetected events (each once)
        page = await s.sched.etcd.range_prefix(s.sched.layout.drifts_prefix)
        types = {kv.key.rsplit("/", 1)[-1] for kv in page.kvs}
        assert types == {"missing_on_agent", "orphan_on_agent", "revision_mismatch",
                         "state_mismatch"}
        events = await wait_for(lambda: _at_least(s.events("DriftDetected"), 5), timeout=10)
        assert {e.reason for e in events} == types
        assert all(e.details["resolved"] == "true" for e in events)

        # the same finding within 2 minutes is detected (and remediated) but not recorded again
        # (first a plain cycle settles the statuses of the re-applied workloads: no heartbeat
        # mirrors their agents' Running here)
        await wait_for(lambda: s.holder("killed").workload_state("killed") == "Running")
        settled = await s.loops.reconcile.run_once(now=now + timedelta(seconds=30))
        assert settled.failed == {}
        await s.caught_up()
        s.holder("killed").kill_workloads(["killed"])
        drift_txns = counter_total(s.sched.metrics.etcd_txns, kind="drift")
        report = await s.loops.reconcile.run_once(now=now + timedelta(seconds=60), drift=True)
        assert [f.drift_type for f in report.drifts] == ["missing_on_agent"]
        assert report.succeeded[REAPPLY] == 1
        assert counter_total(s.sched.metrics.etcd_txns, kind="drift") == drift_txns


def _agent_revision(node: Any, wid: str) -> str:
    held = node._workloads.get(wid)
    return held.revision_id if held is not None else ""


async def _at_least(fetch: Any, n: int) -> list[Any] | None:
    got = await fetch
    return got if len(got) >= n else None
