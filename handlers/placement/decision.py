"""Placement: which node a workload goes to. Pure: (request, snapshot) -> decision.

Filters (each rejection is recorded with its reason): the node is Ready/Active and alive, not
draining; every selector label matches; no NoSchedule taint; the workload type is supported;
every required storage driver is supported; CPU and memory fit, where
``free = total - allocated - in-flight reservations`` (docs/architecture.md, "Placement model").
The score is ``0.4 cpu_headroom + 0.4 mem_headroom + 0.2 spread + jitter`` with
``spread = 1 - count/max_count`` and a deterministic jitter in [0, 0.01) from
crc32(workload_id|node_id); a PreferNoSchedule taint lowers the score by 0.5.

Speed: like kube-scheduler's ``percentageOfNodesToScore``, a decision does not score every node
of a large fleet. Nodes are visited in a rotation that starts at a point derived from the
workload id, and filtering stops once ``sample`` feasible nodes are found; only when nothing fits
is every node visited, so that the rejection lists each node's reason. With the default sample
the cost is independent of fleet size once the fleet is larger than the sample.

Nothing here reads a clock, a global or a random source; the same inputs give the same answer.
The commit-time check on ``/allocations/<node>`` is what makes concurrent decisions safe.
"""

from __future__ import annotations

import zlib
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from handlers.placement.refusals import no_fit_reason

CPU_WEIGHT = 0.4
MEM_WEIGHT = 0.4
SPREAD_WEIGHT = 0.2
JITTER_SCALE = 0.01
PREFER_NO_SCHEDULE_PENALTY = 0.5
READY_STATUSES = frozenset({"ready", "active"})


def canonical_type(workload_type: str) -> str:
    """docker-container/container -> container, docker-compose -> compose, micro-vm -> microvm."""
    t = workload_type.strip().lower()
    return {
        "docker-container": "container",
        "docker-compose": "compose",
        "micro-vm": "microvm",
        "firecracker": "microvm",
    }.get(t, t)


def canonical_driver(driver: str) -> str:
    d = driver.strip().lower()
    if d in ("ceph_rbd", "rbd"):
        return "ceph-rbd"
    return d or "local"


def stable_hash(text: str) -> int:
    """A deterministic 32-bit hash (crc32: C speed; the Go version used FNV-1a, and only
    determinism matters here)."""
    return zlib.crc32(text.encode())


def jitter(workload_id: str, node_id: str) -> float:
    return (stable_hash(f"{workload_id}|{node_id}") % 1000) / 1000 * JITTER_SCALE


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What placement needs of a node that changes only when the node record changes."""

    node_id: str
    status: str
    cpu_total_m: int
    mem_total_mb: int
    labels: Mapping[str, str] = field(default_factory=dict)
    #: (key, value, effect)
    taints: tuple[tuple[str, str, str], ...] = ()
    #: canonical workload types; empty means the node did not say
    workload_types: frozenset[str] = frozenset()
    storage_drivers: frozenset[str] = frozenset({"local"})
    hypervisor_ok: bool = False


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    workload_id: str
    workload_type: str
    cpu_m: int
    mem_mb: int
    selector: Mapping[str, str] = field(default_factory=dict)
    required_drivers: frozenset[str] = frozenset()
    exclude: frozenset[str] = frozenset()
    #: when set, the only nodes allowed: a local disk the workload uses lives there
    only: frozenset[str] = frozenset()


class ScoredNode(NamedTuple):
    """One feasible node's score and its parts (a NamedTuple: a decision builds up to
    ``sample`` of them, and a frozen dataclass's ``__init__`` costs several times as much)."""

    node_id: str
    score: float
    cpu_headroom: float
    mem_headroom: float
    spread: float


@dataclass(frozen=True, slots=True)
class PlacementDecision:
    """The chosen node (or None) and why."""

    node_id: str | None
    top: tuple[ScoredNode, ...] = ()
    #: node id -> reason, for the nodes visited and refused
    rejected: Mapping[str, str] = field(default_factory=dict)
    visited: int = 0

    @property
    def reason(self) -> str:
        if self.node_id is not None and self.top:
            best = self.top[0]
            return (
                f"selected by placement score {best.score:.4f} "
                f"(cpu {best.cpu_headroom:.3f}, mem {best.mem_headroom:.3f}, "
                f"spread {best.spread:.3f})"
            )
        # "no suitable node" is what the Go end-to-end runner waits out (step 3 of
        # docs/compatibility.md, "Go end-to-end runner")
        return no_fit_reason(self.rejected)


