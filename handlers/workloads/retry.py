"""Pure deciders for the re-apply guard and the retry budget.

Why: the reconcile loop must not hammer an agent with re-applies while an asynchronous apply is
still settling, and a workload that keeps failing must end ``Failed`` on a documented schedule
instead of being retried forever. Both decisions live here as pure functions over the workload
status record and ``now`` (no clock reads, no I/O), so tables and Hypothesis can check them.
Go's rules: docs/compatibility.md, "Re-apply guard" and "Retry budget".

The state they read and write is kept *in the workload status record* (``retry`` and a few
``metadata`` keys, updated by the caller with CAS), never as an unbounded log:

* re-apply guard: ``lastApplyRequestAt``, ``lastApplyRevision``, ``lastLaunchTime``,
  ``reapplyAttempts``, ``reapplyNextAt`` (the Go keys);
* retry budget: ``retry.attempts``, ``retry.maxAttempts``, ``retry.nextRetryAt``,
  ``failureObservedAt``, ``failureGraceUntil`` (Go keys) and ``failureCountedFor`` (ours: the
  ``lastApplyRequestAt`` of the apply whose failure was already counted, so one failed attempt
  is counted once however many cycles observe it).

Differences from the Go version, on purpose (Go bugs fixed; docs/compatibility.md,
"VM re-apply guard", "In-flight applies" and "Retry grace reset", in this order):

* For VMs the base guard is ``max(SCHEDULER_REAPPLY_GUARD, VM apply timeout)``; Go let
  the guard replace the 240 s VM timeout. For other types the guard replaces the apply timeout,
  as in Go. The result is floored at 15 s (Go's ``defaultMissingGracePeriod``).
* The guard is active from the *first* re-apply. After any apply request (the
  dispatcher's or ours) the workload is "not yet visible" for the base guard: a Missing or
  Stopped observation in that window is not acted on.
* A success (observed state = desired state) clears the grace window and the
  attempts, so a workload failing again days later gets its full grace again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from eventsource.events import Event, parse_rfc3339, rfc3339
from eventsource.records import WorkloadStatus

#: metadata keys of the re-apply guard (the Go names)
LAST_APPLY_AT = "lastApplyRequestAt"
LAST_APPLY_REVISION = "lastApplyRevision"
LAST_LAUNCH = "lastLaunchTime"
REAPPLY_ATTEMPTS = "reapplyAttempts"
REAPPLY_NEXT_AT = "reapplyNextAt"
REAPPLY_KEYS = (LAST_APPLY_AT, LAST_APPLY_REVISION, LAST_LAUNCH, REAPPLY_ATTEMPTS, REAPPLY_NEXT_AT)
#: metadata keys of the retry budget
FAILURE_OBSERVED_AT = "failureObservedAt"
FAILURE_GRACE_UNTIL = "failureGraceUntil"
FAILURE_COUNTED_FOR = "failureCountedFor"
GRACE_KEYS = (FAILURE_OBSERVED_AT, FAILURE_GRACE_UNTIL, FAILURE_COUNTED_FOR)
#: every bookkeeping key a success clears, as a set for one C-level disjointness check
SUCCESS_CLEARS = frozenset((*GRACE_KEYS, REAPPLY_ATTEMPTS, REAPPLY_NEXT_AT))

RETRY_PENDING = "RetryPending"
FAILED = "Failed"
DEFAULT_MAX_ATTEMPTS = 5
VM_TYPES = frozenset({"vm", "microvm", "micro-vm", "firecracker"})
#: reason fragments that mean "the infrastructure failed", not the workload (Go's list:
#: docs/compatibility.md, "Retry budget")
INFRA_MARKERS = ("heartbeat expired", "no failover target", "connection refused",
                 "deadline exceeded", "transport: error while dialing")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """The knobs of the re-apply guard and the retry budget; built from ``Settings`` by the
    loop shell."""

    #: SCHEDULER_REAPPLY_GUARD; 0 means "use the apply timeout of the type"
    reapply_guard_s: float = 45.0
    apply_timeout_s: float = 45.0
    vm_apply_timeout_s: float = 240.0
    #: the floor of the base guard (Go ``defaultMissingGracePeriod``)
    min_guard_s: float = 15.0
    #: the cap of the re-apply backoff (Go ``maxReapplyBackoff``)
    reapply_backoff_cap_s: float = 900.0
    #: Go ``minAttemptsBeforeBackoff``: re-apply attempts 1..3 all wait one base guard
    free_attempts: int = 3
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    failure_grace_s: float = 120.0
    retry_backoff_base_s: float = 5.0
    retry_backoff_cap_s: float = 120.0


# -- small parsing helpers (records written by Go or older versions hold strings) ----------------


def _int(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip() or 0)
        except ValueError:
            return 0
    return 0


def _time(value: Any) -> datetime | None:
    return parse_rfc3339(value) if isinstance(value, str) else None


def is_vm(workload_type: str) -> bool:
    return workload_type.strip().lower() in VM_TYPES


# -- re-apply guard ------------------------------------------------------------------------------


def base_guard_s(workload_type: str, policy: RetryPolicy) -> float:
    """The base re-apply guard in seconds for a workload type (see the module note on VMs)."""
    timeout = policy.vm_apply_timeout_s if is_vm(workload_type) else policy.apply_timeout_s
    if policy.reapply_guard_s > 0:
        base = max(policy.reapply_guard_s, timeout) if is_vm(workload_type) else (
            policy.reapply_guard_s)
    else:
        base = timeout
    return max(base, policy.min_guard_s)


def reapply_delay_s(attempt: int, base_s: float, policy: RetryPolicy) -> float:
    """Wait after re-apply number ``attempt`` (1-based): base for the first three, then doubling.

    ``effective = max(1, attempt - 2)``; ``delay = min(base * 2**(effective - 1), cap)``.
    """
    effective = max(1, attempt - (policy.free_attempts - 1))
    if effective - 1 >= 64:
        return policy.reapply_backoff_cap_s
    return float(min(base_s * (2 ** (effective - 1)), policy.reapply_backoff_cap_s))


@dataclass(frozen=True, slots=True)
class ReapplyState:
    """The re-apply bookkeeping read from a status record's metadata."""

    attempts: int = 0
    last_request_at: datetime | None = None
    last_revision: str = ""
    next_at: datetime | None = None
    last_launch_at: datetime | None = None

    @classmethod
    def read(cls, metadata: Mapping[str, Any]) -> ReapplyState:
        return cls(
            attempts=max(0, _int(metadata.get(REAPPLY_ATTEMPTS))),
            last_request_at=_time(metadata.get(LAST_APPLY_AT)),
            last_revision=str(metadata.get(LAST_APPLY_REVISION) or ""),
            next_at=_time(metadata.get(REAPPLY_NEXT_AT)),
            last_launch_at=_time(metadata.get(LAST_LAUNCH)),
        )


