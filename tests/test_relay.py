"""The outbox relay against a real etcd and a real Redis server.

Events are committed through ``Committer`` (outbox enabled), exactly as handlers do; the tests
then read the stream back and check order, the ``prev`` chain, the mark and the outbox.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence

from eventsource.election import observe_leader
from eventsource.events import StreamEntry
from eventsource.stream.entries import id_key
from eventsource.stream.eventlog import RedisEventLog
from tests.fixtures.relay import (
    Harness,
    assert_chain,
    commit,
    everything,
    log_has,
    mark_of,
    outbox_size,
    relayed,
    sample,
)
from tests.fixtures.relay_fixtures import (
    committer,
    etcd,
    layout,
    log,
    metrics,
    relays,
    writer,
)
from tests.fixtures.waiting import wait_for

__all__ = ["committer", "etcd", "layout", "log", "metrics", "relays", "writer"]





async def crash_after_second_append(relays: Harness, log: RedisEventLog, *, batch: int) -> None:
    """Start a relay that dies right after its second XADD batch, before that batch's mark."""
    blocked = asyncio.Event()
    calls = 0

    async def crash_on_second_batch(ids: Sequence[str]) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            blocked.set()
            await asyncio.Event().wait()  # until the relay task is cancelled

    _, task = relays.start(log, batch=batch, after_append=crash_on_second_batch)
    await wait_for(blocked.is_set, message="relay never reached its second batch")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_relays_200_events_in_commit_order(
    etcd, layout, metrics, committer, relays, log
) -> None:
    # 150 before the relay starts (list path, one batch split over two txns), 50 after (watch)
    expected = await commit(committer, 75, per_change=2)
    relays.start(log, batch=300)
    expected += await commit(committer, 25, per_change=2)
    await wait_for(lambda: relayed(log, etcd, layout, 200), message="events not relayed")
    entries = await everything(log)
    assert [e.stream_id for e in entries] == expected
    assert len(expected) == 200
    assert all(e.type == "NodeJoined" and e.event_id for e in entries)
    assert len({e.event_id for e in entries}) == 200
    assert [(e.revision, e.seq) for e in entries] == sorted((e.revision, e.seq) for e in entries)
    assert_chain(entries)
    mark = await mark_of(etcd, layout)
    assert mark.last_id == expected[-1]
    assert mark.gaps == ()
    assert sample(metrics, "events_relayed") == 200


async def test_crash_between_xadd_and_mark_loses_and_duplicates_nothing(
    etcd, layout, metrics, committer, relays, log
) -> None:
    expected = await commit(committer, 60)
    await crash_after_second_append(relays, log, batch=20)
    assert await log.length() == 40  # two batches appended ...
    assert (await mark_of(etcd, layout)).last_id == expected[19]  # ... one recorded
    assert await outbox_size(etcd, layout) == 40

    expected += await commit(committer, 20)
    relays.start(log, batch=20)
    await wait_for(lambda: relayed(log, etcd, layout, 80), message="events not relayed")
    entries = await everything(log)
    assert [e.stream_id for e in entries] == expected
    assert_chain(entries)
    assert (await mark_of(etcd, layout)).last_id == expected[-1]


async def test_entries_trimmed_before_the_mark_moved_are_not_a_foreign_stream(
    etcd, layout, metrics, committer, relays, log, writer
) -> None:
    """A relay that crashed between XADD and its mark re-sends those entries; if retention
    trimmed them meanwhile (a small MAXLEN, a short TTL), Redis rejects them as below the top
    and holds nothing there. That is our own history, trimmed: the stream stays."""
    expected = await commit(committer, 40)
    await crash_after_second_append(relays, log, batch=20)
    assert (await mark_of(etcd, layout)).last_id == expected[19]
    await writer.xtrim(log.key, maxlen=5, approximate=False)  # retention, exact for the test

    expected += await commit(committer, 5)
    relays.start(log, batch=20)
    await wait_for(lambda: relayed(log, etcd, layout, 10), message="events not relayed")
    entries = await everything(log)
    assert [e.stream_id for e in entries] == expected[35:]
    assert_chain(entries, first_prev=expected[34])
    assert not any(e.type == "EventsGap" for e in entries)
    assert await writer.keys(f"{log.key}:foreign:*") == []
    assert sample(metrics, "foreign_streams_moved") == 0


