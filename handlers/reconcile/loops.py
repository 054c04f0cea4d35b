"""The leader-only loops: reconcile (with drift detection) and the node monitor.

Why: the committed state says what should run where; these loops make the fleet match it, at a
cost proportional to the number of nodes, not workloads. A reconcile cycle asks each owned,
alive, serving node once (``ListWorkloads``, at most ``SCHEDULER_RECONCILE_CONCURRENCY`` in
flight), decides every workload purely (``handlers.reconcile.planner``) and acts only where an
action needs it. In steady state a cycle therefore makes exactly one agent RPC per owned node and no
etcd write at all; every write it does make is a CAS transaction carrying the leader fence, and
every agent call is ``leader_only`` (renew-deadline check + ``x-persys-leader-term``).

A steady cycle also costs little CPU beyond its RPCs: an agent answer equal (byte for byte) to
its last one is not decoded again, and a node whose view, listing and workload records (the
index's stamp) are what they were when it was last found entirely steady is answered from a
memo (``plan_by_node``, ``SteadyNodes``) without reading its workloads. Tests hold that plan to
``plan_cycle``, the whole-cycle reference, through every kind of change.

Drift detection (E7) reuses a cycle's prefetch: the drift loop only asks for it, and the next
(or the running) reconcile cycle classifies and remediates drift on the lists it already has.

The node monitor turns a Ready node whose liveness key expired into NotReady (``NodeLost``,
source ``monitor``), moves its movable workloads (``Rescheduled``; node-local ones get
``RescheduleSkipped`` once) once the disruption guard admits the node
(``handlers.reconcile.disruption``: a rate, and a hold while most of the shard looks down) and
removes nodes NotReady for longer than ``SCHEDULER_NODE_GC_AFTER`` (``NodeLeft``). The Deleting
finisher is the reconcile cycle's ``Delete``/``FinalizeDelete`` action: a workload still in
Deleting is deleted on its agent again and finalised through ``Dispatcher.finalize``.

Loops pause in degraded and recovery modes (only ``normal`` is writable) and when this replica
does not lead. ``ReconcileLoop.run_once`` never runs two cycles at once: an overlapping call
returns at once with ``skipped="overlap"``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from google.protobuf.message import DecodeError

from eventsource.commit import Change, retry_on_conflict
from eventsource.errors import Conflict, StoreError
from eventsource.etcd import Compare, Delete, Put
from eventsource.events import Event, rfc3339
from eventsource.records import (
    Allocation,
    Assignment,
    Node,
    WorkloadSpec,
    WorkloadStatus,
    copy_record,
    encode,
)
from handlers.agents.pool import AgentError
from handlers.placement.decision import canonical_type
from handlers.reconcile.disruption import EvictionDecision, EvictionGate, EvictionPolicy
from handlers.reconcile.parts import SchedulerParts
from handlers.reconcile.planner import (
    ADOPT_ACTIONS,
    ALIGN_STATUS,
    APPLY_STOPPED,
    COMPARABLE_STATUSES,
    COUNT_FAILURE,
    DELETE,
    DELETE_ON_AGENT_ACTIONS,
    DELETE_ORPHAN,
    DELETE_RESIDUAL,
    FAILOVER,
    FINALIZE,
    MARK_TERMINAL,
    MONITORED_NODE_STATUSES,
    NOOP,
    PLACE,
    REAPPLY,
    RECORD_REPORT,
    SETTLE,
    STOPPED,
    Action,
    CyclePlan,
    DriftDeduper,
    DriftFinding,
    NodeCheck,
    NodeObservation,
    NodeView,
    SteadyKey,
    SteadyNodes,
    classify_drift,
    node_facts,
    node_of,
    node_view,
    observed_from_agent,
    owns_workload,
    plan_node,
    plan_node_monitor,
    plan_unassigned,
)
from handlers.specs.agent_request import CONVERSION_ERRORS, agent_apply_request
from handlers.specs.stored import (
    DELETING_STATUSES,
    being_deleted,
    compute_revision,
    normalize_desired_state,
    request_of,
)
from handlers.workloads.dispatch import refused
from handlers.workloads.metadata import agent_metadata, merge_metadata, metadata_news
from handlers.workloads.outcome import Outcome
from handlers.workloads.records import mark_apply_requested, release_allocation
from handlers.workloads.retry import (
    LAST_APPLY_AT,
    LAST_APPLY_REVISION,
    REAPPLY_ATTEMPTS,
    REAPPLY_KEYS,
    REAPPLY_NEXT_AT,
    ReapplyState,
    RetryPolicy,
    after_reapply,
    apply_failure,
    apply_success,
    decide_failure,
    failure_counted,
    is_vm,
)
from handlers.writes.cas import NotFound
from proto.persys.agent.v1 import agent_pb2

if TYPE_CHECKING:
    from handlers.settings.config import Settings
    from projections.cluster import WorkloadIndex

#: drift actions whose success (the workload deleted on the agent) clears the DriftRecord
CLEARED_WHEN_DONE = DELETE_ON_AGENT_ACTIONS | {DELETE_RESIDUAL}

log = logging.getLogger("persys.loops")

NOT_READY = "NotReady"
#: the body of a loop must finish within this share of its interval
BODY_SHARE = 0.8
#: drift records + events per transaction (2 ops each, well under etcd's 128)
DRIFT_BATCH = 40
#: an apply error with this text (any case) means the node lacks the workload's runtime (E1)
RUNTIME_MISSING = "runtime not available"
#: the types a node without a list is taken to support (E1, legacy nodes)
LEGACY_WORKLOAD_TYPES = ("container", "compose")
#: an agent message kept on a status
MESSAGE_CHARS = 1024
#: how long drift detection waits for the projections to reach etcd's revision of the moment
#: the agents were listed (normally milliseconds)
DRIFT_FRESHNESS_WAIT_S = 5.0
#: actions whose own status write makes a separate state_mismatch alignment redundant
STATUS_WRITING = frozenset({SETTLE, REAPPLY, APPLY_STOPPED, COUNT_FAILURE, MARK_TERMINAL})

V = TypeVar("V")
T = TypeVar("T")


def policy_from(settings: Settings) -> RetryPolicy:
    """The retry/re-apply knobs of E5/E6 from the settings (the rest are the Go constants)."""
    return RetryPolicy(reapply_guard_s=settings.reapply_guard_s,
                       apply_timeout_s=settings.agent_apply_timeout_s,
                       vm_apply_timeout_s=settings.agent_vm_apply_timeout_s)


async def run_bounded(items: Iterable[T], limit: int,
                      body: Callable[[T], Awaitable[None]]) -> None:
    """``body(item)`` for every item, at most ``limit`` at once, in one task group.

    ``limit`` workers share one iterator (a task per worker, not per item: a cycle over 5,000
    nodes creates 64 tasks, not 5,000). ``body`` handles the failures it expects; anything else
    propagates and cancels the rest. The reconcile actions' body therefore turns every error of
    one workload into a failed action; a lost leadership stops a cycle by cancellation of the
    leader's tasks, and its writes by their fence.
    """
    pending = list(items)
    if not pending:
        return
    source = iter(pending)

    async def worker() -> None:
        for item in source:  # one event loop: each next() hands an item to exactly one worker
            await body(item)

    async with asyncio.TaskGroup() as tg:
        for _ in range(min(max(1, limit), len(pending))):
            tg.create_task(worker())


@dataclass(slots=True)
class CycleReport:
    """What one reconcile cycle did (returned to tests and the benchmark; also logged)."""

    skipped: str = ""
    drift: bool = False
    nodes_listed: int = 0
    unreachable: list[str] = field(default_factory=list)
    actions: dict[str, int] = field(default_factory=dict)
    succeeded: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    rpcs: Counter[str] = field(default_factory=Counter)
    drifts: list[DriftFinding] = field(default_factory=list)
    duration_s: float = 0.0
    #: wall seconds by phase (prefetch, plan, act): where a slow cycle spends its time
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class MonitorReport:
    skipped: str = ""
    lost: list[str] = field(default_factory=list)
    relocations: Counter[str] = field(default_factory=Counter)
    collected: list[str] = field(default_factory=list)
    #: lost nodes admitted for eviction by this run, and those still waiting
    evicted: tuple[str, ...] = ()
    evictions_waiting: int = 0
    disrupted: bool = False


class _Shell:
    """What every loop shares: the scheduler's parts, and the fenced node-status write."""

    def __init__(self, scheduler: SchedulerParts, evictions: EvictionGate) -> None:
        s = scheduler
        self.evictions = evictions
        self.settings = s.settings
        self.cluster = s.cluster
        self.committer = s.committer
        self.writer = s.writer
        self.agents = s.agents
        self.dispatcher = s.dispatcher
        self.workloads = s.workloads
        self.relocator = s.relocator
        self.leader = s.leader
        self.mode = s.mode
        self.metrics = s.metrics
        self.clock = s.clock
        self.layout = s.layout
        self.policy = policy_from(s.settings)
        self.concurrency = s.settings.reconcile_concurrency

    def _paused(self) -> str:
        if not self.leader.is_leader:
            return "not leader"
        if not self.mode.writable:
            return f"mode {self.mode.mode}"
        return ""

    def node_views(self) -> dict[str, NodeView]:
        """Every node of the projection with its liveness (O(nodes), in memory)."""
        alive = self.cluster.alive
        views: dict[str, NodeView] = {}
        for node_id, item in self.cluster.nodes.items.items():
            # a node written after the alive projection's revision may have a key it has not
            # seen yet: benefit of the doubt, never NotReady from a lagging projection
            live = alive.get(node_id) is not None or alive.revision < item.mod_revision
            views[node_id] = node_view(node_id, item.value, alive=live)
        return views

    def decide_evictions(self, views: Mapping[str, NodeView], now: datetime) -> EvictionDecision:
        """Ask the disruption guard which lost owned nodes may have their workloads moved."""
        owned = {n: v for n, v in views.items() if self.leader.owns(n)}
        by_node = self.cluster.workloads.by_node
        holding = [n for n in owned if by_node.get(n)]  # the gate keeps the unavailable
        decision = self.evictions.update(owned, holding, now=now.timestamp())
        self.metrics.node_evictions.inc(len(decision.newly))
        self.metrics.evictions_waiting.set(len(decision.waiting))
        self.metrics.evictions_held.set(1 if decision.disrupted else 0)
        return decision

    async def mark_not_ready(self, node_id: str, *, reason: str, source: str,
                             now: datetime) -> bool:
        """Ready/Active -> NotReady with a ``NodeLost`` event, fenced; True when it changed.

        Draining and Drained nodes keep their status (the operator's intent); a node already
        NotReady is not rewritten and gets no second NodeLost (E1).
        """
        stamp = rfc3339(now)
        # the monitor decides on a missing liveness key: a heartbeat that recreated it since
        # (the plan is seconds old when the last nodes' turn comes) cancels the decision
        lease_gone = source == "monitor"

        def mutate(node: Node) -> list[Event] | None:
            if node.status.lower() not in MONITORED_NODE_STATUSES:
                return None
            if lease_gone and self.cluster.alive.get(node_id) is not None:
                return None
            node.status = NOT_READY
            node.status_reason = reason
            node.status_updated_by = source
            node.status_updated_at = stamp
            return [Event(type="NodeLost", node_id=node_id, reason=reason, timestamp=now,
                          details={"status": NOT_READY, "source": source})]

        try:
            _, committed = await self.writer.update_node(
                node_id, mutate, kind=source, fenced=True,
                also_compare=[Compare.absent(self.layout.alive(node_id))] if lease_gone else ())
        except NotFound:
            return False
        except StoreError as exc:
            log.warning("node not marked NotReady node_id=%s: %s", node_id, exc)
            return False
        if committed is not None:
            log.warning("node NotReady node_id=%s source=%s reason=%r", node_id, source, reason)
        return committed is not None


