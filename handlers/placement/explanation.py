"""Why a workload goes where it goes, or fits nowhere: the placement decision, explained.

Pure, like the decision itself, and built from the very functions ``place`` uses (``refusal``,
``score``, ``jitter``, ``taint_penalty``, and ``place`` for the choice), so an explanation can
never disagree with a placement made on the same inputs. Unlike ``place`` it visits every node:
the refusals are counted by reason over the whole fleet, and the candidates ranked among all
that fit. The answer stays small at any fleet size: counts by reason, the best ``top``
candidates with their score's parts, and a sample of the refusals in full.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from handlers.placement.decision import (
    NodeInfo,
    PlacementRequest,
    ScoredNode,
    jitter,
    place,
    refusal,
    score,
    taint_penalty,
)
from handlers.placement.refusals import count_refusals, fit_summary

#: refusals returned in full, at most
SAMPLE_MAX = 20
#: candidates returned with their score's parts, at most
TOP_MAX = 50


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that passed every filter, with what its score is made of."""

    scored: ScoredNode
    tie_break: float
    taint_penalty: float
    free_cpu_m: int
    free_mem_mb: int
    reserved_cpu_m: int
    reserved_mem_mb: int


@dataclass(frozen=True, slots=True)
class Explanation:
    chosen: str | None
    total: int
    fit: int
    refusals: tuple[tuple[str, int], ...]
    candidates: tuple[Candidate, ...]
    sample: tuple[tuple[str, str], ...]

    @property
    def summary(self) -> str:
        return fit_summary(self.total, self.fit, self.refusals)


def explain(
    req: PlacementRequest,
    nodes: Sequence[NodeInfo],
    *,
    alive: Container[str],
    allocated: Mapping[str, tuple[int, int]],
    reserved: Mapping[str, tuple[int, int]],
    counts: Mapping[str, int],
    max_count: int,
    sample: int = 32,
    lane: tuple[int, int] = (0, 1),
    top: int = 5,
) -> Explanation:
    """Explain ``req`` on these inputs; ``sample`` and ``lane`` are the placer's own."""
    chosen = place(req, nodes, alive=alive, allocated=allocated, reserved=reserved,
                   counts=counts, max_count=max_count, sample=sample, lane=lane).node_id
    if req.only:
        nodes = [node for node in nodes if node.node_id in req.only]
    rejected: dict[str, str] = {}
    feasible: list[tuple[ScoredNode, NodeInfo]] = []
    for node in nodes:
        why = refusal(req, node, alive=alive, allocated=allocated, reserved=reserved)
        if why is not None:
            rejected[node.node_id] = why
            continue
        feasible.append((score(req, node, allocated=allocated, reserved=reserved,
                               counts=counts, max_count=max_count), node))
    feasible.sort(key=lambda pair: (-pair[0].score, pair[0].node_id))
    best = [_candidate(req, scored, node, allocated, reserved)
            for scored, node in feasible[:max(0, min(top, TOP_MAX))]]
    shown = sorted(rejected.items())[:SAMPLE_MAX]
    return Explanation(chosen, len(nodes), len(feasible), count_refusals(rejected),
                       tuple(best), tuple(shown))


def _candidate(req: PlacementRequest, scored: ScoredNode, node: NodeInfo,
               allocated: Mapping[str, tuple[int, int]],
               reserved: Mapping[str, tuple[int, int]]) -> Candidate:
    alloc_cpu, alloc_mem = allocated.get(node.node_id, (0, 0))
    res_cpu, res_mem = reserved.get(node.node_id, (0, 0))
    return Candidate(
        scored=scored,
        tie_break=jitter(req.workload_id, node.node_id),
        taint_penalty=taint_penalty(node),
        free_cpu_m=node.cpu_total_m - alloc_cpu - res_cpu,
        free_mem_mb=node.mem_total_mb - alloc_mem - res_mem,
        reserved_cpu_m=res_cpu,
        reserved_mem_mb=res_mem,
    )
