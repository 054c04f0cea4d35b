"""The placement explanation: built on the placement function, so it never disagrees with it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.placement.decision import NodeInfo, PlacementRequest, place
from handlers.placement.explanation import SAMPLE_MAX, explain
from handlers.placement.refusals import (
    count_refusals,
    fit_summary,
    no_fit_reason,
    refusal_kind,
    refusal_kinds,
)

TYPES = ["container", "compose", "vm"]


def node(node_id: str, **kw: object) -> NodeInfo:
    base: dict[str, object] = {"status": "Ready", "cpu_total_m": 4000, "mem_total_mb": 8192,
                               "workload_types": frozenset(TYPES)}
    base.update(kw)
    return NodeInfo(node_id=node_id, **base)  # type: ignore[arg-type]


def run(req: PlacementRequest, nodes: list[NodeInfo], **kw: object):  # type: ignore[no-untyped-def]
    args: dict[str, object] = {"alive": {n.node_id for n in nodes}, "allocated": {},
                               "reserved": {}, "counts": {}, "max_count": 0}
    args.update(kw)
    return explain(req, nodes, **args)  # type: ignore[arg-type]


REQ = PlacementRequest(workload_id="w", workload_type="container", cpu_m=2000, mem_mb=512)


@pytest.mark.parametrize(("reason", "kind"), [
    ("insufficient cpu: free 500m < 2000m", "insufficient cpu"),
    ("insufficient memory: free 5MB < 512MB", "insufficient memory"),
    ("taint gpu=yes:NoSchedule", "tainted NoSchedule"),
    ("status Draining", "draining"),
    ("status Drained", "draining"),
    ("status NotReady", "status NotReady"),
    ("label zone=a not matched", "node selector not matched"),
    ("workload type vm not supported", "workload type not supported"),
    ("workload type vm needs a hypervisor", "workload type not supported"),
    ("storage driver ceph-rbd not supported", "storage driver not supported"),
    ("liveness lease expired", "liveness lease expired"),
    ("excluded", "excluded"),
])
def test_refusals_are_counted_under_their_kind(reason: str, kind: str) -> None:
    assert refusal_kind(reason) == kind


def test_the_summary_counts_refusals_by_reason_most_first() -> None:
    nodes = [node(f"cpu{i}", cpu_total_m=1000) for i in range(12)]
    nodes += [node(f"t{i}", taints=(("k", "v", "NoSchedule"),)) for i in range(5)]
    nodes += [node(f"d{i}", status="Draining") for i in range(3)]
    got = run(REQ, nodes)
    assert got.chosen is None
    assert got.summary == "0/20 nodes fit: 12 insufficient cpu, 5 tainted NoSchedule, 3 draining"
    assert len(got.sample) == SAMPLE_MAX
    assert got.candidates == ()


def test_candidates_carry_the_parts_of_their_score() -> None:
    nodes = [node("a", taints=(("k", "v", "PreferNoSchedule"),)), node("b"), node("c")]
    got = run(REQ, nodes, allocated={"b": (1000, 0)}, reserved={"c": (500, 256)},
              counts={"a": 1}, max_count=1, top=3)
    assert got.chosen == "c"
    assert [c.scored.node_id for c in got.candidates] == ["c", "b", "a"]
    by_id = {c.scored.node_id: c for c in got.candidates}
    assert by_id["a"].taint_penalty == 0.5
    assert by_id["a"].scored.spread == 0.0
    assert (by_id["c"].reserved_cpu_m, by_id["c"].reserved_mem_mb) == (500, 256)
    assert (by_id["c"].free_cpu_m, by_id["c"].free_mem_mb) == (3500, 8192 - 256)
    for c in got.candidates:
        parts = (0.4 * c.scored.cpu_headroom + 0.4 * c.scored.mem_headroom
                 + 0.2 * c.scored.spread + c.tie_break - c.taint_penalty)
        assert c.scored.score == pytest.approx(parts)


def test_a_pin_to_a_local_disk_limits_the_nodes_counted() -> None:
    req = PlacementRequest(workload_id="w", workload_type="container", cpu_m=1, mem_mb=1,
                           only=frozenset({"b"}))
    got = run(req, [node("a"), node("b")])
    assert (got.chosen, got.total, got.fit) == ("b", 1, 1)


def test_fit_summary_without_refusals() -> None:
    assert fit_summary(3, 3, count_refusals({})) == "3/3 nodes fit"


node_st = st.builds(
    lambda i, status, cpu, mem, types, taint: NodeInfo(
        node_id=f"n{i}", status=status, cpu_total_m=cpu, mem_total_mb=mem,
        workload_types=frozenset(types), taints=(("t", "", taint),) if taint else ()),
    st.integers(0, 60), st.sampled_from(["Ready", "Ready", "Active", "NotReady", "Draining"]),
    st.integers(0, 8000), st.integers(0, 16384), st.sets(st.sampled_from(TYPES), min_size=1),
    st.sampled_from(["", "NoSchedule", "PreferNoSchedule"]),
)
usage_st = st.dictionaries(st.sampled_from([f"n{i}" for i in range(61)]),
                           st.tuples(st.integers(0, 8000), st.integers(0, 16384)), max_size=30)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(nodes=st.lists(node_st, max_size=40, unique_by=lambda n: n.node_id),
       wid=st.integers(0, 1000), wtype=st.sampled_from(TYPES), cpu=st.integers(0, 4000),
       mem=st.integers(0, 8192), allocated=usage_st, reserved=usage_st,
       counts=st.dictionaries(st.sampled_from([f"n{i}" for i in range(61)]),
                              st.integers(0, 9), max_size=30),
       sample=st.integers(1, 40), top=st.integers(1, 10))
def test_the_explanation_agrees_with_the_placement(nodes, wid, wtype, cpu, mem, allocated,  # type: ignore[no-untyped-def]
                                                   reserved, counts, sample, top) -> None:
    req = PlacementRequest(workload_id=f"w{wid}", workload_type=wtype, cpu_m=cpu, mem_mb=mem)
    alive = {n.node_id for n in nodes[::2]} | {n.node_id for n in nodes[1::3]}
    inputs = {"alive": alive, "allocated": allocated, "reserved": reserved, "counts": counts,
              "max_count": max(counts.values(), default=0)}
    got = explain(req, nodes, sample=sample, top=top, **inputs)  # type: ignore[arg-type]
    decision = place(req, nodes, sample=sample, **inputs)  # type: ignore[arg-type]
    assert got.chosen == decision.node_id
    assert got.total == len(nodes)
    assert got.fit + sum(n for _, n in got.refusals) == got.total
    assert (got.fit == 0) == (decision.node_id is None)
    assert len(got.candidates) == min(top, got.fit)
    scores = [(-c.scored.score, c.scored.node_id) for c in got.candidates]
    assert scores == sorted(scores)


def test_a_no_fit_reason_counts_and_quotes_a_few_refusals() -> None:
    rejected = {f"n{i:02d}": "insufficient cpu: free 0m < 500m" for i in range(10)}
    rejected["d1"] = "status Draining"
    text = no_fit_reason(rejected)
    assert text.startswith("no suitable node: 0/11 nodes fit: 10 insufficient cpu, 1 draining")
    assert "(e.g. d1: status Draining; n00: insufficient cpu: free 0m < 500m;" in text
    assert text.endswith(", ...)")
    assert refusal_kinds(text) == "draining, insufficient cpu"
    assert no_fit_reason({}) == "no suitable node: no nodes registered"