# -- reconcile -----------------------------------------------------------------------------------


#: unassigned workloads planned between two checks of the time budget (each takes the full
#: decision, about 10 us)
PLAN_SLICE = 200
#: planning time after which the loop is given back to everything else
PLAN_YIELD_S = 0.01


def owned_by_node(index: WorkloadIndex, *, owns_node: Callable[[str], bool],
                  owns_unassigned: Callable[[str], bool]
                  ) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[int, int]], list[str]]:
    """``plan_by_node``'s inputs from the workload index: the owned nodes' workload ids, their
    stamps, and this shard's share of the unassigned workloads. Copies: the index moves on
    while the plan yields."""
    groups = {n: tuple(ids) for n, ids in index.by_node.items() if owns_node(n)}
    stamps = {n: index.stamp(n) for n in groups}
    unassigned = [w for w in index.unassigned if owns_unassigned(w)]
    return groups, stamps, unassigned


async def plan_by_node(specs: Mapping[str, WorkloadSpec], statuses: Mapping[str, WorkloadStatus],
                       *, groups: Mapping[str, Iterable[str]], unassigned: Sequence[str],
                       stamps: Mapping[str, tuple[int, int]], nodes: Mapping[str, NodeView],
                       observations: Mapping[str, NodeObservation], now: datetime,
                       policy: RetryPolicy, memo: SteadyNodes, exclude: Collection[str] = (),
                       evictable: Callable[[str], bool] | None = None) -> CyclePlan:
    """The cycle's plan, node by node, yielding to the event loop every ~10 ms of it.

    ``groups`` are the owned nodes' workload ids and ``unassigned`` this shard's share of the
    workloads on no node, both from the workload index, taken together with the ``specs`` and
    ``statuses`` snapshot and each node's ``stamps``. The answer is ``plan_cycle``'s (the same
    actions and steady workloads; tests hold it to that), but a node found entirely steady
    with the same stamp, view and listing as in the last cycle is answered from ``memo``
    without reading its workloads: in a steady 5,000-node fleet that is nearly every node.

    Why yield: planning 100,000 workloads in one call held the loop for most of a second, and
    every heartbeat, RPC and event delivery of the replica waited behind it. A time budget
    rather than a count keeps each hold near 10 ms both in the steady state and in a mass
    failover (where every workload takes the full decision). The inputs are this cycle's
    snapshot, so what is folded while the plan yields does not reach it.
    """
    actions: list[Action] = []
    steady: list[str] = []
    held_since = time.perf_counter()

    async def budget() -> None:
        nonlocal held_since
        if time.perf_counter() - held_since >= PLAN_YIELD_S:
            await asyncio.sleep(0)
            held_since = time.perf_counter()

    for start in range(0, len(unassigned), PLAN_SLICE):
        plan_unassigned(unassigned[start:start + PLAN_SLICE], specs, statuses, now=now,
                        policy=policy, exclude=exclude, actions=actions)
        await budget()
    remembered: dict[str, tuple[SteadyKey, tuple[str, ...]]] = {}
    for node, ids in groups.items():
        facts = node_facts(node, nodes, observations, evictable)
        available, listed, _, _ = facts
        view = nodes.get(node)
        key: SteadyKey | None = None
        if available and listed is not None and view is not None:
            key = (stamps[node], view, listed)
            known = memo.get(node, key)
            if known is not None:
                steady.extend(known if not exclude else
                              [w for w in known if w not in exclude])
                remembered[node] = (key, known)
                continue
        planned_before, steady_before = len(actions), len(steady)
        plan_node(node, ids, specs, statuses, facts, now=now, policy=policy, exclude=exclude,
                  actions=actions, steady=steady)
        if key is not None and len(actions) == planned_before and not exclude:
            remembered[node] = (key, tuple(steady[steady_before:]))
        await budget()
    memo.replace(remembered)
    return CyclePlan(tuple(actions), tuple(steady))


