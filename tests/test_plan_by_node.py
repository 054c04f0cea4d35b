"""The reconcile loop's node-by-node plan against the whole-cycle reference.

Pure: a small model feeds the workload index the changes a projection folds (``changed`` and
``reset``, the calls ``PrefixProjection`` makes to its listeners), and every cycle's
``plan_by_node`` (from the index, its stamps and the steady-node memo kept across cycles) must
equal ``plan_cycle`` over the same records. A memo answer that outlived a change of its inputs
would show up here as a steady workload where the reference plans an action.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from eventsource.records import Node, RetryState, WorkloadSpec, WorkloadStatus
from handlers.reconcile.planner.cycle import CyclePlan, SteadyNodes, plan_cycle
from handlers.reconcile.planner.inputs import NodeObservation, NodeView, ObservedWorkload, node_view
from handlers.reconcile.planner.workload import REAPPLY
from handlers.reconcile.planning import owned_by_node, plan_by_node
from handlers.workloads.retry import LAST_APPLY_AT, LAST_APPLY_REVISION, RetryPolicy
from projections.cluster import SpecChanges, WorkloadIndex
from projections.prefix import Item
from tests.fixtures.planning import T0

POLICY = RetryPolicy()
APPLIED_LONG_AGO = {LAST_APPLY_AT: "2026-03-01T11:00:00Z", LAST_APPLY_REVISION: "rev-1"}
NODES = [f"n{i}" for i in range(6)]


def owns_node(node_id: str) -> bool:
    return node_id != "n2"


def owns_unassigned(workload_id: str) -> bool:
    return zlib.crc32(workload_id.encode()) % 2 == 0


class CountingMapping(Mapping[str, Any]):
    """A mapping that records which keys were read (to see what the memo spared)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return self.data.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


class Fleet:
    """Specs, statuses, node views and agent listings, with the index fed as a projection would."""

    def __init__(self) -> None:
        self.index = WorkloadIndex()
        self.spec_feed = SpecChanges(self.index)
        self.spec_items: dict[str, Item[WorkloadSpec]] = {}
        self.status_items: dict[str, Item[WorkloadStatus]] = {}
        self.views = {n: node_view(n, Node(node_id=n, status="Ready"), alive=True) for n in NODES}
        self.listings: dict[str, dict[str, ObservedWorkload]] = {n: {} for n in NODES}
        self.failed_listing: set[str] = set()
        self.revision = 0

    def _item(self, value: Any) -> Item[Any]:
        self.revision += 1
        return Item(value, self.revision, self.revision, 0)

    def put_spec(self, spec: WorkloadSpec) -> None:
        old = self.spec_items.get(spec.id)
        new = self.spec_items[spec.id] = self._item(spec)
        self.spec_feed.changed(spec.id, old, new)

    def put_status(self, status: WorkloadStatus) -> None:
        old = self.status_items.get(status.id)
        new = self.status_items[status.id] = self._item(status)
        self.index.changed(status.id, old, new)

    def delete_status(self, workload_id: str) -> None:
        old = self.status_items.pop(workload_id, None)
        if old is not None:
            self.index.changed(workload_id, old, None)

    def delete_spec(self, workload_id: str) -> None:
        old = self.spec_items.pop(workload_id, None)
        if old is not None:
            self.spec_feed.changed(workload_id, old, None)

    def relist(self) -> None:
        self.index.reset(dict(self.status_items))
        self.spec_feed.reset(dict(self.spec_items))

    def running(self, workload_id: str, node: str) -> None:
        """A workload running where it should: spec, status and the agent's listing agree."""
        self.put_spec(WorkloadSpec(id=workload_id, type="container", revision_id="rev-1",
                                   desired_state="Running", image="nginx:1"))
        self.put_status(WorkloadStatus(id=workload_id, node_id=node, assigned_node=node,
                                       status="Running", metadata=dict(APPLIED_LONG_AGO),
                                       retry=RetryState(max_attempts=5)))
        self.listings[node][workload_id] = ObservedWorkload(workload_id, "Running", "rev-1",
                                                            "Running")

    def observations(self) -> dict[str, NodeObservation]:
        # a new listing object every cycle, as the prefetch builds one per agent answer
        return {n: NodeObservation(n, ok=n not in self.failed_listing,
                                   workloads=dict(listing) if n not in self.failed_listing
                                   else {})
                for n, listing in self.listings.items()}


