"""Pure reconcile decisions: per workload, per cycle, per drift, per node (persys-facts E4, E7, E1).

Why: the loops in ``handlers.reconcile.loops`` only gather inputs (the projections and one agent
``ListWorkloads`` per owned node) and carry out actions; *what* to do is decided here, from
(spec, status, observation, node availability, now, policy), without I/O or clock reads. Only
actions whose ``rpc`` is set make an agent call and only those whose ``writes`` is set write to
etcd, which is how a steady-state cycle costs one RPC per owned node and no write at all.

Order of ``plan_workload`` (E4 ``ReconcileWorkload``, reshaped around the prefetch):

1. desired Deleted: delete on the agent when it still reports the workload, else finalise;
2. terminal (retry budget exhausted, ``retry_terminal``, a non-retryable failure reason): halt;
3. retry backoff gate (``retry.nextRetryAt`` ahead of now): wait;
4. unassigned: place;
5. node unavailable: move it (failover, ``Rescheduled``) unless it is node-local (it waits) or
   the disruption guard has not admitted its node yet (``handlers.reconcile.disruption``; it waits);
6. observed vs desired: re-apply (guarded, bug I13), count a failure (retry budget), apply
   Stopped, settle (reset the bookkeeping after a success, bug I15), or nothing.

An observed ``Failed`` is the agent's definitive answer, so it is governed by the retry budget
(E6), not by the re-apply guard; ``Missing``/``Stopped`` may be an apply still in flight, so they
are governed by the guard (E5).

The agent's status metadata (E4 "merged into the workload": ``vm.primary_ip``,
``container.stderr``, ``failure_reason``, ... bounded and filtered by
``handlers.workloads.metadata``) is news when a merge would change the stored status. The halt
check (2.) reads it as merged; an action that writes the status anyway merges it
(``Action.reported``), and one that would do nothing becomes ``RecordAgentMetadata``. Once merged
it is no news, so the steady state still writes nothing.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from eventsource.events import parse_rfc3339
from eventsource.records import Node, WorkloadSpec, WorkloadStatus
from handlers.specs.fields import InvalidSpec, validate_id
from handlers.specs.stored import being_deleted, normalize_desired_state
from handlers.workloads.metadata import FAILURE_REASON, NO_METADATA, agent_metadata, metadata_news
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

RUNNING = "Running"
STOPPED = "Stopped"
DELETED = "Deleted"
PENDING = "Pending"
FAILED = "Failed"
UNKNOWN = "Unknown"
MISSING = "Missing"
#: node statuses whose agent is expected to answer (Draining still runs its workloads)
SERVING_NODE_STATUSES = frozenset({"ready", "active", "draining"})
#: node statuses the liveness monitor turns into NotReady
MONITORED_NODE_STATUSES = frozenset({"ready", "active"})
#: statuses a cycle leaves alone (E4: "skip workloads with status Completed or Deleted")
FINISHED_STATUSES = frozenset({"completed", "deleted"})
TERMINAL_FAILURE_REASONS = frozenset({"INVALID_IMAGE", "INVALID_SPECIFICATION",
                                      "INVALID_CONFIGURATION", "PORT_BIND_CONFLICT"})
TRUTHY = frozenset({"true", "1", "yes"})
#: agent ActualState enum -> our state names
AGENT_STATES = {0: UNKNOWN, 1: PENDING, 2: RUNNING, 3: STOPPED, 4: FAILED, 5: UNKNOWN}
#: scheduler statuses that name an agent state (drift compares only these)
COMPARABLE_STATUSES = frozenset({PENDING, RUNNING, STOPPED, FAILED, UNKNOWN, "Scheduled"})




def node_of(status: WorkloadStatus) -> str:
    return status.node_id or status.assigned_node


# -- inputs ----------------------------------------------------------------------------------


class ObservedWorkload(NamedTuple):
    """One workload as an agent's ``ListWorkloads`` reported it.

    A NamedTuple, not a frozen dataclass: a cycle builds one per workload of every node
    (100,000 at 5,000 nodes), and a frozen dataclass's ``__init__`` cost 5.4 us each against
    1.5 us for the tuple (measured), half a second of every 5 s cycle.
    """

    workload_id: str
    state: str
    revision_id: str = ""
    desired: str = ""
    message: str = ""
    #: what of the agent's status metadata may be merged into the status (``statusmeta``)
    metadata: Mapping[str, str] = NO_METADATA


@dataclass(frozen=True, slots=True)
class NodeObservation:
    """The prefetch of one node: its workloads, or why there are none."""

    node_id: str
    ok: bool
    workloads: Mapping[str, ObservedWorkload] = field(default_factory=dict)
    unreachable: bool = False
    error: str = ""


class NodeView(NamedTuple):
    """What the plan needs to know about a node.

    A NamedTuple: immutable, and cheap to build, which matters because the reconcile cycle and
    the node monitor each build one per node every few seconds (0.8 us against 2.1 us for a
    frozen dataclass, whose ``__init__`` sets each field through ``object.__setattr__``).
    """

    node_id: str
    exists: bool
    status: str
    alive: bool
    endpoint: str = ""

    @property
    def available(self) -> bool:
        return self.exists and self.alive and self.status.lower() in SERVING_NODE_STATUSES


def node_view(node_id: str, node: Node | None, *, alive: bool) -> NodeView:
    if node is None:
        return NodeView(node_id, exists=False, status="", alive=alive)
    return NodeView(node_id, exists=True, status=node.status, alive=alive,
                    endpoint=node.endpoint)


def owns_workload(workload_id: str, *, shard_count: int, shard_index: int) -> bool:
    """Which shard places an unassigned workload: crc32(workload id) mod count (our choice;
    the Go treatment of unassigned workloads in active-active mode is unknown, E4)."""
    if shard_count <= 1:
        return True
    return zlib.crc32(workload_id.encode()) % shard_count == shard_index


# -- actions ---------------------------------------------------------------------------------

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
    """Why re-applying must stop for good ('' if it must not), E4 ``shouldHaltReapply``.

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
    # the agent's metadata news (E4: merged into the workload, and read by the halt check)
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
                # agent lists its old Failed (persys-facts I13): the failure already counted.
                # The re-apply guard (at least the VM apply timeout, I14) bounds the wait, as
                # Go's guard did (E4 step 8); a container's apply shows its outcome at once
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


