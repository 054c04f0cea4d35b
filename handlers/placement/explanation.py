"""Why a workload goes where it goes, or fits nowhere: the placement decision, explained.

Pure, like the decision itself, and built from the very functions ``place`` uses (``refusal``,
``score``, ``jitter``, ``taint_penalty``, and ``place`` for the choice), so an explanation can
never disagree with a placement made on the same inputs. Unlike ``place`` it visits every node:
the refusals are counted by reason over the whole fleet, and the candidates ranked among all
that fit. The answer stays small at any fleet size: counts by reason, the best ``top``
candidates with their score's parts, and a sample of the refusals in full.
"""

from __future__ import annotations

from collections import Counter
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

#: refusals returned in full, at most
SAMPLE_MAX = 20
#: candidates returned with their score's parts, at most
TOP_MAX = 50
#: statuses that mean an operator is emptying the node
DRAINING_STATUSES = frozenset({"draining", "drained"})


def refusal_kind(reason: str) -> str:
    """The reason a refusal is counted under: ``refusal``'s text without its particulars.

    "insufficient cpu: free 500m < 2000m" -> "insufficient cpu";
    "taint gpu=yes:NoSchedule" -> "tainted NoSchedule"; "status Draining" -> "draining".
    """
    for prefix in ("insufficient cpu", "insufficient memory"):
        if reason.startswith(prefix):
            return prefix
    if reason.startswith("taint "):
        return "tainted " + reason.rsplit(":", 1)[-1]
    if reason.startswith("status "):
        status = reason.removeprefix("status ")
        return "draining" if status.lower() in DRAINING_STATUSES else f"status {status}"
    if reason.startswith("label "):
        return "node selector not matched"
    if reason.startswith("workload type "):
        return "workload type not supported"
    if reason.startswith("storage driver "):
        return "storage driver not supported"
    return reason


def count_refusals(rejected: Mapping[str, str]) -> tuple[tuple[str, int], ...]:
    """Refusals counted by kind, most first (ties by name, so the order is stable)."""
    counts = Counter(refusal_kind(why) for why in rejected.values())
    return tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def fit_summary(total: int, fit: int, refusals: Sequence[tuple[str, int]]) -> str:
    """One line: "0/20 nodes fit: 12 insufficient cpu, 5 tainted NoSchedule, 3 draining"."""
    line = f"{fit}/{total} nodes fit"
    if refusals:
        line += ": " + ", ".join(f"{n} {kind}" for kind, n in refusals)
    return line


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
