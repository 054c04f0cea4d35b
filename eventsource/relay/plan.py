"""One batch planned: the entries to append with their ``prev`` chain, owed gaps placed at
revision boundaries (the gap-id scheme of ``eventsource.relay``), and the mark after each record.

Why apart: the ordering rules of the relay as a pure function of the records, the stream's top,
the mark and the owed gaps, testable without servers; the pump appends what it plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from eventsource.events import Event, entry_data
from eventsource.relay.marks import PendingGap
from eventsource.relay.outbox import IdKey, OutboxRecord
from eventsource.stream.entries import format_id


@dataclass(frozen=True, slots=True)
class AppendPlan:
    """What one batch appends, and where the mark stands after each record."""

    #: ``(stream id, data)`` in XADD order (records, and gaps at revision boundaries)
    entries: list[tuple[str, str]]
    #: for each record of the batch (same order): the mark once it is relayed
    marks: list[str]
    #: the stream's top once every entry is appended
    top: IdKey
    #: max(top, mark) once every entry is appended: the final mark
    position: IdKey
    #: gaps still owed (no revision boundary was reached)
    gaps_left: tuple[PendingGap, ...]
    #: ids given to the gaps written by this plan
    gap_ids: list[str] = field(default_factory=list)


def _gap_data(gap: PendingGap, gap_id: IdKey, *, prev: str, now: datetime) -> str:
    event = Event(
        type="EventsGap",
        reason=gap.cause,
        details=gap.details(),
        event_id=gap.event_id,
        timestamp=now,
    )
    return entry_data(event.outbox_record(seq=gap_id[1]), revision=gap_id[0], prev=prev)


def plan_append(
    records: Sequence[OutboxRecord],
    *,
    top: IdKey,
    mark: IdKey,
    gaps: Sequence[PendingGap],
    caught_up: int | None,
    now: datetime,
) -> AppendPlan:
    """Plan one batch: entries with their ``prev`` chain, gaps placed at revision boundaries.

    Pure. ``records`` must be sorted by ``(revision, seq)`` and follow everything relayed
    before; ``top`` is the stream's newest id ((0, 0) if empty), ``mark`` the high-water mark;
    ``caught_up`` is a revision such that every record up to it is in this or an earlier batch
    (None if unknown). A record at or below ``top`` is planned again and will be recognised as
    already appended by ``append_batch``.
    """
    entries: list[tuple[str, str]] = []
    marks: list[str] = []
    gap_ids: list[str] = []
    pending = list(gaps)
    cur_top = top

    def write_gaps() -> None:
        nonlocal cur_top
        for gap in pending:
            pos = max(cur_top, mark)
            gap_id = (pos[0], pos[1] + 1)
            entries.append((format_id(gap_id), _gap_data(gap, gap_id, prev=format_id(cur_top),
                                                         now=now)))  # fmt: skip
            gap_ids.append(format_id(gap_id))
            cur_top = gap_id
        pending.clear()

    for record in records:
        if pending and record.revision > max(cur_top, mark)[0]:
            write_gaps()
        data = entry_data(record.value, revision=record.revision, prev=format_id(cur_top))
        entries.append((record.stream_id, data))
        cur_top = max(cur_top, record.order)
        marks.append(format_id(max(cur_top, mark)))
    if pending and caught_up is not None and caught_up >= max(cur_top, mark)[0]:
        write_gaps()
    return AppendPlan(
        entries=entries,
        marks=marks,
        top=cur_top,
        position=max(cur_top, mark),
        gaps_left=tuple(pending),
        gap_ids=gap_ids,
    )
