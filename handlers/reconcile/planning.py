"""A reconcile cycle's planning: what the owned nodes run, and the plan for every workload.

Why apart: this half of a cycle only observes and decides. It asks each owned, available node
once (``ListWorkloads``, at most ``SCHEDULER_RECONCILE_CONCURRENCY`` in flight), checks that
the projections are fresh enough for drift detection, takes this cycle's snapshot of specs,
statuses and the workload index, and calls the pure deciders (``handlers.reconcile.planner.drift``,
``handlers.reconcile.planner.cycle``) through ``plan_by_node``. The one write it makes is the
fenced NotReady of a node whose agent did not answer, so that the plan sees it unavailable.

A steady cycle costs little CPU beyond its RPCs: an agent answer equal (byte for byte) to its
last one is not decoded again, and a node whose view, listing and workload records (the
index's stamp) are what they were when it was last found entirely steady is answered from a
memo (``plan_by_node``, ``SteadyNodes``) without reading its workloads. Tests hold that plan to
``plan_cycle``, the whole-cycle reference, through every kind of change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from eventsource.errors import StoreError
from eventsource.records import WorkloadSpec, WorkloadStatus
from handlers.agents.pool import AgentError
from handlers.nodes.recovery import AnsweredDials, held_by_dials
from handlers.reconcile.bookkeeping import CycleMemory, CycleReport
from handlers.reconcile.planner.cycle import (
    CyclePlan,
    SteadyKey,
    SteadyNodes,
    node_facts,
    plan_node,
    plan_unassigned,
)
from handlers.reconcile.planner.drift import ADOPT_ACTIONS, DriftFinding, classify_drift
from handlers.reconcile.planner.inputs import (
    NodeObservation,
    NodeView,
    observed_from_agent,
    owns_workload,
)
from handlers.reconcile.planner.workload import Action
from handlers.reconcile.shell import NOT_READY, LoopShell, run_bounded
from handlers.workloads.retry import RetryPolicy
from proto.persys.agent.v1 import agent_pb2

if TYPE_CHECKING:
    from projections.cluster import WorkloadIndex

log = logging.getLogger("persys.loops")

#: how long drift detection waits for the projections to reach etcd's revision of the moment
#: the agents were listed (normally milliseconds)
DRIFT_FRESHNESS_WAIT_S = 5.0
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



class CyclePlanning:
    """The first half of a reconcile cycle: observe the owned nodes, then plan."""

    def __init__(self, shell: LoopShell, memory: CycleMemory) -> None:
        self.shell = shell
        self.memory = memory
        self.agents = shell.agents
        self.cluster = shell.cluster
        self.committer = shell.committer
        self.evictions = shell.evictions
        self.leader = shell.leader
        self.settings = shell.settings
        self.policy = shell.policy
        self.concurrency = shell.concurrency
        #: unassigned workloads another part places (the pending placer's index): a cycle
        #: that planned each of thousands of them would cost in proportion to their number
        self.handed_off: Container[str] = ()
        #: answered dials in a row of the nodes held NotReady for unanswered dials
        self.dials = AnsweredDials()

    def targets(self, views: Mapping[str, NodeView]) -> list[NodeView]:
        """The nodes this cycle lists: owned by this shard, available."""
        return [v for v in views.values() if v.available and self.leader.owns(v.node_id)]

    async def prefetch(self, targets: list[NodeView],
                       report: CycleReport) -> dict[str, NodeObservation]:
        """One ListWorkloads per target; an answer equal to the node's last one (byte for byte)
        is not decoded again: its observation is the last one, the same object, which also
        lets the steady-node memo recognise it at once."""
        observations: dict[str, NodeObservation] = {}
        last = self.memory.listings
        listings: dict[str, tuple[bytes, NodeObservation]] = {}

        async def one(view: NodeView) -> None:
            node_id = view.node_id
            report.rpcs["ListWorkloads"] += 1
            try:
                with self.shell.tracing.node(node_id):
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
            # only this cycle's answers: bounded by the owned nodes
            self.memory.listings = listings
        return observations

    async def fresh_for_drift(self) -> bool:
        """Whether drift may be detected on this cycle's listings: etcd's revision, read after
        the listing, is shown by the projections.

        Read after the listing: what an agent listed was committed before it was listed, so
        projections at this revision know it (one read before the listing missed workloads
        created by another replica while this cycle listed, and deleted them as orphans).
        """
        revision = await self._drift_revision()
        return revision is not None and await self._caught_up_for_drift(revision)

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

    async def mark_unreachable(self, unreachable: Iterable[str],
                               views: dict[str, NodeView],
                               observations: Mapping[str, NodeObservation],
                               now: datetime) -> None:
        """An unreachable agent marks its node NotReady (docs/compatibility.md, "Node lifecycle");
        ``views`` then show it so, and its workloads fail over in this cycle's plan."""

        async def lost(node_id: str) -> None:
            with self.shell.tracing.on_node(node_id):
                await self.shell.mark_not_ready(
                    node_id, now=now, source="reconciler",
                    reason=f"agent unreachable: {observations[node_id].error}")
            old = views[node_id]
            views[node_id] = NodeView(node_id, old.exists, NOT_READY, old.alive, old.endpoint)

        await run_bounded(unreachable, self.concurrency, lost)

    async def probe_held(self, views: Mapping[str, NodeView], just_marked: Collection[str],
                         report: CycleReport, now: datetime) -> None:
        """Dial each owned node held NotReady for unanswered dials while it heartbeats; one
        that answered ``SCHEDULER_NODE_READY_AFTER_DIALS`` dials in a row is Ready again
        (handlers/nodes/recovery.py). A node marked in this cycle is not dialed again in it."""
        needed = self.settings.node_ready_after_dials
        held: list[NodeView] = []
        for view in views.values():
            if not (view.exists and view.alive and view.status == NOT_READY) \
                    or view.node_id in just_marked or not self.leader.owns(view.node_id):
                continue
            item = self.cluster.nodes.get(view.node_id)
            if item is not None and held_by_dials(item.value):
                held.append(view)
        self.dials.keep_only({v.node_id for v in held})

        async def one(view: NodeView) -> None:
            report.rpcs["ListWorkloads"] += 1
            try:
                await self.agents.list_workloads_raw(view.node_id, view.endpoint,
                                                     leader_only=True)
            except AgentError:
                self.dials.unanswered(view.node_id)
                return
            if self.dials.answered(view.node_id) >= needed and \
                    await self.shell.mark_ready_by_dials(view.node_id, dials=needed, now=now):
                self.dials.unanswered(view.node_id)

        await run_bounded(held, self.concurrency, one)

    async def plan(self, views: Mapping[str, NodeView],
                   observations: Mapping[str, NodeObservation], report: CycleReport,
                   now: datetime) -> tuple[CyclePlan, list[DriftFinding]]:
        """This cycle's plan, and its drift findings when drift is detected on it.

        A workload to be adopted by drift remediation gets no reconcile action this cycle.
        """
        self.shell.decide_evictions(views, now)
        # plain dicts, copied in C: every lookup of the plan is a dict lookup (a Mapping
        # wrapper cost a Python call per lookup, hundreds of thousands per cycle), and the
        # watch batches folded while the plan yields do not reach this cycle's inputs
        specs = self.cluster.specs.snapshot()
        statuses = self.cluster.statuses.snapshot()
        # the index, read together with the snapshot (no await in between), so it agrees with it
        groups, stamps, unassigned = owned_by_node(
            self.cluster.workloads, owns_node=self.leader.owns,
            owns_unassigned=lambda wid: wid not in self.handed_off and owns_workload(
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
            observations=observations, now=now, policy=self.policy,
            memo=self.memory.steady_nodes, exclude=adopted,
            evictable=lambda node_id: self.evictions.allows(node_id, views))
        return plan, findings
