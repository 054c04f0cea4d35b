"""What every leader loop shares: the scheduler's parts, the pause rule, node views and the
fenced node-status write; and the bounded fan-out they all run their I/O through.

Why apart: the reconcile loop (``handlers.reconcile.cycle``) and the node monitor
(``handlers.reconcile.monitor``) both read the same parts, pause on the same conditions (not
leader, a mode that is not writable), ask the same disruption guard and turn nodes NotReady
the same way (``NodeLost``, fenced); the parts of a cycle (planning, acting, remediation)
are given this shell rather than the whole scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

from eventsource.errors import StoreError
from eventsource.etcd import Compare
from eventsource.events import Event, rfc3339
from eventsource.records import Node
from handlers.nodes.recovery import held_by_dials
from handlers.nodes.statuses import READY
from handlers.reconcile.disruption import EvictionDecision, EvictionGate
from handlers.reconcile.parts import SchedulerParts
from handlers.reconcile.planner.inputs import MONITORED_NODE_STATUSES, NodeView, node_view
from handlers.reconcile.tracing import CycleTracing
from handlers.workloads.retry import RetryPolicy
from handlers.writes.cas import NotFound

if TYPE_CHECKING:
    from handlers.settings.config import Settings

log = logging.getLogger("persys.loops")

NOT_READY = "NotReady"
#: the body of a loop must finish within this share of its interval
BODY_SHARE = 0.8

T = TypeVar("T")


def policy_from(settings: Settings) -> RetryPolicy:
    """The re-apply guard and retry budget knobs from the settings; the rest are the Go
    constants (docs/compatibility.md, "Re-apply guard" and "Retry budget")."""
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


class LoopShell:
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
        #: the cycle's spans (no-ops when traces are off)
        self.tracing = CycleTracing(s.tracer, s.settings.trace_reconcile_nodes)

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

    async def mark_ready_by_dials(self, node_id: str, *, dials: int, now: datetime) -> bool:
        """NotReady (marked for unanswered dials) -> Ready with a ``NodeReady`` event, once
        the agent answered ``dials`` dials in a row; fenced. True when it changed."""
        stamp = rfc3339(now)

        def mutate(node: Node) -> list[Event] | None:
            if not held_by_dials(node):
                return None
            node.status = READY
            node.status_reason = f"the agent answered {dials} dials in a row"
            node.status_updated_by = "reconciler"
            node.status_updated_at = stamp
            return [Event(type="NodeReady", node_id=node_id, reason=node.status_reason,
                          timestamp=now, details={"source": "reconciler"})]

        try:
            _, committed = await self.writer.update_node(node_id, mutate, kind="reconciler",
                                                         fenced=True)
        except NotFound:
            return False
        except StoreError as exc:
            log.warning("node not marked Ready node_id=%s: %s", node_id, exc)
            return False
        if committed is not None:
            log.info("node Ready again node_id=%s after %d answered dials", node_id, dials)
        return committed is not None

    async def mark_not_ready(self, node_id: str, *, reason: str, source: str,
                             now: datetime) -> bool:
        """Ready/Active -> NotReady with a ``NodeLost`` event, fenced; True when it changed.

        Draining and Drained nodes keep their status (the operator's intent); a node already
        NotReady is not rewritten and gets no second NodeLost (docs/compatibility.md,
        "Node lifecycle").
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
