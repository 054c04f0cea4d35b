"""Pure tests of the reconcile planner's per-workload decision (``plan_workload``), the
cycle plan, and the steady-state shortcut that must never change a decision.

No sockets and no clock: every decision takes ``now``; tables pin the decisions and
Hypothesis checks that the plan is total and deterministic.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventsource.events import rfc3339
from eventsource.records import Node, WorkloadSpec, WorkloadStatus
from handlers.reconcile.planner.cycle import plan_cycle
from handlers.reconcile.planner.inputs import NodeObservation, ObservedWorkload, node_view
from handlers.reconcile.planner.workload import (
    APPLY_STOPPED,
    AWAIT_NODE,
    BACKOFF_WAIT,
    COUNT_FAILURE,
    DELETE,
    FAILOVER,
    FINALIZE,
    MARK_TERMINAL,
    NOOP,
    PLACE,
    REAPPLY,
    REAPPLY_BACKOFF_WAIT,
    RECORD_REPORT,
    RETRY_TERMINAL,
    SETTLE,
    SETTLING,
    TERMINAL,
    UNOBSERVED,
    plan_workload,
    steady_running,
)
from handlers.workloads.metadata import FAILURE_REASON, agent_metadata
from handlers.workloads.retry import (
    FAILURE_COUNTED_FOR,
    FAILURE_OBSERVED_AT,
    LAST_APPLY_AT,
    REAPPLY_ATTEMPTS,
    RetryPolicy,
    apply_failure,
    decide_failure,
    failure_counted,
)
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

# -- plan_workload ---------------------------------------------------------------------------

def plan(s: WorkloadSpec, st_: WorkloadStatus, obs: ObservedWorkload | None, *,
         available: bool = True, observed: bool = True, now: datetime = T0,
         policy: RetryPolicy = POLICY) -> str:
    return plan_workload(s, st_, obs, node_available=available, node_observed=observed,
                         now=now, policy=policy).kind



PLAN_TABLE = [
    # (case, spec, status, observation, available, node observed, expected)
    ("steady", spec(), status(**APPLIED_LONG_AGO), seen("Running"), True, True, NOOP),
    ("deleted, on agent", spec(desired="Deleted"), status(state="Deleting"), seen("Running"),
     True, True, DELETE),
    ("deleted, gone", spec(desired="Deleted"), status(state="Deleting"), None, True, True,
     FINALIZE),
    ("deleted, no node", spec(desired="Deleted"), status(node=""), None, False, False,
     FINALIZE),
    ("deleted, node dead", spec(desired="Deleted"), status(state="Deleting"), None, False,
     False, FINALIZE),
    ("deleted, list failed", spec(desired="Deleted"), status(state="Deleting"), None, True,
     False, UNOBSERVED),
    ("unassigned", spec(), status(node="", state="Pending"), None, False, False, PLACE),
    ("node dead, movable", spec(), status(), None, False, False, FAILOVER),
    ("node dead, vm is node-local", spec(wtype="vm"), status(), None, False, False,
     AWAIT_NODE),
    ("list failed", spec(), status(), None, True, False, UNOBSERVED),
    ("killed long ago", spec(), status(**APPLIED_LONG_AGO), None, True, True, REAPPLY),
    ("missing just after apply (in flight)", spec(), status(state="Scheduled", **APPLIED_JUST_NOW),
     None, True, True, REAPPLY_BACKOFF_WAIT),
    ("never applied", spec(), status(state="Scheduled"), None, True, True, REAPPLY),
    ("stopped unexpectedly", spec(), status(**APPLIED_LONG_AGO), seen("Stopped"), True, True,
     REAPPLY),
    ("pending settles", spec(), status(state="Pending", **APPLIED_JUST_NOW), seen("Pending"),
     True, True, SETTLING),
    ("failed first time", spec(), status(state="Failed", **APPLIED_JUST_NOW), seen("Failed"),
     True, True, COUNT_FAILURE),
    ("failed, counted, due", spec(), status(state="RetryPending", attempts=1,
     next_retry=rfc3339(T0), **APPLIED_JUST_NOW,
     **{FAILURE_COUNTED_FOR: APPLIED_JUST_NOW[LAST_APPLY_AT]}), seen("Failed"), True, True,
     REAPPLY),
    ("backoff gate", spec(), status(state="RetryPending", attempts=3,
     next_retry=rfc3339(at(5))), seen("Failed"), True, True, BACKOFF_WAIT),
    ("exhausted", spec(), status(state="Failed", attempts=5), seen("Failed"), True, True,
     TERMINAL),
    ("exhausted on a dead node", spec(), status(state="Failed", attempts=5), None, False,
     False, TERMINAL),
    ("terminal reason", spec(), status(state="Running", failure_reason="INVALID_IMAGE"),
     None, True, True, MARK_TERMINAL),
    ("recovered: reset budget", spec(), status(attempts=2, **{FAILURE_OBSERVED_AT: "x"}),
     seen("Running"), True, True, SETTLE),
    ("status lags agent", spec(), status(state="Scheduled"), seen("Running"), True, True,
     SETTLE),
    ("old revision running", spec(revision="rev-2"), status(**APPLIED_LONG_AGO),
     seen("Running"), True, True, REAPPLY),
    ("desired stopped, running", spec(desired="Stopped"), status(**APPLIED_LONG_AGO),
     seen("Running"), True, True, APPLY_STOPPED),
    ("desired stopped, stopping", spec(desired="Stopped"), status(state="Pending"),
     seen("Pending", desired="Stopped"), True, True, SETTLING),
    ("desired stopped, stopped", spec(desired="Stopped"), status(state="Stopped"),
     seen("Stopped", desired="Stopped"), True, True, NOOP),
    ("desired stopped, missing", spec(desired="Stopped"), status(state="Stopped"), None, True,
     True, NOOP),
]


@pytest.mark.parametrize(("case", "s", "st_", "obs", "available", "observed", "expected"),
                         PLAN_TABLE, ids=[row[0] for row in PLAN_TABLE])
def test_plan_workload_table(case: str, s: WorkloadSpec, st_: WorkloadStatus,
                             obs: ObservedWorkload | None, available: bool, observed: bool,
                             expected: str) -> None:
    assert plan(s, st_, obs, available=available, observed=observed) == expected


def test_noop_and_waits_neither_call_nor_write() -> None:
    for kind in (NOOP, BACKOFF_WAIT, REAPPLY_BACKOFF_WAIT, AWAIT_NODE, UNOBSERVED, TERMINAL,
                 SETTLING):
        action = plan_workload(spec(), status(), None, node_available=True, node_observed=True,
                               now=T0, policy=POLICY)
        action = type(action)(kind, "w1")
        assert not action.rpc
        assert not action.writes


def test_failure_is_counted_once_per_apply_attempt() -> None:
    st_ = status(state="Failed", **APPLIED_JUST_NOW)
    assert plan(spec(), st_, seen("Failed")) == COUNT_FAILURE
    apply_failure(st_, decide_failure(st_, reason="x", now=T0, policy=POLICY), now=T0)
    assert failure_counted(st_)
    # the heartbeat may write "Failed" over RetryPending: still counted once
    st_.status = "Failed"
    assert plan(spec(), st_, seen("Failed")) == REAPPLY
    st_.metadata[LAST_APPLY_AT] = rfc3339(at(1))  # the re-apply went out
    assert plan(spec(), st_, seen("Failed"), now=at(2)) == COUNT_FAILURE


@given(st.sampled_from(["Running", "Stopped", "Deleted"]),
       st.sampled_from(["Pending", "Scheduled", "Running", "Stopped", "Failed", "RetryPending",
                        "Deleting", "Updating"]),
       st.one_of(st.none(), st.sampled_from(["Pending", "Running", "Stopped", "Failed",
                                             "Unknown"])),
       st.booleans(), st.booleans(), st.integers(min_value=0, max_value=6),
       st.floats(min_value=-100, max_value=1000))
def test_plan_is_total_and_deterministic(desired: str, state: str, agent: str | None,
                                         available: bool, observed: bool, attempts: int,
                                         t: float) -> None:
    s = spec(desired=desired)
    st_ = status(state=state, attempts=attempts, **APPLIED_JUST_NOW)
    obs = seen(agent) if agent else None
    a = plan_workload(s, st_, obs, node_available=available, node_observed=observed,
                      now=at(t), policy=POLICY)
    b = plan_workload(s, st_, obs, node_available=available, node_observed=observed,
                      now=at(t), policy=POLICY)
    assert a == b
    if not available and desired != "Deleted":
        assert not a.rpc  # never an agent call to an unavailable node
    if a.rpc:
        assert available
        assert observed


def test_plan_cycle_covers_owned_nodes_and_unassigned_share() -> None:
    specs = {w: spec(w) for w in ("a", "b", "c", "d")}
    statuses = {"a": status("a", node="n1", **APPLIED_LONG_AGO),
                "b": status("b", node="n2", **APPLIED_LONG_AGO),
                "c": status("c", node="", state="Pending"),
                "d": status("d", node="n1", **APPLIED_LONG_AGO)}
    nodes = {n: node_view(n, Node(node_id=n, status="Ready"), alive=True) for n in ("n1", "n2")}
    obs = {"n1": NodeObservation("n1", True, {"a": seen("Running", "a")})}
    result = plan_cycle(specs, statuses, nodes=nodes, observations=obs,
                        owns_node=lambda n: n == "n1", owns_unassigned=lambda w: w == "c",
                        now=T0, policy=POLICY)
    assert result.kinds() == {"a": NOOP, "c": PLACE, "d": REAPPLY}
    assert result.steady == ("a",)  # the steady state is decided without an Action
    assert result.counts() == {NOOP: 1, PLACE: 1, REAPPLY: 1}
    assert [a.workload_id for a in result.needing_io()] == ["c", "d"]


def _steady_case(*, desired: str = "Running", state: str = "Running", agent: str = "Running",
                 agent_revision: str = "rev-1", revision: str = "rev-1", attempts: int = 0,
                 next_retry: str = "", reported: dict[str, str] | None = None, **meta: str
                 ) -> tuple[WorkloadSpec, WorkloadStatus, ObservedWorkload]:
    """The steady state (a workload running where it should, applied long ago), with one or more
    fields changed: the inputs on which the shortcut and the full decision could disagree.
    ``reported``: the agent's status metadata, as ``observed_from_agent`` keeps it."""
    return (spec(desired=desired, revision=revision),
            status(state=state, attempts=attempts, next_retry=next_retry,
                   **{**APPLIED_LONG_AGO, **meta}),
            seen(agent, revision=agent_revision)._replace(
                metadata=agent_metadata(reported or {})))