@dataclass(frozen=True, slots=True)
class CyclePlan:
    """Every owned workload's action for one cycle.

    ``steady`` holds the ids of workloads found in the steady state (their action is NoAction);
    they get no Action object, which is most of a large fleet's cycle.
    """

    actions: tuple[Action, ...]
    steady: tuple[str, ...] = ()

    def needing_io(self) -> list[Action]:
        return [a for a in self.actions if a.rpc or a.writes]

    def kinds(self) -> dict[str, str]:
        """workload id -> action kind, steady workloads included."""
        out = dict.fromkeys(self.steady, NOOP)
        out.update((a.workload_id, a.kind) for a in self.actions)
        return out

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {NOOP: len(self.steady)} if self.steady else {}
        for a in self.actions:
            out[a.kind] = out.get(a.kind, 0) + 1
        return out


#: what planning needs of an owned node: (available, its listing if the list succeeded, may its
#: workloads move, exists and is alive)
NodeFacts = tuple[bool, Mapping[str, ObservedWorkload] | None, bool, bool]


def node_facts(node: str, nodes: Mapping[str, NodeView],
               observations: Mapping[str, NodeObservation],
               evictable: Callable[[str], bool] | None) -> NodeFacts:
    """(available, its listing if the list succeeded, may its workloads move, exists and is
    alive) of an owned node."""
    view = nodes.get(node)
    available = view.available if view is not None else False
    obs = observations.get(node)
    listed = obs.workloads if obs is not None and obs.ok else None
    may_move = available or evictable is None or evictable(node)
    alive = view is not None and view.exists and view.alive
    return available, listed, may_move, alive


