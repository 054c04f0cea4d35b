"""One fleet's counters from several simulator processes.

Why: at 5,000 nodes one simulator process spends about 0.65 ms of CPU per ListWorkloads answer,
3.3 s of one core per reconcile cycle, so a single process would measure its own event loop
rather than the scheduler. The bench then runs the fleet as several processes with disjoint
node ranges, and every scenario reads their ``/stats`` merged into the shape one process gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Figures that are a maximum over the fleet, not a count (every other number is summed).
MAXIMA = frozenset({"max_term_seen", "timer_lag_max_s", "start_s"})
#: A list of examples, kept as short as one process keeps it.
LIST_CAP = 50


def merge_fleet_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``ops.sim.fleet.Fleet.stats`` of one fleet run as ``parts``: counts summed, maxima kept,
    per-key dicts (``rpcs``, ``per_node`` ...) merged key by key, example lists joined."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, Any] = {}
    for part in parts:
        _merge_into(out, part)
    return out


def _merge_into(out: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if key not in out:
            out[key] = _copy(value)
        elif isinstance(value, dict) and isinstance(out[key], dict):
            _merge_into(out[key], value)
        elif isinstance(value, list) and isinstance(out[key], list):
            out[key] = (out[key] + value)[:LIST_CAP]
        elif _number(value) and _number(out[key]):
            out[key] = max(out[key], value) if key in MAXIMA else out[key] + value
        else:
            out[key] = value


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return list(value)
    return value