def _assert_shortcut_agrees(s: WorkloadSpec, st_: WorkloadStatus, obs: ObservedWorkload,
                            now: datetime) -> None:
    full = plan_workload(s, st_, obs, node_available=True, node_observed=True, now=now,
                         policy=POLICY)
    if steady_running(s, st_, obs):
        assert full.kind == NOOP
    nodes = {"n1": node_view("n1", Node(node_id="n1", status="Ready"), alive=True)}
    planned = plan_cycle({"w1": s}, {"w1": st_}, nodes=nodes,
                         observations={"n1": NodeObservation("n1", True, {"w1": obs})},
                         owns_node=lambda n: True, owns_unassigned=lambda w: True, now=now,
                         policy=POLICY)
    assert planned.kinds() == {"w1": full.kind}


#: one change at a time from the steady state; every one that changes the decision must also
#: turn the shortcut off (each row fails if the shortcut lost the check that covers it)
NEAR_STEADY = [
    ("retry_terminal", {RETRY_TERMINAL: "true"}, MARK_TERMINAL),
    ("retry_terminal false", {RETRY_TERMINAL: "false"}, NOOP),
    # a stored failure_reason follows the agent: one that runs the spec's revision removes it
    ("terminal failure reason", {FAILURE_REASON: "INVALID_IMAGE"}, RECORD_REPORT),
    ("terminal failure reason, agent failed it", {FAILURE_REASON: "INVALID_IMAGE",
                                                  "agent": "Failed"}, MARK_TERMINAL),
    ("terminal failure reason, agent of another revision",
     {FAILURE_REASON: "INVALID_IMAGE", "agent_revision": "rev-0"}, MARK_TERMINAL),
    ("other failure reason", {FAILURE_REASON: "OOM"}, RECORD_REPORT),
    ("attempts", {"attempts": 2}, SETTLE),
    ("retry due later", {"next_retry": rfc3339(at(60))}, BACKOFF_WAIT),
    ("retry due before", {"next_retry": rfc3339(at(-60))}, SETTLE),
    ("failure observed", {FAILURE_OBSERVED_AT: rfc3339(at(-5))}, SETTLE),
    ("failure counted", {FAILURE_COUNTED_FOR: rfc3339(at(-5))}, SETTLE),
    ("re-apply attempts", {REAPPLY_ATTEMPTS: "2"}, SETTLE),
    ("agent runs another revision", {"agent_revision": "rev-0"}, REAPPLY),
    ("spec has another revision", {"revision": "rev-2"}, REAPPLY),
    ("agent reports no revision", {"agent_revision": ""}, NOOP),
    ("status lags", {"state": "Scheduled"}, SETTLE),
    ("agent stopped it", {"agent": "Stopped"}, REAPPLY),
    ("agent failed it", {"agent": "Failed"}, COUNT_FAILURE),
    ("desired stopped", {"desired": "Stopped"}, APPLY_STOPPED),
    ("desired deleted", {"desired": "Deleted"}, DELETE),
    ("desired lower case", {"desired": "running"}, NOOP),
    ("desired padded", {"desired": " Running "}, NOOP),
    ("agent reports an address", {"reported": {"vm.primary_ip": "10.0.0.9"}}, RECORD_REPORT),
    ("agent reports what is stored", {"reported": {"note": "x"}, "note": "x"}, NOOP),
    ("agent reports a new value", {"reported": {"note": "y"}, "note": "x"}, RECORD_REPORT),
    ("agent reports only its task", {"reported": {"task_id": "apply-1"}}, NOOP),
    ("agent reports a scheduler key", {"reported": {"last_action": "x"}}, NOOP),
    ("running agent reports a terminal reason", {"reported": {FAILURE_REASON: "INVALID_IMAGE"}},
     NOOP),
    ("failed agent reports a terminal reason",
     {"agent": "Failed", "reported": {FAILURE_REASON: "INVALID_IMAGE"}}, MARK_TERMINAL),
    ("failed agent reports a retryable reason",
     {"agent": "Failed", "reported": {FAILURE_REASON: "OOM"}}, COUNT_FAILURE),
    ("agent of another revision reports", {"agent_revision": "rev-0",
                                           "reported": {"vm.primary_ip": "10.0.0.9"}}, REAPPLY),
    ("unchanged", {}, NOOP),
]


