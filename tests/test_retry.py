"""Pure tests of the reconcile deciders: re-apply guard, retry budget, plan, drift, monitor.

No sockets and no clock: every decision takes ``now``. Tables pin the documented schedules
(persys-facts E4-E7); Hypothesis checks the properties (backoff monotone and capped, attempts
never above the maximum, the guard never shorter than its floor).
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventsource.events import rfc3339
from eventsource.records import Node, RetryState, WorkloadSpec, WorkloadStatus
from handlers.reconcile.planner.cycle import plan_cycle
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
from handlers.reconcile.planner.inputs import NodeObservation, NodeView, ObservedWorkload, node_view
from handlers.reconcile.planner.monitor import NodeCheck, plan_node_monitor
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
    LAST_APPLY_REVISION,
    REAPPLY_ATTEMPTS,
    ReapplyState,
    RetryPolicy,
    after_reapply,
    apply_failure,
    apply_success,
    base_guard_s,
    decide_failure,
    failure_counted,
    reapply_delay_s,
    reapply_guard,
    retry_backoff_s,
)

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
POLICY = RetryPolicy()


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def spec(wid: str = "w1", *, desired: str = "Running", wtype: str = "container",
         revision: str = "rev-1", **meta: str) -> WorkloadSpec:
    s = WorkloadSpec(id=wid, type=wtype, revision_id=revision, desired_state=desired,
                     image="nginx:1")
    return s


def status(wid: str = "w1", *, node: str = "n1", state: str = "Running", attempts: int = 0,
           next_retry: str = "", **meta: object) -> WorkloadStatus:
    return WorkloadStatus(id=wid, node_id=node, assigned_node=node, status=state,
                          metadata=dict(meta),
                          retry=RetryState(attempts=attempts, max_attempts=5,
                                           next_retry_at=next_retry))


def seen(state: str, wid: str = "w1", revision: str = "rev-1",
         desired: str = "Running") -> ObservedWorkload:
    return ObservedWorkload(wid, state, revision, desired)


# -- E6 retry backoff ------------------------------------------------------------------------

@pytest.mark.parametrize(("attempts", "delay"), [
    (0, 0), (1, 0), (2, 0), (3, 5), (4, 10), (5, 20), (6, 40), (7, 80), (8, 120), (20, 120),
])
def test_retry_backoff_table(attempts: int, delay: float) -> None:
    assert retry_backoff_s(attempts, POLICY) == delay


@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=10_000))
def test_retry_backoff_is_monotone_and_capped(a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert 0 <= retry_backoff_s(lo, POLICY) <= retry_backoff_s(hi, POLICY) <= 120


# -- E5 re-apply guard -----------------------------------------------------------------------

@pytest.mark.parametrize(("wtype", "guard", "expected"), [
    ("container", 45.0, 45.0),      # the guard replaces the apply timeout (Go)
    ("container", 1.0, 15.0),       # floored at 15 s (Go defaultMissingGracePeriod)
    ("container", 0.0, 45.0),       # 0 = the apply timeout of the type
    ("compose", 90.0, 90.0),
    ("vm", 45.0, 240.0),            # bug I14: max(guard, VM apply timeout), not the guard
    ("microvm", 300.0, 300.0),
    ("vm", 0.0, 240.0),
])
def test_base_guard_table(wtype: str, guard: float, expected: float) -> None:
    assert base_guard_s(wtype, RetryPolicy(reapply_guard_s=guard)) == expected


@pytest.mark.parametrize(("attempt", "delay"), [
    (1, 45), (2, 45), (3, 45), (4, 90), (5, 180), (6, 360), (7, 720), (8, 900), (50, 900),
])
def test_reapply_delay_table(attempt: int, delay: float) -> None:
    assert reapply_delay_s(attempt, 45.0, POLICY) == delay


@given(st.integers(min_value=1, max_value=5000), st.integers(min_value=1, max_value=5000),
       st.floats(min_value=1, max_value=600))
def test_reapply_delay_is_monotone_and_capped(a: int, b: int, base: float) -> None:
    lo, hi = sorted((a, b))
    assert base <= reapply_delay_s(lo, base, POLICY) or base > 900
    assert reapply_delay_s(lo, base, POLICY) <= reapply_delay_s(hi, base, POLICY) <= 900


def test_guard_holds_a_missing_workload_after_any_apply_request() -> None:
    # bug I13: from the first apply (even the dispatcher's), not only from the third re-apply
    state = ReapplyState.read({LAST_APPLY_AT: rfc3339(T0), LAST_APPLY_REVISION: "rev-1"})
    guard = RetryPolicy(reapply_guard_s=20)
    assert reapply_guard(state, revision_id="rev-1", workload_type="container", now=at(19),
                         policy=guard).active
    assert not reapply_guard(state, revision_id="rev-1", workload_type="container", now=at(20),
                             policy=guard).active
    # a new revision is never held back
    assert not reapply_guard(state, revision_id="rev-2", workload_type="container", now=at(1),
                             policy=guard).active


def test_guard_follows_reapply_next_at_and_backs_off() -> None:
    meta: dict[str, object] = {}
    times = []
    now = T0
    for _ in range(6):
        meta.update(after_reapply(ReapplyState.read(meta), revision_id="r", workload_type="vm",
                                  now=now, policy=POLICY))
        state = ReapplyState.read(meta)
        assert state.next_at is not None
        assert reapply_guard(state, revision_id="r", workload_type="vm",
                             now=state.next_at - timedelta(seconds=1), policy=POLICY).active
        assert not reapply_guard(state, revision_id="r", workload_type="vm", now=state.next_at,
                                 policy=POLICY).active
        times.append((state.next_at - now).total_seconds())
        now = state.next_at
    assert times == [240, 240, 240, 480, 900, 900]
    assert meta[REAPPLY_ATTEMPTS] == 6


@given(st.sampled_from(["container", "compose", "vm", "microvm"]),
       st.floats(min_value=0, max_value=3600), st.floats(min_value=0, max_value=4000))
def test_guard_is_never_shorter_than_floor_or_vm_timeout(wtype: str, guard: float,
                                                         elapsed: float) -> None:
    policy = RetryPolicy(reapply_guard_s=guard)
    base = base_guard_s(wtype, policy)
    assert base >= policy.min_guard_s
    if wtype in ("vm", "microvm"):
        assert base >= policy.vm_apply_timeout_s
    state = ReapplyState.read({LAST_APPLY_AT: rfc3339(T0)})
    active = reapply_guard(state, revision_id="", workload_type=wtype, now=at(elapsed),
                           policy=policy).active
    assert active == (elapsed < base)


# -- E6 retry budget -------------------------------------------------------------------------

def run_failures(times: list[float]) -> list[tuple[float, str, int, str]]:
    """Fail a workload at each time; return (t, status, attempts, last_action) after each."""
    st_ = status(state="Running")
    out = []
    for t in times:
        outcome = decide_failure(st_, reason="boom", now=at(t), policy=POLICY)
        st_ = copy.deepcopy(st_)
        apply_failure(st_, outcome, now=at(t))
        out.append((t, st_.status, st_.retry.attempts, st_.metadata["last_action"]))
    return out


def test_retry_budget_schedule_inside_and_after_grace() -> None:
    got = run_failures([0, 10, 20, 30, 45, 60, 119, 121])
    assert got == [
        (0, "RetryPending", 1, "RetryGracePeriod"),
        (10, "RetryPending", 2, "RetryGracePeriod"),
        (20, "RetryPending", 3, "RetryGracePeriod"),
        (30, "RetryPending", 4, "RetryGracePeriod"),
        (45, "RetryPending", 4, "RetryGracePeriod"),   # max - 1 inside grace
        (60, "RetryPending", 4, "RetryGracePeriod"),
        (119, "RetryPending", 4, "RetryGracePeriod"),
        (121, "Failed", 5, "RetryExhausted"),          # grace over: the 5th attempt fails it
    ]


def test_retry_events_and_fields() -> None:
    st_ = status()
    first = decide_failure(st_, reason="boom", now=T0, policy=POLICY)
    assert first.event.type == "RetryTriggered"
    assert first.event.details == {"attempts": "1", "next_retry_at": rfc3339(T0),
                                   "failure_grace_until": rfc3339(at(120))}
    apply_failure(st_, first, now=T0)
    assert st_.metadata[FAILURE_OBSERVED_AT] == rfc3339(T0)
    assert st_.status_info.actual_state == "Pending"
    st_.retry.attempts = 4
    last = decide_failure(st_, reason="boom", now=at(200), policy=POLICY)
    assert last.exhausted
    assert last.event.type == "WorkloadFailed"
    assert last.event.details == {"attempts": "5"}
    apply_failure(st_, last, now=at(200))
    assert st_.status == "Failed"
    assert st_.status_info.actual_state == "Failed"
    assert FAILURE_OBSERVED_AT not in st_.metadata
    assert st_.retry.next_retry_at == ""


def test_after_grace_without_exhaustion_schedules_a_retry() -> None:
    st_ = status(attempts=1, **{FAILURE_OBSERVED_AT: rfc3339(T0)})
    outcome = decide_failure(st_, reason="boom", now=at(300), policy=POLICY)
    assert (outcome.status, outcome.attempts, outcome.last_action) == (
        "RetryPending", 2, "RetryScheduled")
    assert outcome.event.details == {"attempts": "2", "next_retry_at": rfc3339(at(300))}


def test_success_resets_the_grace_window() -> None:
    # bug I15: a success clears failureObservedAt, so a later failure gets a full grace again
    st_ = status(attempts=3, **{FAILURE_OBSERVED_AT: rfc3339(T0)})
    assert apply_success(st_, actual="Running", now=at(50))
    assert st_.retry.attempts == 0
    assert FAILURE_OBSERVED_AT not in st_.metadata
    assert not apply_success(st_, actual="Running", now=at(51))  # nothing left: no write
    later = decide_failure(st_, reason="boom", now=at(86_400), policy=POLICY)
    assert later.status == "RetryPending"
    assert later.grace_until == at(86_400 + 120)


def test_infrastructure_reason_gives_way_to_runtime_error() -> None:
    st_ = status(last_runtime_error="exec: /app: not found")
    outcome = decide_failure(st_, reason="no failover target: node n1 unavailable", now=T0,
                             policy=POLICY)
    assert outcome.reason == "exec: /app: not found"


@settings(max_examples=200)
@given(st.lists(st.floats(min_value=0, max_value=600), min_size=1, max_size=40),
       st.integers(min_value=1, max_value=8))
def test_attempts_never_exceed_max_and_grace_never_exhausts(gaps: list[float],
                                                            max_attempts: int) -> None:
    st_ = status()
    st_.retry.max_attempts = max_attempts
    t = 0.0
    first = None
    for gap in gaps:
        t += gap
        outcome = decide_failure(st_, reason="x", now=at(t), policy=POLICY)
        assert outcome.attempts <= max_attempts
        first = t if first is None else first
        if t - first < POLICY.failure_grace_s:
            assert not outcome.exhausted
        if outcome.next_retry_at is not None:
            assert outcome.next_retry_at >= at(t)
        apply_failure(st_, outcome, now=at(t))
        if outcome.exhausted:
            assert st_.status == "Failed"
            break


# -- E4 plan_workload ------------------------------------------------------------------------

def plan(s: WorkloadSpec, st_: WorkloadStatus, obs: ObservedWorkload | None, *,
         available: bool = True, observed: bool = True, now: datetime = T0,
         policy: RetryPolicy = POLICY) -> str:
    return plan_workload(s, st_, obs, node_available=available, node_observed=observed,
                         now=now, policy=policy).kind


APPLIED_LONG_AGO = {LAST_APPLY_AT: rfc3339(at(-3600)), LAST_APPLY_REVISION: "rev-1"}
APPLIED_JUST_NOW = {LAST_APPLY_AT: rfc3339(at(-1)), LAST_APPLY_REVISION: "rev-1"}

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
    ("missing just after apply (I13)", spec(), status(state="Scheduled", **APPLIED_JUST_NOW),
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


# -- E7 drift --------------------------------------------------------------------------------

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
    # "fresh" was applied a second ago: not missing yet (I13); "moved" was adopted by n2, so
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


# -- E1 node monitor -------------------------------------------------------------------------

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