def plan_node(node: str, workload_ids: Iterable[str], specs: Mapping[str, WorkloadSpec],
              statuses: Mapping[str, WorkloadStatus], facts: NodeFacts, *, now: datetime,
              policy: RetryPolicy, exclude: Collection[str], actions: list[Action],
              steady: list[str]) -> None:
    """Plan those of ``workload_ids`` whose status puts them on ``node`` (an owned node).

    Appends to ``actions`` and ``steady`` rather than returning lists: a cycle calls this once
    per node, thousands of times. Workloads without a spec or status record are skipped (a
    create writes both in one transaction, so that is a half-visible projection, not a state to
    repair), and so are Completed and Deleted ones (E4 step 2) and those in ``exclude``.
    """
    available, listed, may_move, alive = facts
    for workload_id in sorted(workload_ids):
        spec = specs.get(workload_id)
        status = statuses.get(workload_id)
        if (spec is None or status is None or workload_id in exclude
                or status.status.lower() in FINISHED_STATUSES or node_of(status) != node):
            continue
        seen = listed.get(workload_id) if listed is not None else None
        if available and steady_running(spec, status, seen):
            steady.append(workload_id)
            continue
        actions.append(plan_workload(spec, status, seen, node_available=available,
                                     node_observed=listed is not None, now=now, policy=policy,
                                     evictable=may_move, node_alive=alive))


def plan_unassigned(workload_ids: Iterable[str], specs: Mapping[str, WorkloadSpec],
                    statuses: Mapping[str, WorkloadStatus], *, now: datetime,
                    policy: RetryPolicy, exclude: Collection[str],
                    actions: list[Action]) -> None:
    """Plan those of ``workload_ids`` that are active and on no node (placement, mostly)."""
    for workload_id in workload_ids:
        spec = specs.get(workload_id)
        status = statuses.get(workload_id)
        if (spec is None or status is None or workload_id in exclude
                or status.status.lower() in FINISHED_STATUSES or node_of(status)):
            continue
        actions.append(plan_workload(spec, status, None, node_available=False,
                                     node_observed=False, now=now, policy=policy))


def plan_cycle(
    specs: Mapping[str, WorkloadSpec],
    statuses: Mapping[str, WorkloadStatus],
    *,
    nodes: Mapping[str, NodeView],
    observations: Mapping[str, NodeObservation],
    owns_node: Callable[[str], bool],
    owns_unassigned: Callable[[str], bool],
    now: datetime,
    policy: RetryPolicy,
    exclude: Collection[str] = (),
    evictable: Callable[[str], bool] | None = None,
) -> CyclePlan:
    """Plan every workload this shard owns: its share of unassigned ones, then those on its nodes.

    The whole plan in one call, grouping the workloads by node from their statuses. The
    reconcile loop reaches the same plan from the projection's index instead, node by node, and
    skips nodes whose inputs did not change (``handlers.reconcile.loops.plan_by_node``); tests hold
    the two to the same answer. ``evictable(node_id)`` is the disruption guard's answer for
    unavailable nodes (None: every node may be evicted).
    """
    groups: dict[str, list[str]] = {}
    unassigned: list[str] = []
    for workload_id in specs:
        status = statuses.get(workload_id)
        if status is None:
            continue
        node = node_of(status)
        if not node:
            if owns_unassigned(workload_id):
                unassigned.append(workload_id)
        else:
            groups.setdefault(node, []).append(workload_id)
    actions: list[Action] = []
    steady: list[str] = []
    plan_unassigned(unassigned, specs, statuses, now=now, policy=policy, exclude=exclude,
                    actions=actions)
    for node, ids in groups.items():
        if owns_node(node):
            plan_node(node, ids, specs, statuses,
                      node_facts(node, nodes, observations, evictable), now=now,
                      policy=policy, exclude=exclude, actions=actions, steady=steady)
    return CyclePlan(tuple(actions), tuple(steady))


#: what a node's steady answer was decided from: its stamp in the workload index, its view and
#: its agent's listing
SteadyKey = tuple[tuple[int, int], NodeView, Mapping[str, ObservedWorkload]]