@pytest.mark.parametrize(("case", "change", "expected"), NEAR_STEADY,
                         ids=[row[0] for row in NEAR_STEADY])
def test_the_steady_shortcut_is_off_wherever_the_decision_is_not_noop(
        case: str, change: dict[str, Any], expected: str) -> None:
    s, st_, obs = _steady_case(**change)
    assert plan_workload(s, st_, obs, node_available=True, node_observed=True, now=T0,
                         policy=POLICY).kind == expected
    if expected != NOOP:
        assert not steady_running(s, st_, obs)
    _assert_shortcut_agrees(s, st_, obs, T0)


def _near(baseline: Any, *others: Any) -> st.SearchStrategy[Any]:
    """The baseline value half of the time, else one of the others: examples stay near the
    steady state, where a missing check in the shortcut would show."""
    return st.one_of(st.just(baseline), st.sampled_from(others))


@settings(max_examples=400)
@given(_near("Running", "running", "", "Stopped", "stop", "Deleted", "RUNNING", " Running"),
       _near("Running", "Pending", "Scheduled", "Failed", "RetryPending", "Stopped"),
       _near("Running", "Pending", "Stopped", "Failed", "Unknown"),
       _near("rev-1", "rev-2", ""), _near("rev-1", ""),
       _near(0, 1, 3, 6), _near("", rfc3339(at(-5)), rfc3339(at(5))),
       st.dictionaries(st.sampled_from([REAPPLY_ATTEMPTS, FAILURE_OBSERVED_AT,
                                        FAILURE_COUNTED_FOR, RETRY_TERMINAL, FAILURE_REASON,
                                        "note"]),
                       st.sampled_from(["", "true", "false", "INVALID_IMAGE", "x",
                                        rfc3339(at(-3600))]), max_size=2),
       st.floats(min_value=-100, max_value=1000),
       st.dictionaries(st.sampled_from([FAILURE_REASON, "note", "vm.primary_ip", "task_id"]),
                       st.sampled_from(["x", "INVALID_IMAGE", "10.0.0.9"]), max_size=2))