async def test_foreign_stream_is_moved_aside(
    etcd, layout, metrics, committer, relays, log, writer
) -> None:
    for i in range(3):
        go_event = {"id": str(uuid.uuid4()), "type": "NodeJoined", "nodeId": f"go-{i}",
                    "timestamp": "2026-03-01T12:00:00Z"}  # fmt: skip
        await writer.xadd(log.key, {"data": json.dumps(go_event)})  # Go's "*" ids
    relays.start(log)
    expected = await commit(committer, 5)
    await wait_for(lambda: relayed(log, etcd, layout, 5), message="events not relayed")
    entries = await everything(log)
    assert [e.stream_id for e in entries] == expected
    assert_chain(entries)
    aside = await writer.keys(f"{log.key}:foreign:*")
    assert len(aside) == 1
    assert await writer.xlen(aside[0]) == 3
    assert sample(metrics, "foreign_streams_moved") == 1


async def test_lost_redis_entries_are_reported_by_one_gap(
    etcd, layout, metrics, committer, relays, log, writer
) -> None:
    expected = await commit(committer, 10)
    relay, _ = relays.start(log)
    await wait_for(lambda: relayed(log, etcd, layout, 10), message="events not relayed")
    await relay.aclose()
    await writer.xdel(log.key, *expected[6:])  # Redis "lost" its 4 newest entries
    relays.start(log)

    async def gap_written() -> list[StreamEntry]:
        entries = await everything(log)
        return entries if len(entries) == 7 else []

    entries = await wait_for(gap_written, message="no EventsGap for the lost entries")
    gap = entries[-1]
    assert gap.type == "EventsGap"
    revision, seq = expected[-1].split("-")
    assert gap.stream_id == f"{revision}-{int(seq) + 1}"
    assert gap.prev == expected[5]
    assert gap.details == {"from": f"{expected[5].split('-')[0]}-1", "to": expected[-1]}
    more = await commit(committer, 3)
    await wait_for(lambda: relayed(log, etcd, layout, 10), message="events not relayed")
    entries = await everything(log)
    assert [e.stream_id for e in entries] == [*expected[:6], gap.stream_id, *more]
    assert_chain(entries)


async def test_only_the_election_holder_relays_and_the_other_takes_over(
    etcd, layout, metrics, committer, relays, log
) -> None:
    first, _ = relays.start(log, instance_id="a")
    second, _ = relays.start(log, instance_id="b")
    await wait_for(lambda: "leader" in (first.status, second.status), message="no relay leads")
    assert {first.status, second.status} == {"leader", "standby"}
    leader, standby = (first, second) if first.status == "leader" else (second, first)
    expected = await commit(committer, 10)
    await wait_for(lambda: relayed(log, etcd, layout, 10), message="events not relayed")
    await leader.aclose()
    assert leader.status == "stopped"
    expected += await commit(committer, 10)
    await wait_for(lambda: relayed(log, etcd, layout, 20), message="no takeover")
    assert standby.status == "leader"
    entries = await everything(log)
    assert [e.stream_id for e in entries] == expected
    assert_chain(entries)


async def test_relay_that_loses_its_lease_stops_and_campaigns_again(
    etcd, layout, metrics, committer, relays, log
) -> None:
    relay, _ = relays.start(log)
    expected = await commit(committer, 5)
    await wait_for(lambda: relayed(log, etcd, layout, 5), message="events not relayed")
    old_term = relay.term
    holder = await observe_leader(etcd, layout.relay_election)
    assert holder is not None
    assert holder.value == relay.instance_id.encode()
    await etcd.lease_revoke(holder.lease)  # the lease vanishes behind the relay's back
    await wait_for(lambda: relay.term not in (0, old_term), message="relay did not come back")
    assert relay.status == "leader"
    expected += await commit(committer, 5)
    await wait_for(lambda: relayed(log, etcd, layout, 10), message="events not relayed")
    entries = await everything(log)
    assert [e.stream_id for e in entries] == expected
    assert_chain(entries)