class SteadyNodes:
    """Nodes whose every planned workload was steady, with the inputs that made them so.

    Why: at 5,000 nodes nearly every node is steady cycle after cycle, and checking 100,000
    workloads one by one (reading each spec and status) was most of a cycle's plan phase. A
    node's steady workloads are decided only by their specs and statuses (the workload index's
    stamp changes whenever one of them does), the node's view (available or not) and its
    agent's listing; the steady check reads no clock. So when all three are what they were, the
    answer is what it was. Only nodes answered entirely steady are kept, and only those planned
    in the last cycle, so the memo holds at most one entry per owned node.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[SteadyKey, tuple[str, ...]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, node: str, key: SteadyKey) -> tuple[str, ...] | None:
        entry = self._entries.get(node)
        if entry is None:
            return None
        (stamp, view, listed), ids = entry
        if stamp != key[0] or view != key[1] or (listed is not key[2] and listed != key[2]):
            return None
        return ids

    def replace(self, entries: dict[str, tuple[SteadyKey, tuple[str, ...]]]) -> None:
        """Keep exactly ``entries`` (this cycle's steady nodes)."""
        self._entries = entries


# -- drift (E7) ------------------------------------------------------------------------------

ORPHAN = "orphan_on_agent"
STATE_MISMATCH = "state_mismatch"
REVISION_MISMATCH = "revision_mismatch"
MISSING_ON_AGENT = "missing_on_agent"

DELETE_ORPHAN = "delete_orphan_on_agent"
DELETE_RESIDUAL = "delete_deleted_residual_on_agent"
DELETE_DUPLICATE = "delete_duplicate_on_reporting_node"
ADOPT = "adopt_orphan_to_reporting_node"
REASSIGN_MISSING_OWNER = "reassign_from_missing_owner"
REBIND_ROTATED = "rebind_assignment_to_rotated_node_id"
FAILOVER_REASSIGN = "failover_reassign_to_reporting_node"
REASSIGN = "reassign_to_reporting_node"
INVESTIGATE = "operator_investigation"
AWAIT_OWNER_APPLY = "await_owner_apply"
ALIGN_STATUS = "align_scheduler_status"
REAPPLY_REVISION = "reapply_scheduler_revision"
RETRY_AND_RECONCILE = "retry_and_reconcile"

ADOPT_ACTIONS = frozenset({ADOPT, REASSIGN_MISSING_OWNER, REBIND_ROTATED, FAILOVER_REASSIGN,
                           REASSIGN})
DELETE_ON_AGENT_ACTIONS = frozenset({DELETE_ORPHAN, DELETE_DUPLICATE})
#: orphans classified per node and pass: an agent's listing is its own word, and a listing of
#: thousands of made-up ids must not become thousands of records, events and deletes at once
#: (the rest are found by the next passes, as these are deleted)
MAX_ORPHANS_PER_NODE = 100


@dataclass(frozen=True, slots=True)
class DriftFinding:
    """One difference between what the scheduler expects on a node and what its agent holds."""

    node_id: str
    workload_id: str
    drift_type: str
    action: str
    scheduler_status: str = ""
    agent_status: str = ""
    #: for adoptions: the node the workload was assigned to
    previous_node: str = ""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.node_id, self.workload_id, self.drift_type, self.action)


def _in_flight(spec: WorkloadSpec | None, status: WorkloadStatus, now: datetime,
               policy: RetryPolicy) -> bool:
    """An apply was sent recently enough that the agent's list may not show it yet (I13)."""
    verdict = reapply_guard(ReapplyState.read(status.metadata),
                            revision_id=spec.revision_id if spec else "",
                            workload_type=spec.type if spec else "", now=now, policy=policy,
                            dispatched_at=dispatched_at(status))
    return verdict.active


