"""The fleet-wide counters that make the simulator the benchmark's witness.

Apart because every part of a fleet writes them (the nodes count agent RPCs, wrong-node refusals
and applies by leader term; the control loop counts registrations and heartbeats; the timer
counts its own failures) and the fleet's statistics read them; they hold no behaviour.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class FleetCounters:
    """Fleet-wide counters, shared by every node of one fleet (single event loop: no locks)."""

    #: Agent RPCs received, by method (refused ones included).
    rpcs: Counter[str] = field(default_factory=Counter)
    #: Control-plane outcomes: register_ok/_rejected/_errors, heartbeats_ok, heartbeat_errors,
    #: and the errors by gRPC code (``register_errors_DEADLINE_EXCEEDED``, ...)
    control: Counter[str] = field(default_factory=Counter)
    #: ApplyWorkload calls that reached a node (passed the node-id check).
    applies: int = 0
    applies_by_term: Counter[int] = field(default_factory=Counter)
    double_applies: int = 0
    double_applies_node_scope: int = 0
    wrong_node_refused: int = 0
    max_term_seen: int = 0
    #: Unexpected exceptions in timer callbacks or control steps (bugs; logged).
    internal_errors: int = 0

    def record_apply(self, term: int | None, node_max_term: int) -> int:
        """Count one apply carrying ``term``; return the node's new highest term."""
        self.applies += 1
        if term is None:
            return node_max_term
        self.applies_by_term[term] += 1
        if term < self.max_term_seen:
            self.double_applies += 1
        else:
            self.max_term_seen = term
        if term < node_max_term:
            self.double_applies_node_scope += 1
            return node_max_term
        return term
