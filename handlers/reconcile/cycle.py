"""The reconcile loop: one cycle per tick, and drift detection on the cycles asked for it.

Why: the committed state says what should run where; this loop makes the fleet match it, at a
cost proportional to the number of nodes, not workloads. A cycle is planning
(``handlers.reconcile.planning``: one ``ListWorkloads`` per owned, alive, serving node, then
every workload decided purely), acting (each action that needs I/O carried out by the part
that owns its kind: ``agentcalls``, ``relocations``, ``statuswrites``) and, on the cycles
asked for drift, remediation (``handlers.reconcile.remediation``); what it did and what it
remembers for the next cycle are kept by ``handlers.reconcile.bookkeeping``. In steady state a
cycle therefore makes exactly one agent RPC per owned node and no etcd write at all; every
write it does make is a CAS transaction carrying the leader fence, and every agent call is
``leader_only`` (renew-deadline check + ``x-persys-leader-term``).

Drift detection (docs/compatibility.md, "Drift detection") reuses a cycle's prefetch: the
drift loop (``handlers.reconcile.drifttrigger``) only asks for it, and the next (or the running)
reconcile cycle classifies and remediates drift on the lists it already has.

The Deleting finisher is the cycle's ``Delete``/``FinalizeDelete`` action: a workload still in
Deleting is deleted on its agent again and finalised through ``Dispatcher.finalize``.

The loop pauses in degraded and recovery modes (only ``normal`` is writable) and when this
replica does not lead. ``ReconcileLoop.run_once`` never runs two cycles at once: an
overlapping call returns at once with ``skipped="overlap"``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from datetime import datetime

from eventsource.errors import StoreError
from handlers.reconcile.agentcalls import AgentCalls
from handlers.reconcile.bookkeeping import ActionResult, CycleBook, CycleMemory, CycleReport
from handlers.reconcile.disruption import EvictionGate
from handlers.reconcile.parts import SchedulerParts
from handlers.reconcile.pending import PendingPlacer, Tried
from handlers.reconcile.planner.cycle import CyclePlan, SteadyNodes
from handlers.reconcile.planner.inputs import NodeObservation, NodeView
from handlers.reconcile.planner.workload import (
    APPLY_STOPPED,
    COUNT_FAILURE,
    DELETE,
    FAILOVER,
    FINALIZE,
    MARK_TERMINAL,
    PLACE,
    REAPPLY,
    RECORD_REPORT,
    SETTLE,
    Action,
)
from handlers.reconcile.planning import CyclePlanning
from handlers.reconcile.relocations import Relocations
from handlers.reconcile.remediation import DriftRemediation
from handlers.reconcile.shell import BODY_SHARE, LoopShell, run_bounded
from handlers.reconcile.statuswrites import StatusWrites
from handlers.writes.cas import NotFound

log = logging.getLogger("persys.loops")


class ReconcileLoop(LoopShell):
    """One reconcile cycle per tick; drift detection on the cycles that were asked for it.

    Composed of one part per job: ``planning`` observes and plans; ``agent_calls``,
    ``relocations`` and ``status_writes`` carry out the actions; ``remediation`` the drift
    findings; ``book`` and ``memory`` keep what the cycles did and what they remember. The
    loop itself orders a cycle's steps and routes each action to its executor.
    """

    name = "reconcile"

    def __init__(self, scheduler: SchedulerParts, evictions: EvictionGate) -> None:
        super().__init__(scheduler, evictions)
        self.interval_s = scheduler.settings.reconcile_interval_s
        self._lock = asyncio.Lock()
        self._drift_due = False
        self.memory = CycleMemory()
        self.book = CycleBook(self.metrics)
        self.planning = CyclePlanning(self, self.memory)
        self.status_writes = StatusWrites(self)
        self.relocations = Relocations(self, self.status_writes)
        self.agent_calls = AgentCalls(self, self.status_writes, self.relocations)
        #: the placements of unassigned workloads, this cycle's and between cycles
        self.pending = PendingPlacer(self, self.relocations)
        self.planning.handed_off = self.pending.index
        self.remediation = DriftRemediation(self, self.agent_calls)

    @property
    def last_report(self) -> CycleReport | None:
        """The newest cycle's report (for the CLI, the benchmark and tests)."""
        return self.book.last_report

    @property
    def steady_nodes(self) -> SteadyNodes:
        """Nodes found steady in the last cycle, and from what (see ``SteadyNodes``)."""
        return self.memory.steady_nodes

    @property
    def _listings(self) -> Mapping[str, tuple[bytes, NodeObservation]]:
        """Each node's last ListWorkloads answer (``CycleMemory.listings``)."""
        return self.memory.listings

    def forget(self) -> None:
        """Drop what cycles remembered (on leadership loss; see ``CycleMemory.forget``)."""
        self.memory.forget()

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
                with self.tracing.cycle(report):
                    await self._cycle(report, now or self.clock.now())
                ok = True
            finally:
                self.book.finish(report, time.perf_counter() - started, ok=ok)
            self.book.log(report)
            return report

    # -- the cycle ---------------------------------------------------------------------------
    async def _cycle(self, report: CycleReport, now: datetime) -> None:
        started = time.perf_counter()
        views = self.node_views()
        targets = self.planning.targets(views)
        tracing = self.tracing
        tracing.choose(v.node_id for v in targets)
        with tracing.phase("prefetch"):
            observations = await self.planning.prefetch(targets, report)
            if report.drift:
                # after the listing: what an agent listed was committed before it was listed
                report.drift = await self.planning.fresh_for_drift()
        planning = time.perf_counter()
        report.nodes_listed = len(targets)
        report.unreachable = sorted(n for n, o in observations.items() if o.unreachable)
        with tracing.phase("plan"):
            await self.planning.mark_unreachable(report.unreachable, views, observations, now)
            await self.planning.probe_held(views, report.unreachable, report, now)
            plan, findings = await self.planning.plan(views, observations, report, now)
        report.actions = plan.counts()
        acting = time.perf_counter()
        with tracing.phase("act"):
            results = await self._execute(plan, views, report, now)
        if findings:
            with tracing.phase("remediate"), tracing.untraced():
                await self.remediation.remediate(findings, results, views, report, now)
        self.book.record_phases(report, {"prefetch": planning - started,
                                         "plan": acting - planning,
                                         "act": time.perf_counter() - acting})

    async def _execute(self, plan: CyclePlan, views: Mapping[str, NodeView],
                       report: CycleReport, now: datetime) -> dict[str, ActionResult]:
        """Every action that needs I/O, at most ``concurrency`` at once; what became of each."""
        results: dict[str, ActionResult] = {}
        self.book.count_idle(plan)

        async def one(action: Action) -> None:
            with self.tracing.action(action):
                ok = await self._act(action, views, report, now)
            results[action.workload_id] = (action.kind, ok, action.node_id)
            self.book.count_result(report, action.kind, ok)

        await run_bounded(plan.needing_io(), self.concurrency, one)
        return results

    async def _act(self, action: Action, views: Mapping[str, NodeView], report: CycleReport,
                   now: datetime) -> bool:
        """Carry out one action by the part that owns its kind; any error fails this action
        alone."""
        kind = action.kind
        try:
            if kind == FINALIZE:
                await self.dispatcher.finalize(action.workload_id, fenced=True)
                return True
            if kind == DELETE:
                return await self.agent_calls.delete(action.workload_id, action.node_id, views,
                                                     report, finalize=True)
            if kind == PLACE:
                return await self.pending.attempt(action.workload_id, now) is Tried.PLACED
            if kind == FAILOVER:
                return await self.relocations.failover(action, now)
            if kind in (REAPPLY, APPLY_STOPPED):
                return await self._apply(action, views, report, now)
            if kind == COUNT_FAILURE:
                return await self.status_writes.count_failure(
                    action.workload_id, action.node_id, reason=action.reason, now=now,
                    once=True, reported=dict(action.reported), revision=action.revision)
            if kind == SETTLE:
                return await self.status_writes.settle(action, now)
            if kind == MARK_TERMINAL:
                return await self._mark_terminal(action, now)
            if kind == RECORD_REPORT:
                return await self.status_writes.record_report(action)
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

    # Two executors are reached through the loop rather than their part, so that one loop (or
    # the class) can interleave a change with them: tests race a stop with a planned re-apply,
    # and an update with a planned terminal mark.
    async def _apply(self, action: Action, views: Mapping[str, NodeView], report: CycleReport,
                     now: datetime) -> bool:
        return await self.agent_calls.apply(action, views, report, now)

    async def _mark_terminal(self, action: Action, now: datetime) -> bool:
        return await self.status_writes.mark_terminal(action, now)