@dataclass(frozen=True, slots=True)
class GuardVerdict:
    """Whether a corrective apply must wait, and until when."""

    active: bool
    until: datetime | None = None
    reason: str = ""


def reapply_guard(state: ReapplyState, *, revision_id: str, workload_type: str, now: datetime,
                  policy: RetryPolicy, dispatched_at: datetime | None = None) -> GuardVerdict:
    """Is a re-apply of ``revision_id`` held back at ``now``?

    Not when the last apply was of another revision (a new revision goes out at once). Otherwise
    active while ``now < reapplyNextAt`` or, without that key, for one base guard after the last
    apply request (or launch): an apply still settling is not re-sent (docs/compatibility.md,
    "In-flight applies").

    ``dispatched_at`` is the fallback anchor when no apply was recorded at all: the time the
    placement (or update) was committed, right after which the dispatcher sent the apply; its
    outcome record can be lost (see ``Dispatcher._record_apply``), the apply itself was not.
    """
    if state.last_revision and revision_id and state.last_revision != revision_id:
        return GuardVerdict(False, reason="revision changed since the last apply")
    if state.next_at is not None:
        if now < state.next_at:
            return GuardVerdict(True, state.next_at,
                                f"re-apply backoff until {rfc3339(state.next_at)}")
        return GuardVerdict(False, reason="re-apply backoff elapsed")
    anchor = state.last_request_at or state.last_launch_at or dispatched_at
    if anchor is None:
        return GuardVerdict(False, reason="never applied")
    until = anchor + timedelta(seconds=base_guard_s(workload_type, policy))
    if now < until:
        return GuardVerdict(True, until, f"apply sent at {rfc3339(anchor)} may not be visible yet")
    return GuardVerdict(False, reason="guard elapsed")


