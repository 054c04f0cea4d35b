"""Events on Redis under Sentinel, against real processes: a master, two replicas and three
Sentinels (``tests/fixtures/sentinel.py``), real etcd, in-process scheduler replicas.

What is shown: the settings are validated; an append is counted only once a replica holds it
(``WAIT``); with the master killed (``kill -9``) or paused (SIGSTOP) past Sentinel's down-after
time during 1,000 state changes, the promoted master's stream holds every event once, in
commit order, live WatchEvents clients of two replicas receive each once, and no scheduler is
restarted; an entry truly lost with its master becomes an ``EventsGap``. Run with ``-s`` for the
figures: the longest delay of an event across the failover, events re-appended, lost,
duplicated.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis

from eventsource.events import Event, entry_data
from eventsource.stream.clients import writer_client
from eventsource.stream.entries import ZERO_ID
from eventsource.stream.errors import RedisUnavailable, ReplicasBehind
from eventsource.stream.eventlog import RedisEventLog
from eventsource.stream.replicas import ReplicaWait
from eventsource.stream.sentinel import MasterWatch, SentinelTarget, parse_sentinels
from eventsource.stream.tailer import StreamTailer
from handlers.api.events import EventService
from handlers.app.server import Scheduler
from handlers.nodes.usage import heartbeat_key_prefix
from handlers.settings.config import Settings, load_settings
from handlers.settings.reader import ConfigError
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import control_stub, make_settings, running_scheduler, serving_fleet
from tests.fixtures.relay import everything
from tests.fixtures.sentinel import MASTER_NAME, SentinelGroup
from tests.fixtures.waiting import wait_for

CHANGES = 1000


@pytest.fixture
def sentinel_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    """A master, two replicas and three Sentinels (down-after 1 s, failover-timeout 5 s)."""
    group = SentinelGroup(tmp_path_factory.mktemp("sentinel"))
    try:
        yield group.start()
    finally:
        group.stop()


@pytest.fixture
def held_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    """``sentinel_group`` whose replicas replicate through links the test can hold."""
    group = SentinelGroup(tmp_path_factory.mktemp("sentinel-held"), held_links=True)
    try:
        yield group.start()
    finally:
        group.stop()


# -- settings -----------------------------------------------------------------------------------
def _load(**env: str) -> Settings:
    return load_settings({"ETCD_ENDPOINTS": "127.0.0.1:2379", **env}, insecure=True)


def test_without_the_new_variables_nothing_changes() -> None:
    plain = _load(REDIS_ADDR="127.0.0.1:6379")
    assert plain.redis_sentinels == ()
    assert plain.sentinel_target is None
    assert plain.replica_acks == (False, None)
    assert plain.events_enabled
    assert not _load().events_enabled


def test_sentinel_settings_are_read() -> None:
    s = _load(REDIS_SENTINELS="10.0.0.1:26379, sentinel-b:26380,[::1]:26381",
              REDIS_SENTINEL_MASTER="events", REDIS_SENTINEL_PASSWORD="s3cret",
              REDIS_PASSWORD="p/w%", REDIS_DB="2")
    assert s.redis_sentinels == (("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 26381))
    assert s.events_enabled
    assert s.replica_acks == (True, None)  # 1 while the master has a replica
    target = s.sentinel_target
    assert target == SentinelTarget(s.redis_sentinels, "events", password="p/w%", db=2,
                                    sentinel_password="s3cret")
    assert target.min_other_sentinels == 1
    assert "s3cret" not in repr(s)
    assert _load(REDIS_SENTINELS="a:1", REDIS_SENTINEL_MASTER="m",
                 REDIS_MIN_REPLICAS_ACK="2").replica_acks == (True, 2)
    assert _load(REDIS_SENTINELS="a:1", REDIS_SENTINEL_MASTER="m",
                 REDIS_MIN_REPLICAS_ACK="0").replica_acks == (False, 0)
    # one Redis at one address waits only when asked to
    assert _load(REDIS_ADDR="r:6379", REDIS_MIN_REPLICAS_ACK="1").replica_acks == (True, 1)


@pytest.mark.parametrize(("env", "names"), [
    ({"REDIS_SENTINELS": "a:1,b"}, "REDIS_SENTINELS"),
    ({"REDIS_SENTINELS": "a:0", "REDIS_SENTINEL_MASTER": "m"}, "REDIS_SENTINELS"),
    ({"REDIS_SENTINELS": "a:1,,b:2", "REDIS_SENTINEL_MASTER": "m"}, "REDIS_SENTINELS"),
    ({"REDIS_SENTINELS": "a:1"}, "REDIS_SENTINEL_MASTER"),
    ({"REDIS_SENTINEL_MASTER": "m"}, "REDIS_SENTINEL_MASTER"),
    ({"REDIS_SENTINEL_PASSWORD": "x"}, "REDIS_SENTINEL_PASSWORD"),
    ({"REDIS_SENTINELS": "a:1", "REDIS_SENTINEL_MASTER": "m", "REDIS_ADDR": "r:1"},
     "REDIS_ADDR/REDIS_SENTINELS"),
    ({"REDIS_ADDR": "r:1", "REDIS_MIN_REPLICAS_ACK": "-1"}, "REDIS_MIN_REPLICAS_ACK"),
    ({"REDIS_ADDR": "r:1", "REDIS_MIN_REPLICAS_ACK": "one"}, "REDIS_MIN_REPLICAS_ACK"),
])
def test_invalid_sentinel_settings_name_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=f"^{names}:"):
        _load(**env)


# -- helpers ------------------------------------------------------------------------------------
def _settings(etcd: Any, group: SentinelGroup, key_root: str, stream_key: str,
              **overrides: Any) -> Settings:
    return make_settings(etcd, None, key_root, stream_key,
                         redis_sentinels=parse_sentinels(group.sentinel_addrs),
                         redis_sentinel_master=MASTER_NAME, redis_event_max_entries=100_000,
                         **overrides)


@contextlib.asynccontextmanager
async def _master_log(group: SentinelGroup, stream_key: str) -> AsyncIterator[RedisEventLog]:
    """A log of the stream on whichever server is master (a client of the test's own)."""
    watch = MasterWatch(SentinelTarget(parse_sentinels(group.sentinel_addrs), MASTER_NAME))
    client = watch.client(socket_timeout=2.0, connect_timeout=2.0)
    try:
        yield RedisEventLog(client, stream_key, op_timeout=5.0)
    finally:
        await client.aclose()
        await watch.aclose()


def _sample(scheduler: Scheduler, name: str, labels: dict[str, str] | None = None) -> float:
    value = scheduler.metrics.registry.get_sample_value(f"persys_scheduler_{name}", labels or {})
    return value or 0.0


@dataclass
class Watcher:
    """A WatchEvents client that resumes by cursor after UNAVAILABLE, as clients should."""

    address: str
    filters: dict[str, str]
    #: (value of the label, stream id, wall time received)
    seen: list[tuple[str, str, float]] = field(default_factory=list)
    gaps: list[pb.SchedulerEventView] = field(default_factory=list)
    reconnects: int = 0
    #: the id of the last view received: a new ``run`` resumes after it
    cursor: str = ""
    _task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        async with control_stub(self.address) as stub:
            while True:
                call = stub.WatchEvents(pb.WatchEventsRequest(after_id=self.cursor,
                                                              **self.filters))
                try:
                    async for view in call:
                        self.cursor = view.id
                        if view.type == "EventsGap":
                            self.gaps.append(view)
                        elif view.type == "NodeLabelSet" and view.details.get("key") == "seq":
                            self.seen.append((view.details["value"], view.id, time.time()))
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or self.reconnects > 10_000:
                        raise
                    self.reconnects += 1
                    # a client that resumes at once: the scheduler answers UNAVAILABLE quickly
                    # while Redis is away, and the next try carries the cursor

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"watcher-{self.address}")

    def failed(self) -> bool:
        return self._task is not None and self._task.done()

    async def stop(self) -> None:
        """Cancel the watch; a failure of it (other than the cancel) is raised here."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        if isinstance(outcome, BaseException) and not isinstance(outcome,
                                                                  asyncio.CancelledError):
            raise outcome


@contextlib.asynccontextmanager
async def _watching(watchers: list[Watcher], subscribed: Callable[[], bool]
                    ) -> AsyncIterator[None]:
    """The watchers running, once ``subscribed`` says the schedulers have them all."""
    for w in watchers:
        w.start()
    try:
        await wait_for(lambda: subscribed() or any(w.failed() for w in watchers), timeout=20,
                       message="watchers subscribed")
        yield
    finally:
        for w in watchers:
            await w.stop()


@dataclass
class Figures:
    longest_delay_s: float
    reappended: float
    lost: int
    duplicated: int
    reconnects: int
    failover_s: float
    #: changes committed between the fault and the promotion
    during: int


async def _changes_across_a_failover(
    etcd: Any, group: SentinelGroup, key_root: str, stream_key: str,
    fail: Callable[[SentinelGroup, str], None], recover: Callable[[SentinelGroup, str], None],
) -> Figures:
    """1,000 SetNodeLabel calls; ``fail`` hits the master after 200, ``recover`` runs once
    Sentinel promoted a replica. Checks everything the module docstring says."""
    settings = _settings(etcd, group, key_root, stream_key, instance_id="replica-a")
    other = _settings(etcd, group, key_root, stream_key, instance_id="replica-b",
                      relay_enabled=False)
    async with serving_fleet(settings, 1) as (sched_a, fleet, stub), \
            running_scheduler(other) as sched_b:
        await wait_for(lambda: sched_a.relay is not None and sched_a.relay.status == "leader",
                       timeout=20, message="replica-a relays")
        node = fleet.nodes[0].node_id
        address_b = f"127.0.0.1:{sched_b.grpc_port}"
        address_a = f"127.0.0.1:{sched_a.grpc_port}"
        watchers = [Watcher(address_a, {"type": "NodeLabelSet"}),
                    Watcher(address_a, {"node_id": node}),
                    Watcher(address_b, {"type": "NodeLabelSet"}),
                    Watcher(address_b, {"node_id": node})]
        old_master = group.master_addr()
        assert old_master is not None
        tailers = (sched_a.tailer, sched_b.tailer)
        assert tailers[0] is not None
        assert tailers[1] is not None
        answered: dict[str, float] = {}
        promotion: asyncio.Task[str] | None = None
        during = 0
        async with _watching(watchers, lambda: all(t.subscriber_count >= 2 for t in tailers)):
            for i in range(CHANGES):
                if i == 200:
                    await asyncio.to_thread(fail, group, old_master)
                    promotion = asyncio.create_task(
                        asyncio.to_thread(group.wait_promoted, old_master))
                if i == 800:
                    # the last 200 go to the new master: changes before, during, after
                    assert promotion is not None
                    await promotion
                if promotion is not None and not promotion.done():
                    during += 1
                resp = await stub.SetNodeLabel(pb.SetNodeLabelRequest(
                    node_id=node, key="seq", value=str(i)), timeout=10)
                assert resp.accepted, resp
                answered[str(i)] = time.time()
            assert promotion is not None
            new_master = await promotion
            promoted_ms = time.time() * 1000
            failover_s = group.last_failover_s
            await asyncio.to_thread(recover, group, old_master)
            expected = [str(i) for i in range(CHANGES)]
            await wait_for(lambda: all(len(w.seen) >= CHANGES for w in watchers), timeout=90,
                           message="every watcher received every change")
        # the promoted master's stream: every event once, in commit order, nothing lost; and
        # usage telemetry followed too: the node's heartbeat time is written to the new master
        heartbeat_key = f"{heartbeat_key_prefix(key_root)}{node}"
        async with _master_log(group, stream_key) as log:
            entries = await everything(log)
            client = log._client

            async def beat_after_failover() -> bool:
                stored = await client.get(heartbeat_key)  # "<ms>" or "<ms> <cpu> <mem>"
                return stored is not None and int(stored.split()[0]) > promoted_ms

            await wait_for(beat_after_failover, timeout=20,
                           message="heartbeat times written to the new master")
        labels = [e for e in entries if e.type == "NodeLabelSet" and e.details.get("key") == "seq"]
        values = [e.details["value"] for e in labels]
        assert values == expected, "lost, duplicated or reordered events in the stream"
        ids = [tuple(int(p) for p in e.stream_id.split("-")) for e in entries]
        assert ids == sorted(ids)
        assert len(set(ids)) == len(ids)
        assert len({e.event_id for e in entries}) == len(entries)
        assert [e for e in entries if e.type == "EventsGap"] == []
        prev = ZERO_ID
        for entry in entries:
            assert entry.prev == prev, f"{entry.stream_id}: prev {entry.prev} != {prev}"
            prev = entry.stream_id
        # live watchers of both replicas: each event once, in order, no gap
        for w in watchers:
            assert [v for v, _, _ in w.seen] == expected, f"watcher {w.filters} of {w.address}"
            assert w.gaps == []
        # neither scheduler was restarted, and both followed the failover: to the master
        # Sentinel names now, which is a later one when Sentinel failed over again (its 1 s
        # down-after can pass on a loaded machine; the checks above held across both)
        current = await asyncio.to_thread(group.master_addr)
        assert current is not None
        assert current != old_master
        if current != new_master:
            print(f"Sentinel failed over again: {old_master} -> {new_master} -> {current}")

        def following(sched: Scheduler) -> bool:
            assert sched.redis_clients is not None
            assert sched.redis_clients.master is not None
            return sched.redis_clients.master.master == current

        await wait_for(lambda: following(sched_a) and following(sched_b), timeout=10,
                       message=f"both schedulers follow the master Sentinel names ({current})")
        for sched in (sched_a, sched_b):
            assert _sample(sched, "redis_failovers_total") >= 1
            assert _sample(sched, "redis_master", {"address": current}) == 1
            assert _sample(sched, "redis_master", {"address": old_master}) == 0
        assert sched_a.relay.status == "leader"
        assert _sample(sched_a, "event_replica_waits_total", {"result": "confirmed"}) > 0
        longest = max(received - answered[v] for w in watchers for v, _, received in w.seen)
        received_values = [[v for v, _, _ in w.seen] for w in watchers]
        return Figures(
            longest_delay_s=longest,
            reappended=_sample(sched_a, "events_reappended_total"),
            lost=sum(CHANGES - len(set(values)) for values in received_values),
            duplicated=sum(len(values) - len(set(values)) for values in received_values),
            reconnects=sum(w.reconnects for w in watchers),
            failover_s=failover_s,
            during=during,
        )


def _report(what: str, figures: Figures) -> None:
    print(f"\n{what}: {CHANGES} changes ({figures.during} between the fault and the "
          f"promotion), 4 live watchers on 2 replicas; Sentinel promoted a "
          f"replica {figures.failover_s:.2f}s after the fault; longest delay of an event "
          f"(commit answered -> received by a watcher) {figures.longest_delay_s:.2f}s; "
          f"re-appended {figures.reappended:.0f}; lost {figures.lost}; duplicated "
          f"{figures.duplicated}; watcher reconnects {figures.reconnects}")


# -- appends wait for a replica -----------------------------------------------------------------
@pytest.mark.fault
@pytest.mark.timeout(120)
async def test_an_append_counts_only_once_a_replica_holds_it(sentinel_group, stream_key):
    group = sentinel_group
    master = group.master()
    replicas = [s for s in group.servers if s is not master]
    async with _master_log(group, stream_key) as log:
        client = log._client
        wait = ReplicaWait(1, timeout_ms=200)
        first = [(f"5-{i}", f'{{"eventId":"e{i}","type":"T","seq":{i}}}') for i in range(3)]
        result = await log.append_batch(first, maxlen=0, wait=wait)
        assert result.added == 3
        for replica in replicas:
            replica.pause()
        try:
            more = [(f"6-{i}", f'{{"eventId":"f{i}","type":"T","seq":{i}}}') for i in range(3)]
            with pytest.raises(ReplicasBehind):
                await log.append_batch(more, maxlen=0, wait=wait)
            assert await log.length() == 6  # on the master, only not yet safe
            # again, all already present: nothing written on the connection, still short
            with pytest.raises(ReplicasBehind):
                await log.append_batch(more, maxlen=0, wait=wait)
            # unset: the replicas are connected (only slow), so it waits for one too
            with pytest.raises(ReplicasBehind):
                await log.append_batch(more, maxlen=0, wait=ReplicaWait(None, timeout_ms=200))
        finally:
            for replica in replicas:
                replica.resume()
        again = await log.append_batch(more, maxlen=0, wait=ReplicaWait(1, timeout_ms=2000))
        assert again.added == 0
        assert again.present == {"6-0", "6-1", "6-2"}
        assert isinstance(client, aioredis.Redis)


# -- failovers during state changes -------------------------------------------------------------
def _kill(group: SentinelGroup, addr: str) -> None:
    group.server_at(addr).kill()


def _restart_as_replica(group: SentinelGroup, addr: str) -> None:
    """The killed master comes back; Sentinel turns it into a replica of the new one."""
    group.server_at(addr).restart()


def _pause(group: SentinelGroup, addr: str) -> None:
    group.server_at(addr).pause()


def _resume(group: SentinelGroup, addr: str) -> None:
    group.server_at(addr).resume()


@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_master_killed_during_1000_changes_nothing_lost_or_duplicated(
    etcd_server, sentinel_group, key_root, stream_key
):
    figures = await _changes_across_a_failover(etcd_server, sentinel_group, key_root,
                                               stream_key, _kill, _restart_as_replica)
    _report("master kill -9", figures)
    assert figures.lost == 0
    assert figures.duplicated == 0


@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_master_paused_past_down_after_nothing_lost_or_duplicated(
    etcd_server, sentinel_group, key_root, stream_key
):
    figures = await _changes_across_a_failover(etcd_server, sentinel_group, key_root,
                                               stream_key, _pause, _resume)
    _report("master SIGSTOP", figures)
    assert figures.lost == 0
    assert figures.duplicated == 0


# -- what no replica held when the master died -------------------------------------------------
async def _outbox_size(sched: Scheduler) -> int:
    return (await sched.etcd.range_prefix(sched.layout.outbox_prefix, count_only=True)).count


@dataclass
class LossWindow:
    """What ``_master_dies_with_unreplicated_events`` saw."""

    entries: list[Any]
    watcher: Watcher
    #: a watcher that was away during the failover and resumed by cursor after it
    resumer: Watcher
    #: the values of the changes made while no replica received anything
    unreplicated: list[str]
    expected: list[str]
    reappended: float


async def _master_dies_with_unreplicated_events(
    etcd: Any, group: SentinelGroup, key_root: str, stream_key: str, *,
    min_acks: int | None, before: int = 20, window: int = 50, after: int = 20,
) -> LossWindow:
    """Changes relayed normally; then ``window`` changes while the replication links are held
    (the master has them, no replica does); the master killed, Sentinel promotes a replica;
    ``after`` more changes. Returns the new master's stream and a watcher's
    view."""
    settings = _settings(etcd, group, key_root, stream_key, redis_min_replicas_ack=min_acks)
    async with serving_fleet(settings, 1) as (sched, fleet, stub):
        node = fleet.nodes[0].node_id
        watcher = Watcher(f"127.0.0.1:{sched.grpc_port}", {"type": "NodeLabelSet"})
        # gone during the failover, back with its cursor as soon as the replica is promoted
        resumer = Watcher(f"127.0.0.1:{sched.grpc_port}", {"type": "NodeLabelSet"})
        tailer = sched.tailer
        assert tailer is not None
        values = [str(i) for i in range(before + window + after)]

        async def change(value: str) -> None:
            resp = await stub.SetNodeLabel(pb.SetNodeLabelRequest(
                node_id=node, key="seq", value=value), timeout=10)
            assert resp.accepted, resp

        async with _watching([watcher, resumer], lambda: tailer.subscriber_count >= 2):
            for value in values[:before]:
                await change(value)
            await wait_for(lambda: len(watcher.seen) >= before, timeout=20,
                           message="the first changes delivered")
            await wait_for(lambda: _drained(sched), timeout=20, message="first changes relayed")
            old = group.master()
            group.hold_replication()
            for value in values[before:before + window]:
                await change(value)
            # the master has them (its watchers were sent them), no replica does
            await wait_for(lambda: len(watcher.seen) >= before + window
                           and len(resumer.seen) >= before + window, timeout=20,
                           message="the window's changes delivered from the old master")
            if min_acks == 0:
                # removed from the outbox on the master's word
                await wait_for(lambda: _drained(sched), timeout=20,
                               message="relayed without waiting for a replica")
            else:
                await wait_for(lambda: _sample(sched, "event_replica_waits_total",
                                               {"result": "short"}) >= 1, timeout=20,
                               message="a wait for a replica came up short")
                assert await _outbox_size(sched) == window
            await resumer.stop()
            await asyncio.to_thread(old.kill)
            await asyncio.to_thread(group.wait_promoted, old.addr)
            resumer.start()  # after the window's last id, which the new master lacks yet
            await asyncio.to_thread(old.restart)  # back as a replica of the new master
            for value in values[before + window:]:
                await change(value)
            await wait_for(lambda: all(w.seen and w.seen[-1][0] == values[-1]
                                       for w in (watcher, resumer)),
                           timeout=60, message="the last change delivered")
        async with _master_log(group, stream_key) as log:
            entries = await everything(log)
        return LossWindow(entries=entries, watcher=watcher, resumer=resumer,
                          unreplicated=values[before:before + window], expected=values,
                          reappended=_sample(sched, "events_reappended_total"))


async def _drained(sched: Scheduler) -> bool:
    return await _outbox_size(sched) == 0


def _label_values(entries: list[Any]) -> list[str]:
    return [e.details["value"] for e in entries
            if e.type == "NodeLabelSet" and e.details.get("key") == "seq"]


@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_events_no_replica_held_are_appended_again_on_the_new_master(
    etcd_server, held_group, key_root, stream_key
):
    seen = await _master_dies_with_unreplicated_events(
        etcd_server, held_group, key_root, stream_key, min_acks=None)
    # the new master lacked the window's events; the relay appended them again, once each
    assert _label_values(seen.entries) == seen.expected
    assert [e for e in seen.entries if e.type == "EventsGap"] == []
    assert seen.reappended == len(seen.unreplicated)
    for w in (seen.watcher, seen.resumer):
        assert [v for v, _, _ in w.seen] == seen.expected
        assert w.gaps == []
    print(f"\nmaster killed with {len(seen.unreplicated)} events on no replica: re-appended "
          f"{seen.reappended:.0f}, lost 0, duplicated 0")


@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_events_lost_with_the_master_are_marked_by_a_gap(
    etcd_server, held_group, key_root, stream_key
):
    # REDIS_MIN_REPLICAS_ACK=0: the relay takes the master's word, so what no replica held
    # is gone with it; the new master's stream says so instead of skipping it silently
    seen = await _master_dies_with_unreplicated_events(
        etcd_server, held_group, key_root, stream_key, min_acks=0)
    kept = [v for v in seen.expected if v not in seen.unreplicated]
    assert _label_values(seen.entries) == kept
    gaps = [e for e in seen.entries if e.type == "EventsGap"]
    assert len(gaps) == 1
    gap = gaps[0]
    assert gap.reason == "redis-lost-entries"
    lost_ids = [v[1] for v in seen.watcher.seen if v[0] in seen.unreplicated]
    key = lambda i: tuple(int(p) for p in i.split("-"))  # noqa: E731
    assert key(gap.details["from"]) <= key(lost_ids[0])
    assert key(gap.details["to"]) >= key(lost_ids[-1])
    # the live watcher had them from the old master, and is told of the loss too
    for w in (seen.watcher, seen.resumer):
        assert [v for v, _, _ in w.seen] == seen.expected
        assert [g.id for g in w.gaps] == [gap.stream_id]
    assert seen.reappended == 0


# -- Sentinels with a password -------------------------------------------------------------------
@pytest.mark.timeout(120)
async def test_sentinels_with_a_password(etcd_server, tmp_path, key_root, stream_key):
    group = SentinelGroup(tmp_path, replicas=1, sentinel_password="s3/cr%t")
    await asyncio.to_thread(group.start)
    try:
        settings = _settings(etcd_server, group, key_root, stream_key,
                             redis_sentinel_password="s3/cr%t")
        async with serving_fleet(settings, 1) as (sched, fleet, stub):
            node = fleet.nodes[0].node_id
            for i in range(5):
                resp = await stub.SetNodeLabel(pb.SetNodeLabelRequest(
                    node_id=node, key="seq", value=str(i)), timeout=10)
                assert resp.accepted

            async def listed() -> list[str]:
                resp = await stub.ListEvents(pb.ListEventsRequest(type="NodeLabelSet",
                                                                  limit=100))
                return [e.details["value"] for e in resp.events]

            await wait_for(lambda: _listed_all(listed, 5), timeout=20,
                           message="events relayed through the Sentinels' master")
            assert sched.redis_clients is not None
            assert sched.redis_clients.master is not None
            assert sched.redis_clients.master.master == group.master_addr()
        # a wrong password finds no master: the clients say so instead of hanging
        wrong = MasterWatch(SentinelTarget(parse_sentinels(group.sentinel_addrs), MASTER_NAME,
                                           sentinel_password="wrong"))
        try:
            with pytest.raises(RedisUnavailable):
                await wrong.discover()
        finally:
            await wrong.aclose()
    finally:
        await asyncio.to_thread(group.stop)


async def _listed_all(listed: Callable[[], Any], count: int) -> bool:
    return await listed() == [str(i) for i in range(count)]


# -- a cursor a new master does not hold yet ----------------------------------------------------
def _entry(revision: int, prev: str) -> tuple[str, str]:
    event = Event(type="NodeLabelSet", node_id="n", details={"key": "seq",
                                                             "value": str(revision)})
    return f"{revision}-0", entry_data(event.outbox_record(seq=0), revision=revision, prev=prev)


@pytest.mark.parametrize("catch_up_s", [0.0, 3.0])
async def test_a_cursor_ahead_of_a_new_master_waits_for_the_relay(
    redis_server, stream_key, catch_up_s
):
    """A client was sent 5-0..7-0 by the old master and resumes after 6-0; the new master
    holds 5-0 until the relay appends 6-0 and 7-0 again. With ``catch_up_s`` (Sentinel) the
    client gets 7-0 once; without (one Redis, where a cursor ahead means lost data) it is
    told of a gap at once, as before."""
    client = writer_client(redis_server.url)
    tailer = StreamTailer.from_url(redis_server.url, stream_key)
    log = RedisEventLog(client, stream_key)
    try:
        await log.append_batch([_entry(5, ZERO_ID)], maxlen=0)
        await tailer.start()
        service = EventService(log, tailer, catch_up_s=catch_up_s)
        views = aiter(service.watch_events(pb.WatchEventsRequest(after_id="6-0"),
                                           context=None))  # type: ignore[arg-type]
        first = asyncio.ensure_future(anext(views))
        done, _ = await asyncio.wait({first}, timeout=0.5)
        if catch_up_s:
            assert not done, "answered before the stream reached the cursor"
        await log.append_batch([_entry(6, "5-0"), _entry(7, "6-0")], maxlen=0)
        view = await asyncio.wait_for(first, 10)
        if catch_up_s:
            assert (view.type, view.id) == ("NodeLabelSet", "7-0")
        else:
            assert view.type == "EventsGap"
            assert view.details["cause"] == "cursor-ahead"
        await views.aclose()  # type: ignore[attr-defined]
    finally:
        await tailer.aclose()
        await client.aclose()
