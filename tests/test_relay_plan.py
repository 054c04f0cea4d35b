"""The relay's batch plan (pure): where owed gaps go, and the ``prev`` chain of a batch."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from eventsource.events import Event
from eventsource.relay.marks import CAUSE_OVERFLOW, PendingGap
from eventsource.relay.outbox import OutboxRecord
from eventsource.relay.plan import plan_append

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


# -- pure: where gaps go ----------------------------------------------------------------------


def record(revision: int, seq: int) -> OutboxRecord:
    event = Event(type="NodeJoined", node_id=f"n{revision}-{seq}", timestamp=NOW)
    return OutboxRecord(
        key=f"/outbox/{event.event_id}",
        revision=revision,
        seq=seq,
        value=event.outbox_record(seq=seq),
    )


GAP = PendingGap(event_id=str(uuid.uuid4()), first="4-0", last="4-9", dropped=10,
                 cause=CAUSE_OVERFLOW)  # fmt: skip


def ids_and_prevs(entries: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(sid, json.loads(data)["prev"]) for sid, data in entries]


def test_plan_places_a_gap_at_the_next_revision_boundary() -> None:
    plan = plan_append(
        [record(6, 0), record(6, 1)], top=(5, 2), mark=(5, 2), gaps=[GAP], caught_up=None, now=NOW
    )
    assert ids_and_prevs(plan.entries) == [("5-3", "5-2"), ("6-0", "5-3"), ("6-1", "6-0")]
    assert plan.gap_ids == ["5-3"]
    assert plan.marks == ["6-0", "6-1"]
    assert plan.gaps_left == ()
    gap = json.loads(plan.entries[0][1])
    assert gap["type"] == "EventsGap"
    assert gap["eventId"] == GAP.event_id
    assert gap["details"] == {"from": "4-0", "to": "4-9", "dropped": "10"}
    assert (gap["revision"], gap["seq"]) == (5, 3)


def test_plan_never_splits_a_revision_with_a_gap() -> None:
    # the position is in the middle of revision 5: its rest comes first, then the gap
    plan = plan_append(
        [record(5, 2), record(6, 0)], top=(5, 1), mark=(5, 1), gaps=[GAP], caught_up=None, now=NOW
    )
    assert [sid for sid, _ in plan.entries] == ["5-2", "5-3", "6-0"]
    assert plan.gap_ids == ["5-3"]


def test_plan_writes_owed_gaps_once_caught_up() -> None:
    waiting = plan_append([], top=(5, 2), mark=(5, 2), gaps=[GAP], caught_up=None, now=NOW)
    assert waiting.entries == []
    assert waiting.gaps_left == (GAP,)
    other = PendingGap(event_id=str(uuid.uuid4()), first="9-0", last="9-0", dropped=None,
                       cause="x")  # fmt: skip
    # a mark above the top (Redis lost entries): gaps go above the mark
    plan = plan_append([], top=(3, 0), mark=(5, 2), gaps=[GAP, other], caught_up=7, now=NOW)
    assert ids_and_prevs(plan.entries) == [("5-3", "3-0"), ("5-4", "5-3")]
    assert plan.position == (5, 4)


def test_plan_replans_already_appended_records_without_moving_back() -> None:
    plan = plan_append(
        [record(5, 0), record(5, 1), record(6, 0)], top=(5, 1), mark=(4, 0), gaps=[],
        caught_up=6, now=NOW,
    )  # fmt: skip
    assert [sid for sid, _ in plan.entries] == ["5-0", "5-1", "6-0"]
    assert json.loads(plan.entries[2][1])["prev"] == "5-1"
    assert plan.marks == ["5-1", "5-1", "6-0"]
