"""Liveness hysteresis: a node that heartbeats but does not answer dials.

Why: the reconcile cycle marks a node whose agent it cannot dial NotReady, and a heartbeat
used to turn it Ready again at once; a node alive by heartbeat but undialable flapped
NotReady/Ready a dozen times a minute, each a write and two events (5,000 such nodes pushed
real history out of the event stream). Now the mark holds: a node marked NotReady by the
reconciler (``status_updated_by == "reconciler"``) is not turned Ready by its heartbeats, and
the reconcile cycle returns it to Ready only after it answers ``needed`` dials in a row
(``SCHEDULER_NODE_READY_AFTER_DIALS``). One mark, one NodeLost, one NodeReady; the
disruption guard sees one lost node throughout.

Pure, apart from the counter this replica keeps (leader-local: a new leader starts from 0,
which only delays the return).
"""

from __future__ import annotations

from collections.abc import Collection

from eventsource.records import Node
from handlers.nodes.statuses import NOT_READY

#: ``status_updated_by`` of a node the reconcile cycle marked for unanswered dials
MARKED_BY_DIALS = "reconciler"


def held_by_dials(node: Node) -> bool:
    """The node is NotReady because its agent did not answer dials: only answered dials
    return it to Ready, not heartbeats."""
    return node.status == NOT_READY and node.status_updated_by == MARKED_BY_DIALS


class AnsweredDials:
    """Answered dials in a row per held node."""

    def __init__(self) -> None:
        self._in_a_row: dict[str, int] = {}

    def answered(self, node_id: str) -> int:
        """Count an answered dial; the number in a row."""
        count = self._in_a_row.get(node_id, 0) + 1
        self._in_a_row[node_id] = count
        return count

    def unanswered(self, node_id: str) -> None:
        self._in_a_row.pop(node_id, None)

    def keep_only(self, held: Collection[str]) -> None:
        """Forget the nodes no longer held (bounded by the held nodes)."""
        for node_id in [n for n in self._in_a_row if n not in held]:
            del self._in_a_row[node_id]
