"""Pure tests of the drift classification (orphans, duplicates, adoption, the deduper) and the
node monitor's plan (lost nodes, nodes to collect): docs/compatibility.md, "Drift detection",
"Drift adoption" and "Node lifecycle".

No sockets and no clock: every decision takes ``now``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eventsource.events import rfc3339
from eventsource.records import Node, WorkloadSpec, WorkloadStatus
from handlers.reconcile.planner.drift import (
    ADOPT,
    ALIGN_STATUS,
    AWAIT_OWNER_APPLY,
    DELETE_DUPLICATE,
    DELETE_ORPHAN,
    DELETE_RESIDUAL,
    FAILOVER_REASSIGN,
    INVESTIGATE,
    MAX_ORPHANS_PER_NODE,
    MISSING_ON_AGENT,
    ORPHAN,
    REASSIGN,
    REASSIGN_MISSING_OWNER,
    REBIND_ROTATED,
    REVISION_MISMATCH,
    STATE_MISMATCH,
    DriftDeduper,
    classify_drift,
)
from handlers.reconcile.planner.inputs import NodeObservation, NodeView, node_view
from handlers.reconcile.planner.monitor import NodeCheck, plan_node_monitor
from tests.fixtures.planning import (
    APPLIED_JUST_NOW,
    APPLIED_LONG_AGO,
    POLICY,
    T0,
    at,
    seen,
    spec,
    status,
)

# -- drift -----------------------------------------------------------------------------------

def drift_world() -> tuple[dict[str, WorkloadSpec], dict[str, WorkloadStatus],
                           dict[str, NodeView]]:
    specs = {w: spec(w) for w in ("ok", "gone", "mis", "rev", "dup", "moved", "dead-owner",
                                  "ghost-owner", "fresh")}
    specs["rev"].revision_id = "rev-2"
    specs["del"] = spec("del", desired="Deleted")
    statuses = {w: status(w, node="n1", **APPLIED_LONG_AGO) for w in specs}
    statuses["mis"].status = "Running"
    statuses["dup"] = status("dup", node="n1", **APPLIED_LONG_AGO)
    statuses["moved"] = status("moved", node="n1", **APPLIED_LONG_AGO)
    statuses["dead-owner"] = status("dead-owner", node="n3", **APPLIED_LONG_AGO)
    statuses["ghost-owner"] = status("ghost-owner", node="n9", **APPLIED_LONG_AGO)
    statuses["fresh"] = status("fresh", node="n1", **APPLIED_JUST_NOW)
    statuses["del"].status = "Deleting"
    nodes = {
        "n1": node_view("n1", Node(node_id="n1", status="Ready", agent_endpoint="h1:1"),
                        alive=True),
        "n2": node_view("n2", Node(node_id="n2", status="Ready", agent_endpoint="h2:1"),
                        alive=True),
        "n3": node_view("n3", Node(node_id="n3", status="NotReady", agent_endpoint="h3:1"),
                        alive=False),
    }
    return specs, statuses, nodes


def test_classify_each_drift_type() -> None:
    specs, statuses, nodes = drift_world()
    observations = {
        "n1": NodeObservation("n1", True, {
            "ok": seen("Running", "ok"), "mis": seen("Failed", "mis"),
            "rev": seen("Running", "rev", revision="rev-1"), "dup": seen("Running", "dup"),
            "del": seen("Running", "del")}),
        "n2": NodeObservation("n2", True, {
            "stray": seen("Running", "stray"), "dup": seen("Running", "dup"),
            "moved": seen("Running", "moved"), "dead-owner": seen("Running", "dead-owner"),
            "ghost-owner": seen("Running", "ghost-owner")}),
    }
    expected = {"n1": {w for w, s in statuses.items() if s.node_id == "n1"},
                "n2": set()}
    found = classify_drift(specs, statuses, expected=expected, nodes=nodes,
                           observations=observations, now=T0, policy=POLICY)
    got = {(f.node_id, f.workload_id, f.drift_type, f.action) for f in found}
    assert got == {
        ("n1", "del", ORPHAN, DELETE_RESIDUAL),
        ("n1", "mis", STATE_MISMATCH, ALIGN_STATUS),
        ("n1", "rev", REVISION_MISMATCH, REAPPLY_REVISION_ACTION),
        ("n1", "gone", MISSING_ON_AGENT, "retry_and_reconcile"),
        ("n2", "stray", ORPHAN, DELETE_ORPHAN),
        ("n2", "dup", ORPHAN, DELETE_DUPLICATE),
        ("n2", "moved", ORPHAN, REASSIGN),
        ("n2", "dead-owner", ORPHAN, FAILOVER_REASSIGN),
        ("n2", "ghost-owner", ORPHAN, REASSIGN_MISSING_OWNER),
    }
    # "fresh" was applied a second ago: not missing yet (in flight); "moved" was adopted by n2, so
    # it is not also reported missing on n1


REAPPLY_REVISION_ACTION = "reapply_scheduler_revision"


def test_orphan_adopted_once_and_in_flight_owner_waits() -> None:
    specs = {"w": spec("w")}
    statuses = {"w": status("w", node="", state="Pending")}
    nodes = {n: node_view(n, Node(node_id=n, status="Ready"), alive=True) for n in ("a", "b")}
    observations = {n: NodeObservation(n, True, {"w": seen("Running", "w")}) for n in nodes}
    found = classify_drift(specs, statuses, expected={}, nodes=nodes,
                           observations=observations, now=T0, policy=POLICY)
    assert [(f.node_id, f.action) for f in found] == [("a", ADOPT), ("b", DELETE_DUPLICATE)]
    statuses = {"w": status("w", node="a", **APPLIED_JUST_NOW)}
    observations = {"a": NodeObservation("a", True, {}),
                    "b": NodeObservation("b", True, {"w": seen("Running", "w")})}
    found = classify_drift(specs, statuses, expected={"a": {"w"}}, nodes=nodes,
                           observations=observations, now=T0, policy=POLICY)
    assert [(f.node_id, f.action) for f in found] == [("b", AWAIT_OWNER_APPLY)]


@pytest.mark.parametrize("revision", ["forged", "", "rev-0"])
def test_an_agents_word_alone_never_moves_a_workload_to_its_node(revision: str) -> None:
    """Every adoption that changes the owner needs the reporter to hold the spec's revision:
    otherwise it is left to the operator (and the owner's own missing_on_agent re-apply)."""
    specs, statuses, nodes = drift_world()
    specs["pending"] = spec("pending")
    statuses["pending"] = status("pending", node="", state="Pending")
    nodes["n4"] = node_view("n4", Node(node_id="n4", status="Ready", agent_endpoint="h1:1"),
                            alive=True)  # n1's endpoint: a rotated node id
    claimed = {w: seen("Running", w, revision=revision)
               for w in ("moved", "dead-owner", "ghost-owner", "pending")}
    observations = {
        "n1": NodeObservation("n1", True, {w: seen("Running", w) for w in
                                           ("ok", "mis", "dup", "del", "fresh")}),
        "n2": NodeObservation("n2", True, claimed),
        "n4": NodeObservation("n4", True, {"rev": seen("Running", "rev", revision=revision)}),
    }
    expected = {"n1": {w for w, s in statuses.items() if s.node_id == "n1"}, "n2": set(),
                "n4": set()}
    found = classify_drift(specs, statuses, expected=expected, nodes=nodes,
                           observations=observations, now=T0, policy=POLICY)
    orphans = {(f.node_id, f.workload_id): f.action for f in found if f.drift_type == ORPHAN
               and f.node_id in ("n2", "n4")}
    assert orphans == {("n2", "moved"): INVESTIGATE, ("n2", "dead-owner"): INVESTIGATE,
                       ("n2", "ghost-owner"): INVESTIGATE, ("n2", "pending"): INVESTIGATE,
                       ("n4", "rev"): INVESTIGATE}
    # nothing adopted: the owner's own copy is reported missing and re-applied there
    assert ("n1", "moved", MISSING_ON_AGENT) in {(f.node_id, f.workload_id, f.drift_type)
                                                for f in found}
    # with the spec's revision the same reports are adoptions
    specs["rev"].revision_id = "rev-1"
    for obs in (observations["n2"], observations["n4"]):
        for wid in obs.workloads:
            obs.workloads[wid] = seen("Running", wid)
    found = classify_drift(specs, statuses, expected=expected, nodes=nodes,
                           observations=observations, now=T0, policy=POLICY)
    orphans = {(f.node_id, f.workload_id): f.action for f in found if f.drift_type == ORPHAN
               and f.node_id in ("n2", "n4")}
    assert orphans == {("n2", "moved"): REASSIGN, ("n2", "dead-owner"): FAILOVER_REASSIGN,
                       ("n2", "ghost-owner"): REASSIGN_MISSING_OWNER, ("n2", "pending"): ADOPT,
                       ("n4", "rev"): REBIND_ROTATED}


def test_an_agents_listing_is_bounded_and_invalid_ids_are_ignored() -> None:
    specs, statuses, nodes = drift_world()
    junk = {f"junk-{i:05d}": seen("Running", f"junk-{i:05d}") for i in range(1000)}
    junk.update({"a/b": seen("Running", "a/b"), "x" * 300: seen("Running", "x" * 300),
                 " pad": seen("Running", " pad")})
    observations = {"n2": NodeObservation("n2", True, junk)}
    found = classify_drift(specs, statuses, expected={"n2": set()}, nodes=nodes,
                           observations=observations, now=T0, policy=POLICY)
    assert len(found) == MAX_ORPHANS_PER_NODE
    assert all(f.action == DELETE_ORPHAN and f.workload_id.startswith("junk-") for f in found)


def test_deduper_window_and_bound() -> None:
    dedup = DriftDeduper(window_s=120, max_entries=3)
    key = ("n", "w", "t", "a")
    assert dedup.admit(key, T0)
    assert not dedup.admit(key, at(119))
    assert dedup.admit(key, at(120))
    for i in range(10):
        dedup.admit(("n", f"w{i}", "t", "a"), at(121 + i))
        assert len(dedup) <= 3


@given(st.lists(st.tuples(st.integers(0, 20), st.floats(min_value=0, max_value=10)),
                max_size=200))
def test_deduper_never_exceeds_its_bound(keys: list[tuple[int, float]]) -> None:
    dedup = DriftDeduper(window_s=120, max_entries=8)
    t = 0.0
    for k, gap in keys:
        t += gap
        dedup.admit(("n", str(k), "t", "a"), at(t))
        assert len(dedup) <= 8


# -- node monitor ----------------------------------------------------------------------------

def test_node_monitor_plan() -> None:
    checks = [
        NodeCheck("ready-alive", "Ready", lease_gone=False),
        NodeCheck("ready-expired", "Ready", lease_gone=True),
        NodeCheck("active-expired", "Active", lease_gone=True),
        NodeCheck("draining-expired", "Draining", lease_gone=True),
        NodeCheck("old-notready", "NotReady", lease_gone=True,
                  status_updated_at=rfc3339(at(-90_000))),
        NodeCheck("young-notready", "NotReady", lease_gone=True,
                  status_updated_at=rfc3339(at(-60))),
        NodeCheck("old-but-back", "NotReady", lease_gone=False,
                  status_updated_at=rfc3339(at(-90_000))),
    ]
    result = plan_node_monitor(checks, now=T0, gc_after_s=86_400)
    assert result.lost == ("active-expired", "ready-expired")
    assert result.collect == ("old-notready",)
    assert plan_node_monitor(checks, now=T0, gc_after_s=0).collect == ()