def classify_drift(
    specs: Mapping[str, WorkloadSpec],
    statuses: Mapping[str, WorkloadStatus],
    *,
    expected: Mapping[str, Collection[str]],
    nodes: Mapping[str, NodeView],
    observations: Mapping[str, NodeObservation],
    now: datetime,
    policy: RetryPolicy,
) -> list[DriftFinding]:
    """Compare every successfully listed node with what is assigned to it (E7).

    ``expected`` maps node id -> workload ids assigned to it. Only nodes in ``observations``
    with ``ok`` are compared; owners that were not listed count as "unknown" (never "missing").
    Adoptions are decided first, so ``missing_on_agent`` skips a workload re-bound this cycle,
    and a workload reported by several non-owners is adopted by one (the lowest node id) and
    deleted as a duplicate from the others. Ids that are not valid workload ids are ignored,
    and at most ``MAX_ORPHANS_PER_NODE`` orphans are classified per node.
    """
    findings: list[DriftFinding] = []
    adopted: set[str] = set()
    listed = sorted(n for n, o in observations.items() if o.ok)
    for node_id in listed:
        obs = observations[node_id]
        mine = expected.get(node_id, ())
        here = nodes.get(node_id)
        orphans = 0
        for wid in sorted(obs.workloads):
            seen = obs.workloads[wid]
            status = statuses.get(wid)
            spec = specs.get(wid)
            if wid in mine and status is not None and spec is not None:
                findings.extend(_expected_drift(node_id, spec, status, seen, now, policy))
                continue
            if orphans >= MAX_ORPHANS_PER_NODE or not _valid_id(wid):
                continue
            orphans += 1
            findings.append(_orphan(node_id, here, wid, spec, status, seen, nodes,
                                    observations, adopted, now, policy))
    for node_id in listed:
        obs = observations[node_id]
        for wid in sorted(expected.get(node_id, ())):
            if wid in obs.workloads or wid in adopted:
                continue
            spec = specs.get(wid)
            status = statuses.get(wid)
            if spec is None or status is None or node_of(status) != node_id:
                continue
            if being_deleted(spec, status):
                continue
            if _in_flight(spec, status, now, policy):
                continue
            findings.append(DriftFinding(node_id, wid, MISSING_ON_AGENT, RETRY_AND_RECONCILE,
                                         status.status, MISSING))
    return findings


def _expected_drift(node_id: str, spec: WorkloadSpec, status: WorkloadStatus,
                    seen: ObservedWorkload, now: datetime,
                    policy: RetryPolicy) -> list[DriftFinding]:
    wid = spec.id or status.id
    if normalize_desired_state(spec.desired_state) == DELETED:
        return [DriftFinding(node_id, wid, ORPHAN, DELETE_RESIDUAL, status.status, seen.state)]
    out: list[DriftFinding] = []
    if (seen.revision_id and spec.revision_id and seen.revision_id != spec.revision_id
            and not _in_flight(spec, status, now, policy)):
        out.append(DriftFinding(node_id, wid, REVISION_MISMATCH, REAPPLY_REVISION,
                                status.status, seen.state))
    settled = seen.state in (RUNNING, STOPPED, FAILED)
    if (settled and status.status in COMPARABLE_STATUSES and status.status != seen.state
            and not (seen.revision_id and spec.revision_id
                     and seen.revision_id != spec.revision_id)):
        out.append(DriftFinding(node_id, wid, STATE_MISMATCH, ALIGN_STATUS, status.status,
                                seen.state))
    return out


def _orphan(node_id: str, here: NodeView | None, wid: str, spec: WorkloadSpec | None,
            status: WorkloadStatus | None, seen: ObservedWorkload,
            nodes: Mapping[str, NodeView], observations: Mapping[str, NodeObservation],
            adopted: set[str], now: datetime, policy: RetryPolicy) -> DriftFinding:
    """Classify a workload an agent holds but the scheduler assigned elsewhere (or nowhere).

    The reporting agent's word alone never moves a workload to its node: an adoption that
    changes the owner needs the agent to report the spec's revision, which it can know only
    from an apply of that very spec. Otherwise one node's agent could list another node's
    workload id while that node restarts and be sent the spec, secrets included; such a
    finding is left to the operator (``operator_investigation``) and to the normal failover.
    """

    def finding(action: str, previous: str = "") -> DriftFinding:
        if action in ADOPT_ACTIONS and previous != node_id and not _vouched(spec, seen):
            action = INVESTIGATE
        if action in ADOPT_ACTIONS:
            if wid in adopted:
                action = DELETE_DUPLICATE
            else:
                adopted.add(wid)
        return DriftFinding(node_id, wid, ORPHAN, action,
                            status.status if status is not None else "", seen.state, previous)

    if spec is None or status is None:
        return finding(DELETE_ORPHAN)
    if being_deleted(spec, status):
        return finding(DELETE_RESIDUAL)
    owner = node_of(status)
    if not owner or owner == node_id:
        return finding(ADOPT, owner)
    owner_view = nodes.get(owner)
    if owner_view is None or not owner_view.exists:
        return finding(REASSIGN_MISSING_OWNER, owner)
    if here is not None and _real(here.endpoint) and owner_view.endpoint == here.endpoint:
        return finding(REBIND_ROTATED, owner)
    owner_obs = observations.get(owner)
    if owner_obs is not None and owner_obs.ok:
        if wid in owner_obs.workloads:
            return finding(DELETE_DUPLICATE, owner)
        if _in_flight(spec, status, now, policy):
            return finding(AWAIT_OWNER_APPLY, owner)
        return finding(REASSIGN, owner)
    if not owner_view.available or (owner_obs is not None and owner_obs.unreachable):
        return finding(FAILOVER_REASSIGN, owner)
    return finding(INVESTIGATE, owner)