class ReconcileLoop(_Shell):
    """One reconcile cycle per tick; drift detection on the cycles that were asked for it."""

    name = "reconcile"

    def __init__(self, scheduler: SchedulerParts, evictions: EvictionGate) -> None:
        super().__init__(scheduler, evictions)
        self.interval_s = scheduler.settings.reconcile_interval_s
        self.dedup = DriftDeduper()
        self._lock = asyncio.Lock()
        self._drift_due = False
        #: the newest cycle's report (for the CLI, the benchmark and tests)
        self.last_report: CycleReport | None = None
        #: nodes found steady in the last cycle, and from what (see ``SteadyNodes``)
        self.steady_nodes = SteadyNodes()
        #: each node's last ListWorkloads answer: its bytes and what was decoded from them
        self._listings: dict[str, tuple[bytes, NodeObservation]] = {}

    def forget(self) -> None:
        """Drop what cycles remembered (on leadership loss).

        Why: a replica that stopped leading keeps no cycles, so the memo and the last answers
        (about 20 MB per 2,500 nodes) would only wait for a next term, in which the shard's
        nodes may have changed anyway. Both are caches: an empty one costs one full cycle.
        """
        self.steady_nodes.replace({})
        self._listings = {}

    def time_bound_s(self) -> float:
        """The bound on one cycle: 0.8 x interval, or more when the fleet needs it.

        A cycle is at most a few waves of RPCs: ``ceil(nodes / concurrency)`` waves of
        ListWorkloads, then applies and deletes, each wave bounded by its RPC deadline. At
        5,000 nodes and concurrency 64 a cycle whose agents all time out needs 79 waves, far
        more than 0.8 x 5 s; cutting it there would starve the last nodes forever. So the
        bound is ``max(0.8 x interval, 60 s, 3 x waves x agent RPC timeout)``: generous,
        but still finite, and later ticks are skipped (coalesced) while a cycle runs.
        """
        waves = math.ceil(max(1, len(self.cluster.nodes.items)) / max(1, self.concurrency))
        return max(BODY_SHARE * self.interval_s, 60.0,
                   3 * waves * self.settings.agent_rpc_timeout_s)

    async def __call__(self) -> None:
        try:
            async with asyncio.timeout(self.time_bound_s()):
                await self.run_once()
        except TimeoutError:
            log.warning("reconcile cycle exceeded its bound of %.1fs; cut short",
                        self.time_bound_s())

    async def run_once(self, *, now: datetime | None = None,
                       drift: bool = False) -> CycleReport:
        """Run one cycle now, or report why not (not leader, mode, overlap).

        ``now`` is injectable (tests drive retry schedules with it); ``drift`` asks for drift
        detection on this cycle, or on the next one if a cycle is already running.
        """
        if drift:
            self._drift_due = True
        paused = self._paused()
        if paused:
            return CycleReport(skipped=paused)
        if self._lock.locked():
            return CycleReport(skipped="overlap")
        async with self._lock:
            started = time.perf_counter()
            report = CycleReport(drift=self._drift_due)
            self._drift_due = False
            ok = False
            try:
                await self._cycle(report, now or self.clock.now())
                ok = True
            finally:
                report.duration_s = time.perf_counter() - started
                self.metrics.observe_reconcile_cycle(report.duration_s, ok=ok)
                self.last_report = report
            if report.unreachable or report.failed or report.drifts:
                log.info("reconcile cycle nodes=%d rpcs=%s actions=%s failed=%s drifts=%d "
                         "duration=%.3fs", report.nodes_listed, dict(report.rpcs),
                         report.actions, dict(report.failed), len(report.drifts),
                         report.duration_s)
            return report

    # -- the cycle ---------------------------------------------------------------------------
    async def _cycle(self, report: CycleReport, now: datetime) -> None:
        started = time.perf_counter()
        views = self.node_views()
        targets = [v for v in views.values() if v.available and self.leader.owns(v.node_id)]
        observations = await self._prefetch(targets, report)
        # read after the listing: what an agent listed was committed before it was listed, so
        # projections at this revision know it (one read before the listing missed workloads
        # created by another replica while this cycle listed, and deleted them as orphans)
        drift_at = await self._drift_revision() if report.drift else None
        if drift_at is not None:
            report.drift = await self._caught_up_for_drift(drift_at)
        elif report.drift:
            report.drift = False
        planning = time.perf_counter()
        report.nodes_listed = len(targets)
        report.unreachable = sorted(n for n, o in observations.items() if o.unreachable)

        async def lost(node_id: str) -> None:
            # E1: an unreachable agent marks its node NotReady; its workloads fail over below
            await self.mark_not_ready(node_id, now=now, source="reconciler",
                                      reason=f"agent unreachable: {observations[node_id].error}")
            old = views[node_id]
            views[node_id] = NodeView(node_id, old.exists, NOT_READY, old.alive, old.endpoint)

        await run_bounded(report.unreachable, self.concurrency, lost)
        self.decide_evictions(views, now)
        # plain dicts, copied in C: every lookup of the plan is a dict lookup (a Mapping
        # wrapper cost a Python call per lookup, hundreds of thousands per cycle), and the
        # watch batches folded while the plan yields do not reach this cycle's inputs
        specs = self.cluster.specs.snapshot()
        statuses = self.cluster.statuses.snapshot()
        # the index, read together with the snapshot (no await in between), so it agrees with it
        groups, stamps, unassigned = owned_by_node(
            self.cluster.workloads, owns_node=self.leader.owns,
            owns_unassigned=lambda wid: owns_workload(
                wid, shard_count=self.settings.shard_count if self.settings.active_active else 1,
                shard_index=self.settings.shard_index))
        findings: list[DriftFinding] = []
        if report.drift:
            expected = {n: self.cluster.workload_ids_on(n) for n in observations}
            findings = classify_drift(specs, statuses, expected=expected, nodes=views,
                                      observations=observations, now=now, policy=self.policy)
            report.drifts = findings
        adopted = {f.workload_id for f in findings if f.action in ADOPT_ACTIONS}
        plan = await plan_by_node(
            specs, statuses, groups=groups, unassigned=unassigned, stamps=stamps, nodes=views,
            observations=observations, now=now, policy=self.policy, memo=self.steady_nodes,
            exclude=adopted, evictable=lambda node_id: self.evictions.allows(node_id, views))
        report.actions = plan.counts()
        acting = time.perf_counter()
        results = await self._execute(plan, views, report, now)
        if findings:
            await self._remediate(findings, results, views, report, now)
        report.phases = {"prefetch": planning - started, "plan": acting - planning,
                         "act": time.perf_counter() - acting}
        for phase, seconds in report.phases.items():
            self.metrics.reconcile_phase_seconds.labels(phase).inc(seconds)

    async def _drift_revision(self) -> int | None:
        """etcd's revision once the agents were listed; None (no drift this cycle) if etcd
        does not answer."""
        try:
            return await self.committer.etcd.current_revision()
        except StoreError as exc:
            log.warning("drift detection skipped this cycle: etcd revision unknown: %s", exc)
            return None

    async def _caught_up_for_drift(self, revision: int) -> bool:
        """Whether the projections show etcd as it was once the agents were listed.

        Drift compares what agents run with what etcd says; a projection frozen behind (a
        watch reconnecting, a re-list after compaction) would call a workload another replica
        just created an orphan, and delete it from its agent.
        """
        try:
            await self.cluster.wait_for(revision, timeout=DRIFT_FRESHNESS_WAIT_S)
        except StoreError as exc:
            log.warning("drift detection skipped this cycle: the projections are behind "
                        "etcd: %s", exc)
            return False
        return True

    async def _prefetch(self, targets: list[NodeView],
                        report: CycleReport) -> dict[str, NodeObservation]:
        """One ListWorkloads per target; an answer equal to the node's last one (byte for byte)
        is not decoded again: its observation is the last one, the same object, which also
        lets the steady-node memo recognise it at once."""
        observations: dict[str, NodeObservation] = {}
        last = self._listings
        listings: dict[str, tuple[bytes, NodeObservation]] = {}

        async def one(view: NodeView) -> None:
            node_id = view.node_id
            report.rpcs["ListWorkloads"] += 1
            try:
                raw = await self.agents.list_workloads_raw(node_id, view.endpoint,
                                                           leader_only=True)
            except AgentError as exc:
                observations[node_id] = NodeObservation(
                    node_id, ok=False, unreachable=exc.unreachable, error=str(exc))
                return
            known = last.get(node_id)
            if known is not None and known[0] == raw:
                obs = known[1]
            else:
                try:
                    resp = agent_pb2.ListWorkloadsResponse.FromString(raw)
                except DecodeError as exc:
                    observations[node_id] = NodeObservation(
                        node_id, ok=False, error=f"ListWorkloads: undecodable answer: {exc}")
                    return
                obs = NodeObservation(node_id, ok=True,
                                      workloads=observed_from_agent(resp.workloads))
            observations[node_id] = obs
            listings[node_id] = (raw, obs)

        try:
            await run_bounded(targets, self.concurrency, one)
        finally:
            self._listings = listings  # only this cycle's answers: bounded by the owned nodes
        return observations

    async def _execute(self, plan: CyclePlan, views: Mapping[str, NodeView],
                       report: CycleReport, now: datetime) -> dict[str, tuple[str, bool, str]]:
        results: dict[str, tuple[str, bool, str]] = {}
        idle: Counter[str] = Counter(a.kind for a in plan.actions if not (a.rpc or a.writes))
        if plan.steady:
            idle[NOOP] += len(plan.steady)
        for kind, count in idle.items():
            self.metrics.reconciliation_results.labels(kind, "true").inc(count)

        async def one(action: Action) -> None:
            ok = await self._act(action, views, report, now)
            results[action.workload_id] = (action.kind, ok, action.node_id)
            (report.succeeded if ok else report.failed)[action.kind] += 1
            self.metrics.reconciliation_results.labels(action.kind, str(ok).lower()).inc()

        await run_bounded(plan.needing_io(), self.concurrency, one)
        return results

    async def _act(self, action: Action, views: Mapping[str, NodeView], report: CycleReport,
                   now: datetime) -> bool:
        kind = action.kind
        try:
            if kind == FINALIZE:
                await self.dispatcher.finalize(action.workload_id, fenced=True)
                return True
            if kind == DELETE:
                return await self._delete(action.workload_id, action.node_id, views, report,
                                          finalize=True)
            if kind == PLACE:
                return await self._place(action.workload_id, now)
            if kind == FAILOVER:
                return await self._failover(action, now)
            if kind in (REAPPLY, APPLY_STOPPED):
                return await self._apply(action, views, report, now)
            if kind == COUNT_FAILURE:
                return await self.count_failure(action.workload_id, action.node_id,
                                                reason=action.reason, now=now, once=True,
                                                reported=dict(action.reported),
                                                revision=action.revision)
            if kind == SETTLE:
                return await self._settle(action, now)
            if kind == MARK_TERMINAL:
                return await self._mark_terminal(action, now)
            if kind == RECORD_REPORT:
                return await self._record_report(action)
        except NotFound:
            return True
        except StoreError as exc:
            log.warning("reconcile %s failed workload_id=%s: %s", kind, action.workload_id, exc)
            return False
        except Exception:
            # one workload's unexpected failure (a bug, a record of an unforeseen shape) must
            # not cancel the other actions of this cycle, and of every cycle after it
            log.exception("reconcile %s failed unexpectedly workload_id=%s", kind,
                          action.workload_id)
            return False
        log.error("reconcile: no executor for action %s", kind)
        return False

    # -- executors ---------------------------------------------------------------------------
    async def _delete(self, workload_id: str, node_id: str, views: Mapping[str, NodeView],
                      report: CycleReport, *, finalize: bool) -> bool:
        view = views.get(node_id)
        if view is None or not view.endpoint:
            return False
        report.rpcs["DeleteWorkload"] += 1
        try:
            answer = await self.agents.delete(node_id, view.endpoint, workload_id,
                                              leader_only=True)
            if refused(answer):
                log.info("agent refused the delete workload_id=%s node_id=%s: %s", workload_id,
                         node_id, answer.message)
                return False
        except AgentError as exc:
            if not exc.not_found:
                log.info("agent delete failed workload_id=%s node_id=%s: %s", workload_id,
                         node_id, exc)
                return False
        if finalize:
            await self.dispatcher.finalize(workload_id, fenced=True)
        return True

    async def _place(self, workload_id: str, now: datetime) -> bool:
        c = self.workloads

        async def attempt(n: int) -> bool:
            spec_item = self.cluster.specs.get(workload_id)
            status_item = self.cluster.statuses.get(workload_id)
            if spec_item is None or status_item is None or node_of(status_item.value):
                return False
            spec = spec_item.value
            if normalize_desired_state(spec.desired_state) == "Deleted":
                return False
            status = copy_record(status_item.value)
            # its local disks pin it to their node, and its disks follow it; read before
            # deciding: no await between the decision and its reservation
            disks, pin = await self.relocator.disks_for_placement(spec, workload_id)
            if pin is None:
                log.debug("reconcile: workload_id=%s has local disks on different nodes",
                          workload_id)
                return False
            placed = c._place(spec, status, only=pin)
            if isinstance(placed, Outcome):
                log.debug("reconcile: no node fits workload_id=%s: %s", workload_id,
                          placed.message)
                return False
            mark_apply_requested(placed.status, spec, rfc3339(now))
            change = placed.change
            change.kind = "reconcile"
            disk_compares, disk_puts = self.relocator.move_disks(
                disks, workload_id, from_node=str(status.metadata.get("previous_node") or ""),
                to_node=placed.node_id)
            change.compares.extend(disk_compares)
            change.puts.extend(disk_puts)
            change.compares.append(Compare.mod(self.layout.status(workload_id),
                                               status_item.mod_revision))
            change.puts.append(Put(self.layout.status(workload_id), encode(placed.status),
                                   category="status"))
            change.events.append(Event(
                type="WorkloadScheduled", workload_id=workload_id, node_id=placed.node_id,
                reason=placed.reason, details={"revision_id": spec.revision_id}, timestamp=now))
            cpu_m, mem_mb = request_of(spec)
            c.placer.reserve(workload_id, placed.node_id, cpu_m, mem_mb)
            try:
                committed = await self.committer.commit(change, fenced=True)
            except Conflict as exc:
                c.placer.release(workload_id)
                await c._catch_up(exc)
                raise
            except BaseException:
                # etcd unavailable, a timeout, the cycle cancelled at a lost leadership: as
                # ApplyWorkload's and the relocator's placements, never leave the hold behind
                # (a commit that did land shows in the allocation, which counts it)
                c.placer.release(workload_id)
                raise
            # a failed apply is recorded on the status record: let this replica's projection
            # show the placement first, or that record would find nothing to update
            await self.cluster.wait_for(committed.revision, which=("statuses",))
            self.dispatcher.apply(spec, placed.status.metadata, placed.node_id,
                                  spec.desired_state, after=committed.revision,
                                  leader_only=True)
            return True

        return await retry_on_conflict(attempt)

    async def _failover(self, action: Action, now: datetime) -> bool:
        outcome = await self.relocator.relocate(action.workload_id, from_node=action.node_id,
                                                event_type="Rescheduled", fenced=True)
        if outcome == "no-target":
            # E1 AwaitFailover: wait under the retry budget, so attempts back off and end Failed
            await self.count_failure(action.workload_id, action.node_id,
                                     reason=f"no failover target: node {action.node_id} "
                                            "unavailable", now=now, once=False)
            return False
        return True

    async def _apply(self, action: Action, views: Mapping[str, NodeView], report: CycleReport,
                     now: datetime) -> bool:
        wid, node_id = action.workload_id, action.node_id
        spec_item = self.cluster.specs.get(wid)
        status_item = self.cluster.statuses.get(wid)
        view = views.get(node_id)
        if spec_item is None or status_item is None or view is None:
            return False
        spec = spec_item.value
        if node_of(status_item.value) != node_id or being_deleted(spec, status_item.value):
            # the plan is older than this moment: a delete committed since (by any replica)
            # must not be undone by the apply the plan asked for
            return False
        desired = STOPPED if action.kind == APPLY_STOPPED else "Running"
        if normalize_desired_state(spec.desired_state) != desired:
            # the desired state changed since the plan (a stop after a planned re-apply): its
            # own apply is on its way, and this one would undo it
            return False
        try:
            request = agent_apply_request(spec, status_item.value.metadata, desired)
        except CONVERSION_ERRORS as exc:  # a spec stored before ApplyWorkload checked it
            await self.count_failure(wid, node_id, reason=f"spec cannot be sent: {exc!r}",
                                     now=now, once=False)
            return False
        timeout = (self.settings.agent_vm_apply_timeout_s if is_vm(spec.type)
                   else self.settings.agent_apply_timeout_s)
        report.rpcs["ApplyWorkload"] += 1
        try:
            resp = await self.agents.apply(node_id, view.endpoint, request, timeout=timeout,
                                           leader_only=True)
        except AgentError as exc:
            if exc.unreachable:
                await self.mark_not_ready(node_id, reason=f"agent unreachable: {exc}",
                                          source="reconciler", now=now)
            elif RUNTIME_MISSING in str(exc).lower():
                return await self._runtime_unsupported(wid, node_id, str(exc), now)
            await self.count_failure(wid, node_id, reason=f"apply failed: {exc}", now=now,
                                     once=False)
            return False
        if not resp.applied and not resp.skipped:
            if RUNTIME_MISSING in (resp.message or "").lower():
                return await self._runtime_unsupported(wid, node_id, resp.message, now)
            await self.count_failure(wid, node_id, reason=resp.message or "apply not accepted",
                                     now=now, once=False)
            return False
        agent_meta = agent_metadata(resp.status.metadata)
        state = {1: "Pending", 2: "Running", 3: "Stopped", 4: "Failed"}.get(
            int(resp.status.actual_state), "Pending")
        stamp = rfc3339(now)
        revision = request.revision_id

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_of(status) != node_id or status.status in DELETING_STATUSES:
                return None
            current = self.cluster.specs.get(wid)
            if current is None or (current.value.revision_id
                                   or compute_revision(current.value)) != revision or (
                    normalize_desired_state(current.value.desired_state) != desired):
                return None  # superseded while the call ran: the newer change's record stands
            meta = status.metadata
            merge_metadata(meta, metadata_news(agent_meta, meta, failed=state == "Failed"))
            if action.kind == REAPPLY:
                meta.update(after_reapply(ReapplyState.read(meta), revision_id=revision,
                                          workload_type=spec.type, now=now, policy=self.policy))
            else:
                meta[LAST_APPLY_AT] = stamp
                meta[LAST_APPLY_REVISION] = revision
                meta.pop(REAPPLY_ATTEMPTS, None)
                meta.pop(REAPPLY_NEXT_AT, None)
            meta["last_action"] = action.kind
            status.retry.next_retry_at = ""
            status.status = state
            status.status_info.actual_state = state
            status.status_info.last_updated = stamp
            return [Event(type="WorkloadScheduled", workload_id=wid, node_id=node_id,
                          reason=action.kind, timestamp=now,
                          details={"revision_id": revision, "desired_state": desired})]

        await self.writer.update_status(wid, mutate, kind="reconcile", fenced=True)
        return True

    async def _runtime_unsupported(self, workload_id: str, node_id: str, message: str,
                                   now: datetime) -> bool:
        """E1 "runtime unsupported": the node cannot run this type after all. Its type is
        taken off the node (so placement stops choosing it) and the workload is unassigned,
        Pending, its allocation released, in one fenced transaction; the next cycle places it
        elsewhere. Returns False: nothing runs yet."""

        async def attempt(n: int) -> bool:
            spec_item = self.cluster.specs.get(workload_id)
            status_item = self.cluster.statuses.get(workload_id)
            node_item = self.cluster.nodes.get(node_id)
            if spec_item is None or status_item is None or node_item is None:
                return False
            if node_of(status_item.value) != node_id:
                return False
            wtype = canonical_type(spec_item.value.type)
            node = copy_record(node_item.value)
            offered = node.supported_workload_types or list(LEGACY_WORKLOAD_TYPES)
            node.supported_workload_types = [t for t in offered if canonical_type(t) != wtype]
            status = copy_record(status_item.value)
            status.node_id = ""
            status.assigned_node = ""
            status.status = "Pending"
            status.status_info.actual_state = "Pending"
            status.status_info.last_updated = rfc3339(now)
            for key in REAPPLY_KEYS:
                status.metadata.pop(key, None)
            status.metadata["previous_node"] = node_id
            status.metadata["last_action"] = "RuntimeUnsupportedReschedulePending"
            status.metadata["scheduler_last_error"] = message[:MESSAGE_CHARS]
            change = Change(
                kind="reconcile",
                compares=[Compare.mod(self.layout.node(node_id), node_item.mod_revision),
                          Compare.mod(self.layout.status(workload_id), status_item.mod_revision)],
                puts=[Put(self.layout.node(node_id), encode(node), category="node"),
                      Put(self.layout.status(workload_id), encode(status), category="status")],
                deletes=[Delete(self.layout.assignment(workload_id), category="assignment")],
                events=[Event(type="Rescheduled", workload_id=workload_id, node_id=node_id,
                              reason=f"runtime {wtype} not available on {node_id}",
                              details={"previous_node": node_id}, timestamp=now)])
            release_allocation(change, self.cluster, self.layout, node_id, workload_id)
            try:
                await self.committer.commit(change, fenced=True)
            except Conflict as exc:
                if exc.revision:
                    await self.cluster.wait_for(exc.revision, timeout=2.0)
                raise
            log.warning("runtime %s not available on node_id=%s: workload_id=%s unassigned to "
                        "be placed elsewhere", wtype, node_id, workload_id)
            return False

        try:
            return await retry_on_conflict(attempt)
        except (Conflict, StoreError) as exc:
            log.info("runtime-unsupported reschedule not recorded workload_id=%s: %s",
                     workload_id, exc)
            return False

    async def count_failure(self, workload_id: str, node_id: str, *, reason: str, now: datetime,
                            once: bool, reported: Mapping[str, str | None] | None = None,
                            revision: str | None = None) -> bool:
        """Charge one failure to the retry budget (E6), fenced. ``once``: only if the latest
        apply's failure was not counted yet (an observed Failed is seen by many cycles).
        ``reported``: the agent's metadata news, merged in the same write. ``revision``: the
        spec revision the failure was observed for (nothing is charged to a newer one)."""

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_id and node_of(status) != node_id:
                return None
            if revision is not None and not self._spec_unchanged(workload_id, revision):
                return None
            if once and failure_counted(status):
                return None
            merge_metadata(status.metadata, reported or {})
            outcome = decide_failure(status, reason=reason, now=now, policy=self.policy,
                                     workload_id=workload_id, node_id=node_id)
            apply_failure(status, outcome, now=now)
            return [outcome.event]

        await self.writer.update_status(workload_id, mutate, kind="retry", fenced=True)
        return True

    def _spec_unchanged(self, workload_id: str, revision: str) -> bool:
        """The spec is still at ``revision`` and not being deleted. Read inside a status
        mutation: an update or a delete writes the status in the same transaction as the spec,
        so the projections show both or neither when the status is read fresh."""
        item = self.cluster.specs.get(workload_id)
        return (item is not None and item.value.revision_id == revision
                and normalize_desired_state(item.value.desired_state) != "Deleted")

    async def _settle(self, action: Action, now: datetime) -> bool:
        actual = action.observed or "Running"

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_of(status) != action.node_id:
                return None
            if not self._spec_unchanged(action.workload_id, action.revision):
                return None  # updated or deleted since the listing: the report is stale
            merged = merge_metadata(status.metadata, dict(action.reported))
            return [] if apply_success(status, actual=actual, now=now) or merged else None

        await self.writer.update_status(action.workload_id, mutate, kind="reconcile",
                                        fenced=True)
        return True

    async def _mark_terminal(self, action: Action, now: datetime) -> bool:
        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if action.reported and node_of(status) != action.node_id:
                return None  # moved since the plan: the report was about the old copy
            if not self._spec_unchanged(action.workload_id, action.revision):
                return None  # updated or deleted since the plan: decided for the old spec
            merged = merge_metadata(status.metadata, dict(action.reported))
            if status.status == "Failed" and not merged:
                return None
            status.status = "Failed"
            status.status_info.actual_state = "Failed"
            status.status_info.last_updated = rfc3339(now)
            status.metadata["last_action"] = "TerminalFailureNoReapply"
            status.metadata["terminal_failure_reason"] = action.reason
            for key in REAPPLY_KEYS:
                status.metadata.pop(key, None)
            return []

        await self.writer.update_status(action.workload_id, mutate, kind="reconcile",
                                        fenced=True)
        return True

    async def _record_report(self, action: Action) -> bool:
        """Merge the agent's metadata news into the status (E4), and nothing else."""

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_of(status) != action.node_id:
                return None
            if not self._spec_unchanged(action.workload_id, action.revision):
                return None
            return [] if merge_metadata(status.metadata, dict(action.reported)) else None

        await self.writer.update_status(action.workload_id, mutate, kind="reconcile",
                                        fenced=True)
        return True

    # -- drift -------------------------------------------------------------------------------
    async def _remediate(self, findings: list[DriftFinding],
                         results: Mapping[str, tuple[str, bool, str]],
                         views: Mapping[str, NodeView], report: CycleReport,
                         now: datetime) -> None:
        """Carry out each finding (or credit the reconcile action that already did), then
        record the admitted ones: DriftRecord + DriftDetected, batched, fenced."""
        outcomes: dict[tuple[str, str, str, str], tuple[bool, str, bool]] = {}

        async def one(f: DriftFinding) -> None:
            recorded = False
            error = ""
            try:
                if f.action in ADOPT_ACTIONS:
                    ok, recorded = await self._adopt(f, now)
                elif f.action in DELETE_ON_AGENT_ACTIONS or (
                        f.action == DELETE_RESIDUAL
                        and results.get(f.workload_id, ("", False, ""))[2] != f.node_id):
                    ok = await self._delete(f.workload_id, f.node_id, views, report,
                                            finalize=False)
                elif f.action == ALIGN_STATUS:
                    ok = await self._align(f, results, now)
                else:
                    kind_ok = results.get(f.workload_id)
                    ok = kind_ok is not None and kind_ok[1]
                    if kind_ok is None:
                        error = "no remediation this cycle"
            except NotFound:
                ok = True
            except StoreError as exc:
                ok, error = False, str(exc)
            outcomes[f.key] = (ok, error, recorded)

        await run_bounded(findings, self.concurrency, one)
        pending: list[Change] = []
        for f in findings:
            ok, error, recorded = outcomes.get(f.key, (False, "not run", False))
            if recorded:
                continue
            admitted = self.dedup.admit(f.key, now)
            # a delete done on the agent clears the record even when its event is de-duplicated
            # (an earlier failed attempt may have written it)
            if admitted or (ok and f.action in CLEARED_WHEN_DONE):
                pending.append(self._drift_change(f, ok=ok, error=error, now=now,
                                                  event=admitted))
        for start in range(0, len(pending), DRIFT_BATCH):
            batch = Change(kind="drift")
            for change in pending[start:start + DRIFT_BATCH]:
                batch.merge(change)
            try:
                await self.committer.commit(batch, fenced=True)
            except StoreError as exc:
                log.warning("drift records not stored (%d): %s", len(batch.puts), exc)

    def _drift_change(self, f: DriftFinding, *, ok: bool, error: str, now: datetime,
                      event: bool = True) -> Change:
        """The DriftRecord and DriftDetected of a finding (E7), with two exceptions that keep
        etcd bounded whatever an agent lists: a delete done on the agent clears its record
        (as Go's verified orphan delete did), and an orphan whose id the scheduler does not
        know gets its event but no record (the id is the agent's word only)."""
        key = self.layout.drift(f.node_id, f.workload_id, f.drift_type)
        events = [Event(type="DriftDetected", workload_id=f.workload_id, node_id=f.node_id,
                        reason=f.drift_type, timestamp=now, details={
                            "scheduler_status": f.scheduler_status,
                            "agent_status": f.agent_status, "action": f.action,
                            "resolved": str(ok).lower(), "last_error": error})] if event else []
        if ok and f.action in CLEARED_WHEN_DONE:
            return Change(kind="drift", deletes=[Delete(key, category="drift")], events=events)
        if f.action == DELETE_ORPHAN:
            return Change(kind="drift", events=events)
        record = {
            "nodeId": f.node_id, "workloadId": f.workload_id, "driftType": f.drift_type,
            "detectedAt": rfc3339(now), "schedulerStatus": f.scheduler_status,
            "agentStatus": f.agent_status, "action": f.action, "resolved": ok,
            "lastError": error,
        }
        return Change(
            kind="drift",
            puts=[Put(key, json.dumps(record, separators=(",", ":")).encode(), category="drift")],
            events=events)

    async def _align(self, f: DriftFinding, results: Mapping[str, tuple[str, bool, str]],
                     now: datetime) -> bool:
        done = results.get(f.workload_id)
        if done is not None and done[0] in STATUS_WRITING:
            return done[1]
        state = f.agent_status
        stamp = rfc3339(now)

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if node_of(status) != f.node_id or status.status not in COMPARABLE_STATUSES:
                return None
            if status.status == state:
                return None
            status.status = state
            status.status_info.actual_state = state
            status.status_info.last_updated = stamp
            status.metadata["drift_reason"] = f.drift_type
            status.metadata["drift_reconciled_at"] = stamp
            return []

        await self.writer.update_status(f.workload_id, mutate, kind="drift", fenced=True)
        return True

    async def _adopt(self, f: DriftFinding, now: datetime) -> tuple[bool, bool]:
        """Re-bind a workload to the node that runs it (status, assignment, both allocations
        and, when admitted, the drift record + event: one transaction). Returns (ok, recorded).
        """
        wid, new = f.workload_id, f.node_id
        stamp = rfc3339(now)
        admitted = self.dedup.admit(f.key, now)

        async def attempt(n: int) -> tuple[bool, bool]:
            spec_item = self.cluster.specs.get(wid)
            status_item = self.cluster.statuses.get(wid)
            if spec_item is None or status_item is None:
                return False, False
            status = copy_record(status_item.value)
            old = node_of(status)
            if old != f.previous_node:
                return False, False  # someone moved it meanwhile
            status.node_id = new
            status.assigned_node = new
            if f.agent_status in COMPARABLE_STATUSES:
                status.status = f.agent_status
                status.status_info.actual_state = f.agent_status
            status.status_info.last_updated = stamp
            status.metadata["last_action"] = "DriftRemediatedOrphan"
            status.metadata["drift_reason"] = f.action
            status.metadata["drift_reconciled_at"] = stamp
            if old and old != new:
                status.metadata["previous_node"] = old
            change = Change(kind="drift", compares=[
                Compare.mod(self.layout.status(wid), status_item.mod_revision)], puts=[
                Put(self.layout.status(wid), encode(status), category="status"),
                Put(self.layout.assignment(wid), encode(Assignment(
                    workload_id=wid, node_id=new, reason=f.action, created_at=stamp)),
                    category="assignment")])
            cpu_m, mem_mb = request_of(spec_item.value)
            moves = [(new, True)] + ([(old, False)] if old and old != new else [])
            for node_id, add in moves:
                # the workload runs here: its allocation follows reality, without a fit check
                item = self.cluster.allocations.get(node_id)
                record = item.value.clone() if item else Allocation(node_id=node_id)
                record.node_id = node_id
                if add:
                    record.add(wid, cpu_m, mem_mb)
                elif not record.remove(wid):
                    continue
                change.compares.append(Compare.mod(self.layout.allocation(node_id),
                                                   item.mod_revision if item else 0))
                change.puts.append(Put(self.layout.allocation(node_id), encode(record),
                                       category="allocation"))
            if admitted:
                change.merge(self._drift_change(f, ok=True, error="", now=now))
            try:
                await self.committer.commit(change, fenced=True)
            except Conflict as exc:
                if exc.revision:
                    await self.cluster.wait_for(exc.revision,
                                                which=("statuses", "allocations", "specs"))
                raise
            log.warning("drift: workload adopted workload_id=%s from=%s to=%s action=%s", wid,
                        old or "-", new, f.action)
            return True, admitted

        return await retry_on_conflict(attempt)