def canonical(plan: CyclePlan) -> tuple[list[Any], list[str]]:
    return sorted(plan.actions, key=lambda a: a.workload_id), sorted(plan.steady)


async def plan_both(fleet: Fleet, memo: SteadyNodes, *, exclude: frozenset[str] = frozenset()
                    ) -> tuple[CyclePlan, CountingMapping]:
    """The loop's plan and the reference's, asserted equal: the loop's, and its spec reads."""
    specs = CountingMapping({k: i.value for k, i in fleet.spec_items.items()})
    statuses = {k: i.value for k, i in fleet.status_items.items()}
    observations = fleet.observations()
    groups, stamps, unassigned = owned_by_node(fleet.index, owns_node=owns_node,
                                               owns_unassigned=owns_unassigned)
    got = await plan_by_node(specs, statuses, groups=groups, unassigned=unassigned,
                             stamps=stamps, nodes=fleet.views, observations=observations,
                             now=T0, policy=POLICY, memo=memo, exclude=exclude)
    want = plan_cycle(specs.data, statuses, nodes=fleet.views, observations=observations,
                      owns_node=owns_node, owns_unassigned=owns_unassigned, now=T0,
                      policy=POLICY, exclude=exclude)
    assert canonical(got) == canonical(want)
    return got, specs


def steady_fleet() -> Fleet:
    fleet = Fleet()
    for i in range(30):
        fleet.running(f"w{i:02d}", NODES[i % len(NODES)])
    for i in range(4):  # waiting for placement
        fleet.put_spec(WorkloadSpec(id=f"p{i}", type="container", revision_id="rev-1",
                                    desired_state="Running", image="nginx:1"))
        fleet.put_status(WorkloadStatus(id=f"p{i}", status="Pending"))
    return fleet


def test_an_unchanged_cycle_reads_no_workload_of_a_steady_node() -> None:
    async def run() -> None:
        fleet, memo = steady_fleet(), SteadyNodes()
        first, _ = await plan_both(fleet, memo)
        assert len(first.steady) == 25  # every owned node's workloads (n2's five are not ours)
        assert len(memo) == 5
        again, reads = await plan_both(fleet, memo)
        assert canonical(again) == canonical(first)
        assert not {w for w in reads.read if w.startswith("w")}  # only the unassigned were read
    asyncio.run(run())


def _move(fleet: Fleet, wid: str, node: str) -> None:
    old = fleet.status_items[wid].value
    fleet.put_status(replace(old, node_id=node, assigned_node=node))


#: one change between two cycles; each must reach the plan although the node was memoised
CHANGES: list[tuple[str, Any]] = [
    ("desired Stopped", lambda f: f.put_spec(replace(f.spec_items["w00"].value,
                                                     desired_state="Stopped"))),
    ("new revision", lambda f: f.put_spec(replace(f.spec_items["w00"].value,
                                                  revision_id="rev-2"))),
    ("spec deleted", lambda f: f.delete_spec("w00")),
    ("status Failed", lambda f: f.put_status(replace(f.status_items["w00"].value,
                                                     status="Failed"))),
    ("retry bookkeeping", lambda f: f.put_status(replace(
        f.status_items["w00"].value, retry=RetryState(attempts=2, max_attempts=5)))),
    ("status deleted", lambda f: f.delete_status("w00")),
    ("status Completed", lambda f: f.put_status(replace(f.status_items["w00"].value,
                                                        status="Completed"))),
    ("moved to another owned node", lambda f: _move(f, "w00", "n1")),
    ("moved off the node", lambda f: _move(f, "w00", "")),
    ("agent reports Failed", lambda f: f.listings["n0"].__setitem__(
        "w00", ObservedWorkload("w00", "Failed", "rev-1", "Running"))),
    ("agent lost it", lambda f: f.listings["n0"].pop("w00")),
    ("listing failed", lambda f: f.failed_listing.add("n0")),
    ("node NotReady", lambda f: f.views.__setitem__("n0", NodeView("n0", True, "NotReady",
                                                                   True))),
    ("node gone", lambda f: f.views.pop("n0")),
]


