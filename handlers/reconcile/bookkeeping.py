"""A reconcile cycle's bookkeeping: its report, its metrics, and what it leaves for the next.

Why apart: planning and acting decide and do; what a cycle did is written down here, in one
place: the ``CycleReport`` returned to tests, the CLI and the benchmark, the cycle's metrics
and its log line, and the per-node memory between cycles (each node's last ``ListWorkloads``
answer and the steady-node memo), which ``forget`` drops on a leadership loss.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from eventsource.metrics import Metrics
from handlers.reconcile.planner.cycle import CyclePlan, SteadyNodes
from handlers.reconcile.planner.drift import DriftFinding
from handlers.reconcile.planner.inputs import NodeObservation
from handlers.reconcile.planner.workload import NOOP

log = logging.getLogger("persys.loops")

#: what became of one workload's action this cycle: (action kind, ok, node id)
ActionResult = tuple[str, bool, str]


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


class CycleMemory:
    """What one cycle leaves for the next, per owned node.

    ``steady_nodes``: nodes found steady in the last cycle, and from what (see
    ``SteadyNodes``). ``listings``: each node's last ListWorkloads answer, its bytes and what
    was decoded from them (an equal answer is not decoded again). Both are caches: an empty
    one costs one full cycle.
    """

    def __init__(self) -> None:
        self.steady_nodes = SteadyNodes()
        self.listings: dict[str, tuple[bytes, NodeObservation]] = {}

    def forget(self) -> None:
        """Drop both (on leadership loss).

        Why: a replica that stopped leading keeps no cycles, so the memo and the last answers
        (about 20 MB per 2,500 nodes) would only wait for a next term, in which the shard's
        nodes may have changed anyway.
        """
        self.steady_nodes.replace({})
        self.listings = {}


class CycleBook:
    """The cycles' metrics and log line, and the newest cycle's report."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        #: the newest cycle's report (for the CLI, the benchmark and tests)
        self.last_report: CycleReport | None = None

    def count_idle(self, plan: CyclePlan) -> None:
        """The actions without I/O (steady workloads included) succeed at once."""
        idle: Counter[str] = Counter(a.kind for a in plan.actions if not (a.rpc or a.writes))
        if plan.steady:
            idle[NOOP] += len(plan.steady)
        for kind, count in idle.items():
            self.metrics.reconciliation_results.labels(kind, "true").inc(count)

    def count_result(self, report: CycleReport, kind: str, ok: bool) -> None:
        """One action carried out, in the report and the metrics."""
        (report.succeeded if ok else report.failed)[kind] += 1
        self.metrics.reconciliation_results.labels(kind, str(ok).lower()).inc()

    def record_phases(self, report: CycleReport, phases: dict[str, float]) -> None:
        report.phases = phases
        for phase, seconds in report.phases.items():
            self.metrics.reconcile_phase_seconds.labels(phase).inc(seconds)

    def finish(self, report: CycleReport, duration_s: float, *, ok: bool) -> None:
        """A cycle ended (``ok``: it ran to its end; not: it raised or was cancelled)."""
        report.duration_s = duration_s
        self.metrics.observe_reconcile_cycle(report.duration_s, ok=ok)
        self.last_report = report

    def log(self, report: CycleReport) -> None:
        """Log a cycle that met something unusual (a steady cycle is not logged)."""
        if report.unreachable or report.failed or report.drifts:
            log.info("reconcile cycle nodes=%d rpcs=%s actions=%s failed=%s drifts=%d "
                     "duration=%.3fs", report.nodes_listed, dict(report.rpcs),
                     report.actions, dict(report.failed), len(report.drifts),
                     report.duration_s)
