"""The per-workload decision: the one action for a workload this cycle.

Why: the loops in ``handlers.reconcile.cycle`` only gather inputs (the projections and one agent
``ListWorkloads`` per owned node) and carry out actions; *what* to do is decided here, from
(spec, status, observation, node availability, now, policy), without I/O or clock reads. Only
actions whose ``rpc`` is set make an agent call and only those whose ``writes`` is set write to
etcd, which is how a steady-state cycle costs one RPC per owned node and no write at all.

Order of ``plan_workload`` (Go ``ReconcileWorkload``, docs/compatibility.md, "Reconcile order",
reshaped around the prefetch):

1. desired Deleted: delete on the agent when it still reports the workload, else finalise;
2. terminal (retry budget exhausted, ``retry_terminal``, a non-retryable failure reason): halt;
3. retry backoff gate (``retry.nextRetryAt`` ahead of now): wait;
4. unassigned: place;
5. node unavailable: move it (failover, ``Rescheduled``) unless it is node-local (it waits) or
   the disruption guard has not admitted its node yet (``handlers.reconcile.disruption``; it waits);
6. observed vs desired: re-apply (guarded), count a failure (retry budget), apply Stopped,
   settle (reset the bookkeeping after a success), or nothing. The guard and the reset fix two
   Go bugs: docs/compatibility.md, "In-flight applies" and "Retry grace reset".

An observed ``Failed`` is the agent's definitive answer, so it is governed by the retry budget,
not by the re-apply guard; ``Missing``/``Stopped`` may be an apply still in flight, so they are
governed by the guard (docs/compatibility.md, "Retry budget" and "Re-apply guard").

The agent's status metadata (docs/compatibility.md, "Workload status metadata":
``vm.primary_ip``, ``container.stderr``, ``failure_reason``, ... bounded and filtered by
``handlers.workloads.metadata``) is news when a merge would change the stored status. The halt
check (2.) reads it as merged; an action that writes the status anyway merges it
(``Action.reported``), and one that would do nothing becomes ``RecordAgentMetadata``. Once merged
it is no news, so the steady state still writes nothing.

``steady_running`` is the cheap answer for the common case (Running where it should be), held
to ``plan_workload`` by a property test; the cycle plan (``handlers.reconcile.planner.cycle``) asks
it first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from eventsource.events import parse_rfc3339
from eventsource.records import WorkloadSpec, WorkloadStatus
from handlers.reconcile.planner.inputs import (
    DELETED,
    FAILED,
    MISSING,
    PENDING,
    RUNNING,
    STOPPED,
    UNKNOWN,
    ObservedWorkload,
    node_of,
)
from handlers.specs.stored import normalize_desired_state
from handlers.workloads.metadata import FAILURE_REASON, NO_METADATA, metadata_news
from handlers.workloads.persistence import is_node_local
from handlers.workloads.retry import (
    FAILURE_COUNTED_FOR,
    SUCCESS_CLEARS,
    ReapplyState,
    RetryPolicy,
    exhausted,
    failure_counted,
    is_vm,
    needs_success_reset,
    reapply_guard,
    retry_wait,
)

TERMINAL_FAILURE_REASONS = frozenset({"INVALID_IMAGE", "INVALID_SPECIFICATION",
                                      "INVALID_CONFIGURATION", "PORT_BIND_CONFLICT"})
TRUTHY = frozenset({"true", "1", "yes"})

NOOP = "NoAction"
BACKOFF_WAIT = "BackoffWait"
REAPPLY_BACKOFF_WAIT = "ReapplyBackoffWait"
AWAIT_NODE = "AwaitNodeReturn"
AWAIT_EVICTION = "AwaitEviction"
UNOBSERVED = "Unobserved"
TERMINAL = "TerminalFailureNoReapply"
SETTLING = "AwaitSettle"
FINALIZE = "FinalizeDelete"
DELETE = "Delete"
PLACE = "Assign"
FAILOVER = "Reschedule"
REAPPLY = "ReapplyRunning"
APPLY_STOPPED = "ApplyStopped"
COUNT_FAILURE = "RetryOnFailure"
SETTLE = "Settle"
MARK_TERMINAL = "MarkTerminal"
RECORD_REPORT = "RecordAgentMetadata"

#: actions that make an agent RPC (apply or delete)
RPC_ACTIONS = frozenset({DELETE, REAPPLY, APPLY_STOPPED})
#: actions that (may) write etcd
WRITE_ACTIONS = frozenset({FINALIZE, DELETE, PLACE, FAILOVER, REAPPLY, APPLY_STOPPED,
                           COUNT_FAILURE, SETTLE, MARK_TERMINAL, RECORD_REPORT})
#: actions whose status write also merges the agent's metadata news (``Action.reported``)
MERGING_ACTIONS = frozenset({COUNT_FAILURE, SETTLE, MARK_TERMINAL, RECORD_REPORT})
#: actions without I/O that become RECORD_REPORT when the agent reported news
QUIET_ACTIONS = frozenset({NOOP, SETTLING, TERMINAL, BACKOFF_WAIT, REAPPLY_BACKOFF_WAIT})


@dataclass(frozen=True, slots=True)
class Action:
    """What to do with one workload this cycle, and why."""

    kind: str
    workload_id: str
    node_id: str = ""
    reason: str = ""
    #: the agent state seen in the prefetch (or Missing), for the shell's records
    observed: str = ""
    #: the agent's metadata to merge into the status (MERGING_ACTIONS), as sorted pairs
    reported: tuple[tuple[str, str | None], ...] = ()
    #: the spec revision the plan saw: a status write decided from the agent's report must not
    #: land on a spec updated (or deleted) between the listing and the write
    revision: str = ""

    @property
    def rpc(self) -> bool:
        return self.kind in RPC_ACTIONS

    @property
    def writes(self) -> bool:
        return self.kind in WRITE_ACTIONS


#: statuses written by a placement or an update, after which the dispatcher sends the apply
DISPATCHED_STATUSES = frozenset({"Scheduled", "Updating"})


def dispatched_at(status: WorkloadStatus) -> datetime | None:
    """When the apply after a placement/update went out, if no apply outcome was recorded."""
    if status.status not in DISPATCHED_STATUSES:
        return None
    return parse_rfc3339(status.status_info.last_updated)


#: status metadata that ``halted`` reads (``steady_running`` refuses any workload carrying one)
RETRY_TERMINAL = "retry_terminal"
HALT_KEYS = frozenset({RETRY_TERMINAL, FAILURE_REASON})


def halted(spec: WorkloadSpec, status: WorkloadStatus, policy: RetryPolicy,
           reported: Mapping[str, str | None] = NO_METADATA) -> str:
    """Why re-applying must stop for good ('' if it must not): Go's ``shouldHaltReapply``
    (docs/compatibility.md, "Reconcile order").

    ``reported``: the agent's metadata news, merged before the check as Go merges it.
    A new metadata key read here belongs in ``HALT_KEYS`` too."""
    meta = status.metadata
    if str(meta.get(RETRY_TERMINAL, "")).strip().lower() in TRUTHY:
        return str(meta.get("retry_terminal_reason") or "retry marked terminal")
    value = reported[FAILURE_REASON] if FAILURE_REASON in reported else meta.get(FAILURE_REASON)
    reason = str(value or "").strip().upper()
    if reason in TERMINAL_FAILURE_REASONS:
        return f"non-retryable failure {reason}"
    if exhausted(status, policy):
        return f"retry budget exhausted after {status.retry.attempts} attempts"
    return ""


def plan_workload(spec: WorkloadSpec, status: WorkloadStatus, observed: ObservedWorkload | None,
                  *, node_available: bool, node_observed: bool, now: datetime,
                  policy: RetryPolicy, evictable: bool = True,
                  node_alive: bool = False) -> Action:
    """The one action for a workload this cycle (see the module docstring for the order).

    Args:
        observed: the workload in its node's prefetch; None when the node's list did not
            contain it (then ``node_observed`` says whether the list itself succeeded).
        node_available: the assigned node exists, is Ready/Active/Draining and alive.
        node_observed: the assigned node's ListWorkloads succeeded this cycle.
        evictable: the disruption guard lets the workloads of the (unavailable) node move.
        node_alive: the assigned node exists and its liveness key is there: unavailable or
            unanswering, it may still run the workload (a delete then waits for it).
    """
    wid = spec.id or status.id
    node = node_of(status)
    desired = normalize_desired_state(spec.desired_state)
    actual = observed.state if observed is not None else MISSING
    news: Mapping[str, str | None] = NO_METADATA

    def act(kind: str, reason: str = "") -> Action:
        if news and kind in QUIET_ACTIONS:
            kind, reason = RECORD_REPORT, f"agent reported {', '.join(sorted(news))} ({kind})"
        reported = tuple(sorted(news.items())) if kind in MERGING_ACTIONS else ()
        return Action(kind, wid, node, reason, actual if node_observed else "", reported,
                      spec.revision_id)

    # 1. deletion
    if desired == DELETED:
        if not node or not (node_available or node_alive):
            return act(FINALIZE, "no node holds it" if not node else "its node is gone")
        if not node_available or not node_observed:
            # alive but not answering (or not serving): the agent may still run it, and
            # finalising would leave it running there with no state (docs: evidence only)
            return act(UNOBSERVED, "its node is alive but its workload list is unknown")
        if observed is not None:
            return act(DELETE, "desired Deleted and still on the agent")
        return act(FINALIZE, "gone from the agent")
    # the agent's metadata news (merged into the workload and read by the halt check:
    # docs/compatibility.md, "Workload status metadata")
    if node_available and observed is not None and (
            observed.metadata or FAILURE_REASON in status.metadata):
        news = reported_news(spec, status, observed)
    # 2. terminal
    why = halted(spec, status, policy, news)
    if why:
        if status.status != FAILED or news:  # (a heartbeat may have said Failed already)
            return act(MARK_TERMINAL, why)
        return act(TERMINAL, why)
    # 3. retry backoff gate
    wait = retry_wait(status, now)
    if wait is not None:
        return act(BACKOFF_WAIT, f"retry not before {wait.isoformat()}")
    # 4. unassigned
    if not node:
        return act(PLACE, "not assigned to a node")
    # 5. failover
    if not node_available:
        if is_node_local(spec, status.metadata):
            return act(AWAIT_NODE, "node-local workload waits for its node")
        if not evictable:
            return act(AWAIT_EVICTION, "assigned node unavailable; its eviction waits for the "
                                       "disruption guard")
        return act(FAILOVER, "assigned node unavailable")
    if not node_observed:
        return act(UNOBSERVED, "its node's workload list is unknown this cycle")
    # 6. observed vs desired

    def guarded(kind: str, reason: str) -> Action:
        # read (and its timestamps parsed) only when a corrective apply is considered: the
        # steady state of every running workload never needs it
        reapply_state = ReapplyState.read(status.metadata)
        verdict = reapply_guard(reapply_state, revision_id=spec.revision_id,
                                workload_type=spec.type, now=now, policy=policy,
                                dispatched_at=dispatched_at(status))
        if verdict.active:
            return act(REAPPLY_BACKOFF_WAIT, verdict.reason)
        return act(kind, reason)

    revision_drift = (observed is not None and bool(observed.revision_id)
                      and bool(spec.revision_id) and observed.revision_id != spec.revision_id)
    if desired == RUNNING:
        if actual == RUNNING:
            if revision_drift:
                return guarded(REAPPLY, "agent runs another revision")
            if needs_success_reset(status) or status.status != RUNNING:
                return act(SETTLE, "desired state reached")
            return act(NOOP)
        if actual == FAILED:
            if failure_counted(status):
                return act(REAPPLY, "retry due after a failed attempt")
            failed = (observed.message if observed and observed.message
                      else "workload failed on the agent")
            if FAILURE_COUNTED_FOR in status.metadata and is_vm(spec.type):
                # a VM re-applied after a counted failure boots for minutes, and meanwhile an
                # agent lists its old Failed (docs/compatibility.md, "Agent quirks"): the
                # failure already counted. The re-apply guard (at least the VM apply timeout,
                # "VM re-apply guard" there) bounds the wait, as Go's guard did
                # ("Reconcile order" there); a container's apply shows its outcome at once
                return guarded(COUNT_FAILURE, failed)
            return act(COUNT_FAILURE, failed)
        if actual in (MISSING, STOPPED):
            return guarded(REAPPLY, f"desired Running, agent says {actual}")
        if revision_drift:
            return guarded(REAPPLY, "agent holds another revision")
        return act(SETTLING, f"agent says {actual}")
    # desired Stopped
    if actual in (RUNNING, PENDING, UNKNOWN) and observed is not None:
        if actual == RUNNING or (observed.desired and observed.desired != STOPPED):
            return guarded(APPLY_STOPPED, f"desired Stopped, agent says {actual}")
        return act(SETTLING, f"stop in progress ({actual})")
    if actual == STOPPED and (needs_success_reset(status) or status.status != STOPPED):
        return act(SETTLE, "desired state reached")
    return act(NOOP)


def reported_news(spec: WorkloadSpec, status: WorkloadStatus,
                  observed: ObservedWorkload) -> dict[str, str | None]:
    """What of the agent's metadata a merge would change in the status ({} when nothing).

    Nothing from an agent holding another revision: its report describes what the apply of
    the spec's revision is about to replace (after an update, the old revision's INVALID_IMAGE
    must not halt the new one).
    """
    if observed.revision_id and spec.revision_id and observed.revision_id != spec.revision_id:
        return {}
    return metadata_news(observed.metadata, status.metadata, failed=observed.state == FAILED)


#: ``desiredState`` spellings that ``normalize_desired_state`` reads as Running, checked verbatim
RUNNING_SPELLINGS = frozenset({RUNNING, "running", ""})
#: status metadata any of which sends a workload down the full decision
_NOT_STEADY_KEYS = SUCCESS_CLEARS | HALT_KEYS


def steady_running(spec: WorkloadSpec, status: WorkloadStatus,
                   observed: ObservedWorkload | None) -> bool:
    """True only where ``plan_workload`` answers NoAction: the steady state, decided cheaply.

    Why: at 5,000 nodes a cycle plans 100,000 workloads and nearly all of them are Running
    where they should be. ``plan_workload`` spends about 10 us on each (normalising strings,
    reading retry bookkeeping, building an Action); these plain comparisons spend a fraction
    of that. The caller has already established that the workload's node is available and
    was listed. Anything unusual (retry or re-apply bookkeeping, a terminal mark, another
    revision, another state, an unusual ``desiredState`` spelling, agent metadata not yet
    merged) returns False and goes
    through ``plan_workload``, so this can only skip work, never change a decision (a
    property test holds it to that).
    """
    return (observed is not None and observed.state == RUNNING and status.status == RUNNING
            and spec.desired_state in RUNNING_SPELLINGS
            and not status.retry.attempts and not status.retry.next_retry_at
            and (observed.revision_id == spec.revision_id or not observed.revision_id
                 or not spec.revision_id)
            and _NOT_STEADY_KEYS.isdisjoint(status.metadata)
            and (not observed.metadata or not reported_news(spec, status, observed)))
