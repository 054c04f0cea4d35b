"""Pure tests of the reconcile deciders' retry policies: the re-apply guard and the retry budget.

No sockets and no clock: every decision takes ``now``. Tables pin the documented schedules
(docs/compatibility.md, "Re-apply guard" and "Retry budget"); Hypothesis checks the properties
(backoff monotone and capped, attempts never above the maximum, the guard never shorter than its
floor). The plan and the drift are tested in ``test_plan_workload`` and
``test_drift_and_monitor``.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventsource.events import rfc3339
from handlers.workloads.retry import (
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
    reapply_delay_s,
    reapply_guard,
    retry_backoff_s,
)
from tests.fixtures.planning import POLICY, T0, at, status

# -- retry backoff ---------------------------------------------------------------------------

@pytest.mark.parametrize(("attempts", "delay"), [
    (0, 0), (1, 0), (2, 0), (3, 5), (4, 10), (5, 20), (6, 40), (7, 80), (8, 120), (20, 120),
])
def test_retry_backoff_table(attempts: int, delay: float) -> None:
    assert retry_backoff_s(attempts, POLICY) == delay


@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=10_000))
def test_retry_backoff_is_monotone_and_capped(a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert 0 <= retry_backoff_s(lo, POLICY) <= retry_backoff_s(hi, POLICY) <= 120


# -- re-apply guard --------------------------------------------------------------------------

@pytest.mark.parametrize(("wtype", "guard", "expected"), [
    ("container", 45.0, 45.0),      # the guard replaces the apply timeout (Go)
    ("container", 1.0, 15.0),       # floored at 15 s (Go defaultMissingGracePeriod)
    ("container", 0.0, 45.0),       # 0 = the apply timeout of the type
    ("compose", 90.0, 90.0),
    ("vm", 45.0, 240.0),            # max(guard, VM apply timeout), not the guard (a Go bug)
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
    # from the first apply (even the dispatcher's), not only from the third re-apply as in Go
    # (docs/compatibility.md, "In-flight applies")
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


# -- retry budget ----------------------------------------------------------------------------

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
    # a success clears failureObservedAt, so a later failure gets a full grace again
    # (docs/compatibility.md, "Retry grace reset")
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
