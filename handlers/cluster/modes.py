"""Operating modes: normal, degraded, recovery.

What each means: docs/architecture.md, "Operating modes and health".

``decide_mode`` is the pure transition function; ``ModeState`` holds the current mode of this
replica and tells handlers whether mutations are allowed. The supervisor loop that probes etcd
lives in ``handlers.cluster.supervisor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

NORMAL = "normal"
DEGRADED = "degraded"
RECOVERY = "recovery"


@dataclass(frozen=True, slots=True)
class Probe:
    """What the supervisor saw."""

    etcd_ok: bool
    initialized: bool
    has_state: bool
    allow_empty_state: bool
    error: str = ""
    #: etcd's active alarms: with one raised (NOSPACE, CORRUPT) reads work, writes fail
    alarms: tuple[str, ...] = ()


def decide_mode(probe: Probe) -> tuple[str, str]:
    """(mode, reason) for a probe."""
    if not probe.etcd_ok:
        return DEGRADED, f"etcd unreachable: {probe.error}" if probe.error else "etcd unreachable"
    if probe.alarms:
        return DEGRADED, f"etcd refuses writes: alarm {', '.join(probe.alarms)}"
    if probe.initialized and not probe.has_state:
        if probe.allow_empty_state:
            return NORMAL, "empty state allowed (SCHEDULER_ALLOW_EMPTY_STATE)"
        return RECOVERY, (
            "cluster was initialized but holds no nodes, workloads or assignments; "
            "if that is intended, run `persys-scheduler confirm-empty-state` once (or set "
            "SCHEDULER_ALLOW_EMPTY_STATE=true)"
        )
    return NORMAL, "etcd reachable"


class ModeState:
    """This replica's mode; each replica keeps its own."""

    def __init__(self, now: datetime) -> None:
        self.mode = NORMAL
        self.reason = "starting"
        self.changed_at = now

    @property
    def writable(self) -> bool:
        return self.mode == NORMAL

    def set(self, mode: str, reason: str, now: datetime) -> bool:
        """Record a mode; True when it changed."""
        changed = mode != self.mode
        if changed:
            self.changed_at = now
        self.mode = mode
        self.reason = reason
        return changed
