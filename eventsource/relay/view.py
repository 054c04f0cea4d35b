"""The leading relay's view of the stream and of its mark, shared by the parts that lead.

Why apart: the take-over rebuilds it, the pump appends from it, the marker and the pruning move
the mark in it; one small record they all hold instead of each keeping a copy that could drift.
"""

from __future__ import annotations

from dataclasses import dataclass

from eventsource.relay.marks import PendingGap
from eventsource.relay.outbox import IdKey


@dataclass(slots=True)
class StreamView:
    """One per relay. ``takeover.take_over`` rebuilds it each time the relay loop starts over
    (``force_aside`` is its input); the pump, the marker and the pruning keep it current."""

    #: the stream's newest id as this relay knows it ((0, 0): empty)
    top: IdKey = (0, 0)
    #: the high-water mark in etcd, and that key's mod revision (for the fenced compare)
    mark: IdKey = (0, 0)
    mark_mod: int = 0
    #: the gaps owed to the stream, written at the next revision boundary
    gaps: tuple[PendingGap, ...] = ()
    #: set when an append found the stream unable to take our ids: the next take-over moves
    #: the stream aside for this reason
    force_aside: str | None = None
    #: the overflow gap of the current Redis outage (merged into; None: start a new one)
    open_overflow: str | None = None