def refusal(
    req: PlacementRequest,
    node: NodeInfo,
    *,
    alive: Container[str],
    allocated: Mapping[str, tuple[int, int]],
    reserved: Mapping[str, tuple[int, int]],
) -> str | None:
    """Why ``node`` cannot take ``req``, or None when it can."""
    if node.node_id in req.exclude:
        return "excluded"
    if req.only and node.node_id not in req.only:
        return "a local disk of the workload is on another node"
    if node.status.lower() not in READY_STATUSES:
        return f"status {node.status or 'unknown'}"
    if node.node_id not in alive:
        return "liveness lease expired"
    for key, value in req.selector.items():
        if node.labels.get(key) != value:
            return f"label {key}={value} not matched"
    for key, value, effect in node.taints:
        if effect in ("", "NoSchedule"):
            return f"taint {key}={value}:{effect or 'NoSchedule'}"
    wtype = req.workload_type
    if node.workload_types:
        if wtype not in node.workload_types:
            return f"workload type {wtype} not supported"
    elif wtype in ("vm", "microvm") and not node.hypervisor_ok:
        return f"workload type {wtype} needs a hypervisor"
    missing = req.required_drivers - node.storage_drivers
    if missing:
        return f"storage driver {','.join(sorted(missing))} not supported"
    alloc_cpu, alloc_mem = allocated.get(node.node_id, (0, 0))
    res_cpu, res_mem = reserved.get(node.node_id, (0, 0))
    free_cpu = node.cpu_total_m - alloc_cpu - res_cpu
    free_mem = node.mem_total_mb - alloc_mem - res_mem
    if req.cpu_m > 0 and free_cpu < req.cpu_m:
        return f"insufficient cpu: free {free_cpu}m < {req.cpu_m}m"
    if req.mem_mb > 0 and free_mem < req.mem_mb:
        return f"insufficient memory: free {free_mem}MB < {req.mem_mb}MB"
    return None


def score(
    req: PlacementRequest,
    node: NodeInfo,
    *,
    allocated: Mapping[str, tuple[int, int]],
    reserved: Mapping[str, tuple[int, int]],
    counts: Mapping[str, int],
    max_count: int,
) -> ScoredNode:
    if node.cpu_total_m <= 0 or node.mem_total_mb <= 0:
        return ScoredNode(node.node_id, -1e9, 0.0, 0.0, 0.0)
    alloc_cpu, alloc_mem = allocated.get(node.node_id, (0, 0))
    res_cpu, res_mem = reserved.get(node.node_id, (0, 0))
    cpu_headroom = (node.cpu_total_m - alloc_cpu - res_cpu) / node.cpu_total_m
    mem_headroom = (node.mem_total_mb - alloc_mem - res_mem) / node.mem_total_mb
    spread = 1.0 if max_count <= 0 else 1.0 - counts.get(node.node_id, 0) / max_count
    total = (
        CPU_WEIGHT * cpu_headroom
        + MEM_WEIGHT * mem_headroom
        + SPREAD_WEIGHT * spread
        + jitter(req.workload_id, node.node_id)
    )
    total -= taint_penalty(node)
    return ScoredNode(node.node_id, total, cpu_headroom, mem_headroom, spread)


def taint_penalty(node: NodeInfo) -> float:
    """What a PreferNoSchedule taint takes off a node's score."""
    if node.taints and any(effect == "PreferNoSchedule" for _, _, effect in node.taints):
        return PREFER_NO_SCHEDULE_PENALTY
    return 0.0


def place(
    req: PlacementRequest,
    nodes: Sequence[NodeInfo],
    *,
    alive: Container[str],
    allocated: Mapping[str, tuple[int, int]],
    reserved: Mapping[str, tuple[int, int]],
    counts: Mapping[str, int],
    max_count: int,
    sample: int = 32,
    top_k: int = 3,
    lane: tuple[int, int] = (0, 1),
) -> PlacementDecision:
    """Choose a node for ``req``; see the module docstring for the rules.

    ``lane`` = (index, count) moves the rotation's start into the index-th of count equal
    parts of the node list: active-active replicas sample different nodes first, so their
    concurrent placements rarely meet at one allocation's compare-and-swap.
    """
    if req.only:  # pinned by a local disk: look at its node only
        nodes = [node for node in nodes if node.node_id in req.only]
    n = len(nodes)
    if n == 0:
        return PlacementDecision(None)
    index, count = lane
    start = (stable_hash(req.workload_id) % max(1, n // max(1, count))
             + (index % max(1, count)) * (n // max(1, count))) % n
    feasible: list[ScoredNode] = []
    rejected: dict[str, str] = {}
    visited = 0
    for offset in range(n):
        node = nodes[(start + offset) % n]
        visited += 1
        why = refusal(req, node, alive=alive, allocated=allocated, reserved=reserved)
        if why is not None:
            rejected[node.node_id] = why
            continue
        feasible.append(
            score(req, node, allocated=allocated, reserved=reserved, counts=counts,
                  max_count=max_count)
        )
        if len(feasible) >= sample:
            break
    if not feasible:
        return PlacementDecision(None, (), rejected, visited)
    feasible.sort(key=lambda s: (-s.score, s.node_id))
    return PlacementDecision(feasible[0].node_id, tuple(feasible[:top_k]), rejected, visited)