class DriftTrigger:
    """The drift loop's body: ask for drift detection on the reconcile cycle's prefetch."""

    name = "drift"

    def __init__(self, reconcile: ReconcileLoop, interval_s: float) -> None:
        self.reconcile = reconcile
        self.interval_s = interval_s

    async def __call__(self) -> None:
        try:
            async with asyncio.timeout(max(self.reconcile.time_bound_s(),
                                           BODY_SHARE * self.interval_s)):
                await self.reconcile.run_once(drift=True)
        except TimeoutError:
            log.warning("drift cycle cut short")


# -- node monitor ----------------------------------------------------------------------------


class NodeMonitor(_Shell):
    """Liveness -> NotReady + failover; long NotReady -> removal (E1, ARCHITECTURE 4)."""

    name = "node-monitor"

    def __init__(self, scheduler: SchedulerParts, interval_s: float,
                 evictions: EvictionGate) -> None:
        super().__init__(scheduler, evictions)
        self.interval_s = interval_s
        self._lock = asyncio.Lock()

    async def __call__(self) -> None:
        try:
            async with asyncio.timeout(BODY_SHARE * self.interval_s):
                await self.run_once()
        except TimeoutError:
            log.warning("node monitor exceeded %.1fs; the next tick continues",
                        BODY_SHARE * self.interval_s)

    def checks(self) -> list[NodeCheck]:
        alive = self.cluster.alive
        out: list[NodeCheck] = []
        for node_id, item in self.cluster.nodes.items.items():
            if not self.leader.owns(node_id):
                continue
            gone = alive.get(node_id) is None and alive.revision >= item.mod_revision
            out.append(NodeCheck(node_id, item.value.status, gone, item.value.status_updated_at))
        return out

    async def run_once(self, *, now: datetime | None = None) -> MonitorReport:
        paused = self._paused()
        if paused:
            return MonitorReport(skipped=paused)
        if self._lock.locked():
            return MonitorReport(skipped="overlap")
        async with self._lock:
            when = now or self.clock.now()
            report = MonitorReport()
            plan = plan_node_monitor(self.checks(), now=when,
                                     gc_after_s=self.settings.node_gc_after_s)
            ttl = self.settings.node_lease_ttl_s

            async def lose(node_id: str) -> None:
                changed = await self.mark_not_ready(
                    node_id, reason=f"liveness lease expired (no heartbeat for {ttl}s)",
                    source="monitor", now=when)
                if changed:
                    report.lost.append(node_id)

            await run_bounded(plan.lost, self.concurrency, lose)
            decision = self.decide_evictions(self.node_views(), when)
            report.evicted = decision.newly
            report.evictions_waiting = len(decision.waiting)
            report.disrupted = decision.disrupted
            await run_bounded(decision.newly, self.concurrency,
                              lambda node_id: self._relocate_all(node_id, report))
            for node_id in plan.collect:
                if await self._collect(node_id, when):
                    report.collected.append(node_id)
            return report

    async def _relocate_all(self, node_id: str, report: MonitorReport) -> None:
        async def move(workload_id: str) -> None:
            try:
                outcome = await self.relocator.relocate(workload_id, from_node=node_id,
                                                        event_type="Rescheduled", fenced=True)
            except StoreError as exc:
                log.warning("failover of workload_id=%s from node_id=%s failed: %s "
                            "(reconcile retries)", workload_id, node_id, exc)
                outcome = "error"
            report.relocations[outcome] += 1

        await run_bounded(sorted(self.cluster.workload_ids_on(node_id)), self.concurrency, move)

    async def _collect(self, node_id: str, now: datetime) -> bool:
        """Remove a long-NotReady node: its records, its empty allocation, its DNS record."""
        item = self.cluster.nodes.get(node_id)
        if item is None or item.value.status != NOT_READY or self.cluster.alive.get(node_id):
            return False
        # the record lives under the shard key of the replica the node registered through
        shards = {item.value.labels.get("scheduler_shard") or self.settings.shard_key,
                  self.settings.shard_key}
        change = Change(
            kind="monitor",
            # a heartbeat since the plan recreated the liveness key: the node is back
            compares=[Compare.mod(self.layout.node(node_id), item.mod_revision),
                      Compare.absent(self.layout.alive(node_id))],
            deletes=[Delete(self.layout.node(node_id), category="node"),
                     Delete(self.layout.node_status(node_id), category="node"),
                     *(Delete(self.layout.skydns(self.settings.agents_discovery_domain,
                                                 shard, node_id), category="dns")
                       for shard in sorted(shards))],
            events=[Event(type="NodeLeft", node_id=node_id, timestamp=now,
                          reason=f"NotReady for longer than {self.settings.node_gc_after_s:.0f}s",
                          details={"status": "Removed"})])
        alloc = self.cluster.allocations.get(node_id)
        if alloc is not None and not alloc.value.workloads:
            change.compares.append(Compare.mod(self.layout.allocation(node_id),
                                               alloc.mod_revision))
            change.deletes.append(Delete(self.layout.allocation(node_id), category="allocation"))
        try:
            await self.committer.commit(change, fenced=True)
        except StoreError as exc:
            log.info("node not removed node_id=%s: %s", node_id, exc)
            return False
        await self.agents.forget(node_id)
        log.warning("node removed node_id=%s", node_id)
        return True