def test_every_change_of_a_memoised_nodes_inputs_reaches_the_plan() -> None:
    async def run() -> None:
        for name, change in CHANGES:
            fleet, memo = steady_fleet(), SteadyNodes()
            first, _ = await plan_both(fleet, memo)
            change(fleet)
            after, _ = await plan_both(fleet, memo)  # asserts equality with the reference
            assert canonical(after) != canonical(first), name
    asyncio.run(run())


def test_a_change_missed_by_the_watch_is_seen_after_a_relist() -> None:
    """A re-list (after compaction or an outage) replaces records without per-key changes;
    the index starts a new generation, so no memoised answer survives it."""
    async def run() -> None:
        fleet, memo = steady_fleet(), SteadyNodes()
        await plan_both(fleet, memo)
        old = fleet.spec_items["w00"]
        fleet.spec_items["w00"] = Item(replace(old.value, revision_id="rev-2"), 999, 999, 0)
        fleet.relist()
        after, _ = await plan_both(fleet, memo)
        assert "w00" not in after.steady
        assert any(a.workload_id == "w00" and a.kind == REAPPLY for a in after.actions)
    asyncio.run(run())


def test_an_excluded_workload_is_left_out_of_a_memoised_answer() -> None:
    async def run() -> None:
        fleet, memo = steady_fleet(), SteadyNodes()
        await plan_both(fleet, memo)
        plan, _ = await plan_both(fleet, memo, exclude=frozenset({"w00"}))
        assert "w00" not in plan.steady
    asyncio.run(run())


OPS = st.lists(st.tuples(st.sampled_from(["state", "desired", "revision", "move", "delete",
                                          "agent", "report", "view", "relist", "noop"]),
                         st.integers(0, 29), st.integers(0, len(NODES) - 1),
                         st.sampled_from(["Running", "Failed", "Stopped", "Pending", ""])),
               max_size=25)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_plan_by_node_equals_the_reference_through_any_changes(
        ops: list[tuple[str, int, int, str]]) -> None:
    async def run() -> None:
        fleet, memo = steady_fleet(), SteadyNodes()
        await plan_both(fleet, memo)
        for kind, w, n, value in ops:
            wid, node = f"w{w:02d}", NODES[n]
            status = fleet.status_items.get(wid)
            spec = fleet.spec_items.get(wid)
            if kind == "state" and status is not None:
                fleet.put_status(replace(status.value, status=value or "Running"))
            elif kind == "desired" and spec is not None:
                fleet.put_spec(replace(spec.value, desired_state=value or "Running"))
            elif kind == "revision" and spec is not None:
                fleet.put_spec(replace(spec.value, revision_id=f"rev-{n}"))
            elif kind == "move" and status is not None:
                _move(fleet, wid, node if value else "")
            elif kind == "delete":
                fleet.delete_status(wid) if n % 2 else fleet.delete_spec(wid)
            elif kind == "agent":
                listing = fleet.listings[node]
                if value:
                    listing[wid] = ObservedWorkload(wid, value, "rev-1", "Running")
                else:
                    listing.pop(wid, None)
            elif kind == "report" and wid in fleet.listings[node]:
                # the agent's metadata (merged into the status on news, see statusmeta)
                listing = fleet.listings[node]
                listing[wid] = listing[wid]._replace(
                    metadata={"vm.primary_ip": value} if value else {})
            elif kind == "view":
                alive = value != "Failed"
                fleet.views[node] = NodeView(node, True, "Ready" if value else "NotReady",
                                             alive)
            elif kind == "relist":
                fleet.relist()
            await plan_both(fleet, memo)
    asyncio.run(run())
