"""Refusals counted by reason: what an operator reads when a workload fits nowhere.

Why counts: at 5,000 nodes a refusal naming every node is thousands of entries; operators
need "0/5000 nodes fit: 4,990 insufficient cpu, 10 draining", with a few refusals in full.
Pure, shared by the placement decision's reason, the pending workloads' reason and
ExplainPlacement.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

#: statuses that mean an operator is emptying the node
DRAINING_STATUSES = frozenset({"draining", "drained"})
#: refusals quoted in full in a reason
EXAMPLES = 3


def refusal_kind(reason: str) -> str:
    """The reason a refusal is counted under: ``decision.refusal``'s text without its
    particulars. "insufficient cpu: free 500m < 2000m" -> "insufficient cpu";
    "taint gpu=yes:NoSchedule" -> "tainted NoSchedule"; "status Draining" -> "draining"."""
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


def no_fit_reason(rejected: Mapping[str, str]) -> str:
    """Why no node could take a workload: the counts, then a few refusals in full (bounded
    whatever the fleet's size)."""
    if not rejected:
        return "no suitable node: no nodes registered"
    shown = "; ".join(f"{node}: {why}" for node, why in sorted(rejected.items())[:EXAMPLES])
    more = ", ..." if len(rejected) > EXAMPLES else ""
    summary = fit_summary(len(rejected), 0, count_refusals(rejected))
    return f"no suitable node: {summary} (e.g. {shown}{more})"


def refusal_kinds(reason: str) -> str:
    """The kinds named in a ``no_fit_reason`` or ``fit_summary`` text, without their counts:
    what must change before a pending workload's reason is worth a new event."""
    head = reason.split(" (e.g. ", 1)[0]
    _, _, counted = head.partition(" nodes fit: ")
    kinds = sorted(part.split(" ", 1)[1] for part in counted.split(", ") if " " in part)
    return ", ".join(kinds)