# -- registration ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RegisteredLoops:
    reconcile: ReconcileLoop
    monitor: NodeMonitor
    drift: DriftTrigger | None


def monitor_interval_s(settings: Settings) -> float:
    """min(5 s, node lease TTL / 2): the monitor only reads projections, so it is cheap."""
    return min(5.0, settings.node_lease_ttl_s / 2)


def register_loops(scheduler: SchedulerParts) -> None:
    """Build the leader-only loops and register them with the scheduler's ``LeaderGate``."""
    settings = scheduler.settings
    evictions = EvictionGate(EvictionPolicy(
        rate_per_s=settings.node_eviction_rate, burst=settings.node_eviction_burst,
        unhealthy_threshold=settings.unhealthy_node_threshold))
    reconcile = ReconcileLoop(scheduler, evictions)
    monitor = NodeMonitor(scheduler, monitor_interval_s(settings), evictions)
    scheduler.leader.add_loop(reconcile.name, settings.reconcile_interval_s, reconcile)
    scheduler.leader.on_loss.append(reconcile.forget)
    scheduler.leader.add_loop(monitor.name, monitor.interval_s, monitor)
    if settings.drift_detect_interval_s > 0:
        drift = DriftTrigger(reconcile, settings.drift_detect_interval_s)
        scheduler.leader.add_loop(drift.name, drift.interval_s, drift)


def loops_of(scheduler: SchedulerParts) -> RegisteredLoops:
    """The loop objects ``register_loops`` registered (for the CLI, the benchmark and tests)."""
    found: dict[str, Any] = {loop.name: loop.body for loop in scheduler.leader.loops}
    reconcile = found.get(ReconcileLoop.name)
    monitor = found.get(NodeMonitor.name)
    drift = found.get(DriftTrigger.name)
    if isinstance(reconcile, ReconcileLoop) and isinstance(monitor, NodeMonitor):
        return RegisteredLoops(reconcile, monitor,
                               drift if isinstance(drift, DriftTrigger) else None)
    raise LookupError("register_loops(scheduler) was not called")