def test_the_steady_shortcut_never_changes_a_decision(
        desired: str, state: str, agent: str, agent_revision: str, revision: str,
        attempts: int, next_retry: str, meta: dict[str, str], t: float,
        reported: dict[str, str]) -> None:
    s, st_, obs = _steady_case(desired=desired, state=state, agent=agent,
                               agent_revision=agent_revision, revision=revision,
                               attempts=attempts, next_retry=next_retry, reported=reported,
                               **meta)
    _assert_shortcut_agrees(s, st_, obs, at(t))


def test_the_steady_shortcut_takes_the_common_case() -> None:
    assert steady_running(*_steady_case())
    assert steady_running(*_steady_case(desired="running", note="kept"))
    s, st_, _ = _steady_case()
    assert not steady_running(s, st_, None)


def test_the_agents_news_rides_on_the_action_that_writes_the_status() -> None:
    """A terminal failure_reason from the agent halts in the cycle that sees it; the marking
    write merges the report, after which the workload is quiet (no write every cycle)."""
    s, st_, obs = _steady_case(agent="Failed", reported={FAILURE_REASON: "INVALID_IMAGE",
                                                         "container.stderr": "denied"})

    def plan() -> Any:
        return plan_workload(s, st_, obs, node_available=True, node_observed=True, now=T0,
                             policy=POLICY)

    action = plan()
    assert action.kind == MARK_TERMINAL
    assert action.reported == (("container.stderr", "denied"), (FAILURE_REASON, "INVALID_IMAGE"))
    st_.status = "Failed"  # a heartbeat said Failed first: the report still marks it once
    assert plan().kind == MARK_TERMINAL
    st_.metadata.update(action.reported)
    assert plan().kind == TERMINAL
    assert plan().reported == ()
    # its agent runs it again (the halt came from a report older than a retry's apply): the
    # reason goes with the write that settles it Running
    obs = obs._replace(state="Running", metadata=agent_metadata({}))
    settle = plan()
    assert settle.kind == SETTLE
    assert settle.reported == ((FAILURE_REASON, None),)