def _vouched(spec: WorkloadSpec | None, seen: ObservedWorkload) -> bool:
    """The agent reports the revision the scheduler holds for this workload."""
    return spec is not None and bool(spec.revision_id) and seen.revision_id == spec.revision_id


def _valid_id(workload_id: str) -> bool:
    try:
        return validate_id("workload_id", workload_id) == workload_id
    except InvalidSpec:
        return False


def _real(endpoint: str) -> bool:
    """An endpoint with a host (a record without address fields renders as ``:0``)."""
    host, _, port = endpoint.rpartition(":")
    return bool(host) and port not in ("", "0")


class DriftDeduper:
    """Admits one DriftDetected per (node, workload, type, action) per window (E7: 2 min).

    Bounded: above ``max_entries`` the entries older than the window are pruned, and if that is
    not enough the oldest are dropped (a dropped key may be reported again: harmless).
    """

    def __init__(self, *, window_s: float = 120.0, max_entries: int = 4096) -> None:
        self.window = timedelta(seconds=window_s)
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, str, str, str], datetime] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, key: tuple[str, str, str, str], now: datetime) -> bool:
        last = self._seen.get(key)
        if last is not None and now - last < self.window:
            return False
        self._seen[key] = now
        self._seen.move_to_end(key)
        if len(self._seen) > self.max_entries:
            self._prune(now)
        return True

    def _prune(self, now: datetime) -> None:
        for key in [k for k, t in self._seen.items() if now - t >= self.window]:
            del self._seen[key]
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)


# -- node monitor (E1) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeCheck:
    """The inputs of the node monitor for one node."""

    node_id: str
    status: str
    #: the liveness key is absent *and* the alive projection has caught up with the node record
    lease_gone: bool
    status_updated_at: str = ""


@dataclass(frozen=True, slots=True)
class MonitorPlan:
    lost: tuple[str, ...]
    collect: tuple[str, ...]


def plan_node_monitor(checks: Iterable[NodeCheck], *, now: datetime,
                      gc_after_s: float) -> MonitorPlan:
    """Ready nodes whose liveness lease expired become NotReady; NotReady nodes older than
    ``gc_after_s`` (measured from ``statusUpdatedAt``; 0 disables) are removed."""
    lost: list[str] = []
    collect: list[str] = []
    for check in checks:
        status = check.status.lower()
        if status in MONITORED_NODE_STATUSES and check.lease_gone:
            lost.append(check.node_id)
        elif status == "notready" and gc_after_s > 0 and check.lease_gone:
            since = parse_rfc3339(check.status_updated_at)
            if since is not None and now - since >= timedelta(seconds=gc_after_s):
                collect.append(check.node_id)
    return MonitorPlan(tuple(sorted(lost)), tuple(sorted(collect)))


_AGENT_DESIRED = {1: RUNNING, 2: STOPPED}


def observed_from_agent(statuses: Iterable[Any]) -> dict[str, ObservedWorkload]:
    """An agent's ``ListWorkloads`` entries -> {workload id: ObservedWorkload} (duck-typed: no
    proto import); entries without an id are dropped.

    Runs over every workload of every node each cycle (100,000 at 5,000 nodes), hence one
    comprehension with positional tuples: a helper call per entry, or keywords, doubled it.
    """
    states, desired = AGENT_STATES, _AGENT_DESIRED
    return {s.id: ObservedWorkload(s.id, states.get(s.actual_state, UNKNOWN), s.revision_id,
                                   desired.get(s.desired_state, ""), s.message,
                                   agent_metadata(s.metadata) if s.metadata else NO_METADATA)
            for s in statuses if s.id}