async def test_relay_trims_by_age_but_keeps_the_newest(
    etcd, layout, metrics, committer, relays, log
) -> None:
    relays.start(log, ttl_ms=1)
    expected = await commit(committer, 5)
    await wait_for(lambda: relayed(log, etcd, layout, 1), message="events not relayed")

    async def trimmed() -> bool:
        entries = await everything(log)
        return [e.stream_id for e in entries] == expected[-1:]

    await wait_for(trimmed, message="old entries not trimmed")


# -- marking -----------------------------------------------------------------------------------


async def test_marking_runs_at_most_one_batch_behind_the_stream(
    etcd, layout, metrics, committer, relays, log
) -> None:
    """Marks are written while the next batch is appended, but never more than a batch late.

    ``take_over`` looks for already-written gaps only in the range just after the mark, so the
    unmarked tail of the stream must stay within it: at most the batch being appended.
    """
    unmarked: list[int] = []

    async def measure(ids: Sequence[str]) -> None:
        mark = (await mark_of(etcd, layout)).last_id
        after = await log.range(mark, 1000) if mark else await everything(log)
        unmarked.append(len(after))

    relays.start(log, batch=10, after_append=measure)
    expected: list[str] = []
    for _ in range(10):  # commits arrive while batches are appended and marked
        expected += await commit(committer, 15)
    await wait_for(lambda: relayed(log, etcd, layout, 150), message="events not relayed")
    assert [e.stream_id for e in await everything(log)] == expected
    assert unmarked
    assert max(unmarked) <= 10, unmarked
    assert (await mark_of(etcd, layout)).last_id == expected[-1]


async def test_marks_lag_at_most_two_batches_without_a_hook(
    etcd, layout, metrics, committer, relays, log
) -> None:
    """The production path (no test hook): the marker runs beside the appends, and the relay
    waits for it once more than a batch is unmarked, so what ``take_over`` reads back after a
    crash (two batches past the mark) always covers the unmarked tail.

    The sampler reads the stream before the mark: what it counts is never more than was
    really unmarked at that moment, so a count above the bound is a real violation.
    """
    batch = 10
    worst = 0
    done = asyncio.Event()

    async def sample_unmarked() -> None:
        nonlocal worst
        while not done.is_set():
            top = await log.top()
            mark = (await mark_of(etcd, layout)).last_id
            if top is not None:
                after = await log.range(mark, 1000) if mark else await everything(log)
                worst = max(worst, sum(id_key(e.stream_id) <= id_key(top.stream_id) for e in after))
            await asyncio.sleep(0)

    relays.start(log, batch=batch, mark_interval=5.0)  # pacing would let the tail grow
    sampler = asyncio.create_task(sample_unmarked())
    expected: list[str] = []
    try:
        for _ in range(12):
            expected += await commit(committer, 5, per_change=2)
        await wait_for(lambda: relayed(log, etcd, layout, 120), message="events not relayed")
    finally:
        done.set()
        await sampler
    assert [e.stream_id for e in await everything(log)] == expected
    assert worst <= 2 * batch, worst
    assert (await mark_of(etcd, layout)).last_id == expected[-1]


async def test_marks_are_paced_while_appends_go_on(
    etcd, layout, metrics, committer, relays, log
) -> None:
    """Events that arrive one by one are appended one by one, but their outbox deletes ride
    in at most one mark transaction per ``mark_interval`` (plus the first), not one each."""
    interval = 0.3
    relays.start(log, batch=50, mark_interval=interval)
    loop = asyncio.get_running_loop()
    began = loop.time()
    expected: list[str] = []
    for i in range(30):
        expected += await commit(committer, 1)
        # each event is in the stream before the next is committed: one append each
        await wait_for(lambda n=i + 1: log_has(log, n), message="event not appended")
    await wait_for(lambda: relayed(log, etcd, layout, 30), message="outbox not emptied")
    elapsed = loop.time() - began
    marks = metrics.registry.get_sample_value(
        "persys_scheduler_etcd_txns_total", {"kind": "relay", "result": "committed"}) or 0
    assert [e.stream_id for e in await everything(log)] == expected
    assert marks <= elapsed / interval + 2, (marks, elapsed)
    assert marks < 30
    assert (await mark_of(etcd, layout)).last_id == expected[-1]