def after_reapply(state: ReapplyState, *, revision_id: str, workload_type: str, now: datetime,
                  policy: RetryPolicy) -> dict[str, Any]:
    """The metadata to store after a Running (re-)apply was accepted by the agent."""
    attempt = state.attempts + 1
    if state.last_revision and revision_id and state.last_revision != revision_id:
        attempt = 1
    delay = reapply_delay_s(attempt, base_guard_s(workload_type, policy), policy)
    stamp = rfc3339(now)
    return {
        LAST_APPLY_AT: stamp,
        LAST_APPLY_REVISION: revision_id,
        LAST_LAUNCH: stamp,
        REAPPLY_ATTEMPTS: attempt,
        REAPPLY_NEXT_AT: rfc3339(now + timedelta(seconds=delay)),
    }


# -- retry budget --------------------------------------------------------------------------------


def retry_backoff_s(attempts: int, policy: RetryPolicy) -> float:
    """0 below ``free_attempts``, then ``base * 2**(a - 3)`` capped (5 s, 10 s, 20 s ... 2 m)."""
    if attempts < policy.free_attempts:
        return 0.0
    exponent = attempts - policy.free_attempts
    if exponent >= 64:
        return policy.retry_backoff_cap_s
    return float(min(policy.retry_backoff_base_s * (2**exponent), policy.retry_backoff_cap_s))


def max_attempts_of(status: WorkloadStatus, policy: RetryPolicy) -> int:
    return status.retry.max_attempts if status.retry.max_attempts > 0 else policy.max_attempts


def preferred_reason(reason: str, metadata: Mapping[str, Any]) -> str:
    """The reason to show: the runtime's own error beats an infrastructure symptom, as in Go
    (docs/compatibility.md, "Retry budget")."""
    runtime = str(metadata.get("last_runtime_error") or "").strip()
    low = reason.lower()
    infra = ("node" in low and "unavailable" in low) or any(m in low for m in INFRA_MARKERS)
    return runtime if infra and runtime else reason


@dataclass(frozen=True, slots=True)
class RetryOutcome:
    """The retry state after a failure, and the event that announces it."""

    attempts: int
    max_attempts: int
    #: None once the budget is exhausted
    next_retry_at: datetime | None
    status: str
    last_action: str
    failure_observed_at: datetime | None
    grace_until: datetime | None
    exhausted: bool
    reason: str
    event: Event


def decide_failure(status: WorkloadStatus, *, reason: str, now: datetime, policy: RetryPolicy,
                   workload_id: str = "", node_id: str = "") -> RetryOutcome:
    """One more failure of this workload at ``now`` (Go ``UpdateWorkloadRetryOnFailure``,
    docs/compatibility.md, "Retry budget").

    Inside the grace window (2 min from the first failure of this streak) attempts grow only up
    to ``max - 1``, so the budget cannot run out inside it; after it every failure counts and
    reaching ``max`` ends in ``Failed`` with a ``WorkloadFailed`` event.
    """
    meta = status.metadata
    wid = workload_id or status.id
    nid = node_id or status.node_id
    limit = max_attempts_of(status, policy)
    attempts = max(0, status.retry.attempts)
    observed = _time(meta.get(FAILURE_OBSERVED_AT)) or now
    grace_until = observed + timedelta(seconds=policy.failure_grace_s)
    shown = preferred_reason(reason, meta)
    if now < grace_until:
        if attempts < limit - 1:
            attempts += 1
        next_at = now + timedelta(seconds=retry_backoff_s(attempts, policy))
        return RetryOutcome(
            attempts=attempts, max_attempts=limit, next_retry_at=next_at, status=RETRY_PENDING,
            last_action="RetryGracePeriod", failure_observed_at=observed, grace_until=grace_until,
            exhausted=False, reason=shown,
            event=Event(type="RetryTriggered", workload_id=wid, node_id=nid, reason=shown,
                        timestamp=now, details={
                            "attempts": str(attempts), "next_retry_at": rfc3339(next_at),
                            "failure_grace_until": rfc3339(grace_until)}))
    attempts += 1
    if attempts >= limit:
        return RetryOutcome(
            attempts=attempts, max_attempts=limit, next_retry_at=None, status=FAILED,
            last_action="RetryExhausted", failure_observed_at=None, grace_until=None,
            exhausted=True, reason=shown,
            event=Event(type="WorkloadFailed", workload_id=wid, node_id=nid, reason=shown,
                        timestamp=now, details={"attempts": str(attempts)}))
    next_at = now + timedelta(seconds=retry_backoff_s(attempts, policy))
    return RetryOutcome(
        attempts=attempts, max_attempts=limit, next_retry_at=next_at, status=RETRY_PENDING,
        last_action="RetryScheduled", failure_observed_at=observed, grace_until=None,
        exhausted=False, reason=shown,
        event=Event(type="RetryTriggered", workload_id=wid, node_id=nid, reason=shown,
                    timestamp=now, details={"attempts": str(attempts),
                                            "next_retry_at": rfc3339(next_at)}))


