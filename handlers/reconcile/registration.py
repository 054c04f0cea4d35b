"""The leader-only loops, built and registered with the scheduler's ``LeaderGate``.

Why apart: the composition root (``handlers.app.server``) calls ``register_loops`` once; the
CLI, the benchmark and tests find the loop objects again through ``loops_of``. The reconcile
loop and the node monitor share one disruption guard (``EvictionGate``), built here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from handlers.reconcile.cycle import ReconcileLoop
from handlers.reconcile.disruption import EvictionGate, EvictionPolicy
from handlers.reconcile.drifttrigger import DriftTrigger
from handlers.reconcile.monitor import NodeMonitor
from handlers.reconcile.parts import SchedulerParts

if TYPE_CHECKING:
    from handlers.settings.config import Settings


@dataclass(frozen=True, slots=True)
class RegisteredLoops:
    """The loop objects ``register_loops`` built (no drift trigger when drift is off)."""

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
    leader = scheduler.leader

    def place_pending() -> None:
        # a task of the leadership group: cancelled and awaited when leadership ends
        leader.spawn(reconcile.pending.run(), name=f"leader:{reconcile.pending.name}")

    leader.on_gain.append(place_pending)
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
