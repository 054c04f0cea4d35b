"""The plan of one cycle: every owned workload's action, node by node.

Why apart from the per-workload decision (``handlers.reconcile.planner.workload``): a cycle plans
100,000 workloads at 5,000 nodes, so how they are grouped and skipped matters as much as what
each one gets. ``plan_node`` and ``plan_unassigned`` are the pieces the reconcile loop's
node-by-node plan (``handlers.reconcile.planning.plan_by_node``) is built from; ``plan_cycle``
is the whole-cycle reference tests hold it to; ``SteadyNodes`` is the memo that lets a node
whose inputs did not change be answered without reading its workloads. No I/O, no clock.
Go's order: docs/compatibility.md, "Reconcile order".
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from eventsource.records import WorkloadSpec, WorkloadStatus
from handlers.reconcile.planner.inputs import NodeObservation, NodeView, ObservedWorkload, node_of
from handlers.reconcile.planner.workload import NOOP, Action, plan_workload, steady_running
from handlers.workloads.retry import RetryPolicy

#: statuses a cycle leaves alone (Completed and Deleted: docs/compatibility.md, "Reconcile order")
FINISHED_STATUSES = frozenset({"completed", "deleted"})


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
    repair), and so are Completed and Deleted ones (as in Go) and those in ``exclude``.
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
    skips nodes whose inputs did not change (``handlers.reconcile.planning.plan_by_node``);
    tests hold the two to the same answer. ``evictable(node_id)`` is the disruption guard's
    answer for unavailable nodes (None: every node may be evicted).
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