def apply_failure(status: WorkloadStatus, outcome: RetryOutcome, *, now: datetime) -> None:
    """Write ``outcome`` into a (copied) status record."""
    meta = status.metadata
    status.retry.attempts = outcome.attempts
    status.retry.max_attempts = outcome.max_attempts
    status.retry.next_retry_at = rfc3339(outcome.next_retry_at) if outcome.next_retry_at else ""
    status.status = outcome.status
    status.status_info.actual_state = FAILED if outcome.exhausted else "Pending"
    status.status_info.failure_reason = outcome.reason
    status.status_info.last_updated = rfc3339(now)
    meta["last_action"] = outcome.last_action
    meta["scheduler_last_error"] = outcome.reason
    if outcome.exhausted:
        for key in GRACE_KEYS:
            meta.pop(key, None)
        return
    if outcome.failure_observed_at is not None:
        meta[FAILURE_OBSERVED_AT] = rfc3339(outcome.failure_observed_at)
    if outcome.grace_until is not None:
        meta[FAILURE_GRACE_UNTIL] = rfc3339(outcome.grace_until)
    else:
        meta.pop(FAILURE_GRACE_UNTIL, None)
    meta[FAILURE_COUNTED_FOR] = str(meta.get(LAST_APPLY_AT) or "-")


def failure_counted(status: WorkloadStatus) -> bool:
    """Was the failure of the latest apply attempt already counted against the budget?"""
    counted = status.metadata.get(FAILURE_COUNTED_FOR)
    return counted is not None and str(counted) == str(status.metadata.get(LAST_APPLY_AT) or "-")


def retry_wait(status: WorkloadStatus, now: datetime) -> datetime | None:
    """The retry time still ahead of ``now`` (the backoff gate), or None when free to act."""
    at = _time(status.retry.next_retry_at)
    return at if at is not None and now < at else None


def exhausted(status: WorkloadStatus, policy: RetryPolicy) -> bool:
    """Terminal by the budget: attempts reached the maximum and the status says Failed.

    One of Go's halt conditions (docs/compatibility.md, "Reconcile order")."""
    return status.status == FAILED and status.retry.attempts >= max_attempts_of(status, policy)


def needs_success_reset(status: WorkloadStatus) -> bool:
    """Is there failure or re-apply bookkeeping that a success must clear?

    See docs/compatibility.md, "Retry grace reset"."""
    return (status.retry.attempts > 0 or bool(status.retry.next_retry_at)
            or not SUCCESS_CLEARS.isdisjoint(status.metadata))


def apply_success(status: WorkloadStatus, *, actual: str, now: datetime) -> bool:
    """Record that the desired state was reached: reset budget, grace and re-apply backoff.

    ``lastApplyRequestAt`` and ``lastApplyRevision`` stay (they say what runs). Returns True when
    the record changed.
    """
    before = (status.status, status.status_info.actual_state, status.retry.attempts,
              status.retry.next_retry_at, dict(status.metadata))
    status.retry.attempts = 0
    status.retry.next_retry_at = ""
    for key in (*GRACE_KEYS, REAPPLY_ATTEMPTS, REAPPLY_NEXT_AT):
        status.metadata.pop(key, None)
    if status.status != actual or status.status_info.actual_state != actual:
        status.status = actual
        status.status_info.actual_state = actual
        status.status_info.failure_reason = ""
    after = (status.status, status.status_info.actual_state, status.retry.attempts,
             status.retry.next_retry_at, status.metadata)
    if before == after:
        return False
    status.status_info.last_updated = rfc3339(now)
    return True
