"""ListEvents and WatchEvents through the gRPC API, on real etcd and Redis."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import control_stub, make_settings, running_scheduler
from tests.fixtures.waiting import wait_for


async def _register(stub, node_id: str) -> None:
    resp = await stub.RegisterNode(pb.RegisterNodeRequest(
        node_id=node_id, grpc_endpoint="127.0.0.1:1",
        capabilities=pb.NodeCapabilities(cpu_total_millicores=4000, memory_total_mb=8192,
                                          supported_workload_types=["container"])))
    assert resp.accepted, resp.reason


async def _label(stub, node_id: str, i: int) -> None:
    resp = await stub.SetNodeLabel(pb.SetNodeLabelRequest(node_id=node_id, key="seq",
                                                          value=str(i)))
    assert resp.accepted


async def _labels_seen(stub, node_id: str) -> list[str]:
    r = await stub.ListEvents(pb.ListEventsRequest(limit=1000, node_id=node_id,
                                                   type="NodeLabelSet"))
    return [e.details["value"] for e in r.events]


@pytest.fixture
async def api(etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched, control_stub(
        f"127.0.0.1:{sched.grpc_port}"
    ) as stub:
        yield stub


async def test_list_events_filters_before_limit_and_is_ascending(api):
    await _register(api, "ev-a")
    await _register(api, "ev-b")
    for i in range(10):
        await _label(api, "ev-a", i)
        await _label(api, "ev-b", i)
    await wait_for(lambda: _count(api, "ev-a", 10), message="10 events for ev-a")
    r = await api.ListEvents(pb.ListEventsRequest(limit=3, node_id="ev-a", type="NodeLabelSet"))
    assert [e.details["value"] for e in r.events] == ["7", "8", "9"]
    ids = [e.id for e in r.events]
    assert ids == sorted(ids, key=lambda s: tuple(int(p) for p in s.split("-")))
    assert all(e.node_id == "ev-a" for e in r.events)
    assert all("event_id" in e.details for e in r.events)
    joined = await api.ListEvents(pb.ListEventsRequest(type="NodeJoined"))
    assert {e.node_id for e in joined.events} == {"ev-a", "ev-b"}


async def _count(stub, node_id, want):
    return len(await _labels_seen(stub, node_id)) >= want


async def test_watch_replays_then_follows_and_resumes_without_gap_or_duplicate(api):
    await _register(api, "w-node")
    for i in range(5):
        await _label(api, "w-node", i)
    await wait_for(lambda: _count(api, "w-node", 5), message="history relayed")

    received: list[pb.SchedulerEventView] = []
    call = api.WatchEvents(pb.WatchEventsRequest(node_id="w-node", type="NodeLabelSet"))

    async def consume(limit: int) -> None:
        async for event in call:
            received.append(event)
            if len(received) >= limit:
                return

    consumer = asyncio.create_task(consume(8))
    await wait_for(lambda: len(received) >= 5, message="replay")
    for i in range(5, 8):
        await _label(api, "w-node", i)
    await asyncio.wait_for(consumer, 10)
    call.cancel()
    assert [e.details["value"] for e in received] == [str(i) for i in range(8)]
    cursor = received[-1].id

    # while disconnected, more events happen; resuming from the cursor yields exactly those
    for i in range(8, 12):
        await _label(api, "w-node", i)
    resumed: list[pb.SchedulerEventView] = []
    call2 = api.WatchEvents(pb.WatchEventsRequest(node_id="w-node", type="NodeLabelSet",
                                                  after_id=cursor))

    async def consume2() -> None:
        async for event in call2:
            resumed.append(event)
            if len(resumed) >= 6:
                return

    consumer2 = asyncio.create_task(consume2())
    await wait_for(lambda: len(resumed) >= 4, message="missed events")
    for i in range(12, 14):
        await _label(api, "w-node", i)
    await asyncio.wait_for(consumer2, 10)
    call2.cancel()
    assert [e.details["value"] for e in resumed] == [str(i) for i in range(8, 14)]
    assert all(e.type == "NodeLabelSet" for e in resumed)


async def test_bad_cursor_is_invalid_argument(api):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await api.ListEvents(pb.ListEventsRequest(after_id="yesterday"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "after_id" in err.value.details()


async def test_node_watchers_are_indexed_by_node(etcd_server, redis_server, key_root,
                                                 stream_key):
    # an entry costs the replica only its own node's watchers (and the unfiltered ones)
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched, control_stub(
            f"127.0.0.1:{sched.grpc_port}") as stub:
        tailer = sched.tailer
        assert tailer is not None
        await _register(stub, "ix-node")
        calls = [stub.WatchEvents(pb.WatchEventsRequest(node_id="ix-node")),
                 stub.WatchEvents(pb.WatchEventsRequest(type="NodeLabelSet"))]
        received: list[list[str]] = [[], []]

        async def consume(i: int) -> None:
            async for event in calls[i]:
                if event.type == "NodeLabelSet":
                    received[i].append(event.details["value"])

        consumers = [asyncio.create_task(consume(i)) for i in range(2)]
        try:
            await wait_for(lambda: tailer.subscriber_count == 2, message="both subscribed")
            assert set(tailer._by_node) == {"ix-node"}
            assert len(tailer._any_node) == 1
            await _label(stub, "ix-node", 1)
            await wait_for(lambda: received == [["1"], ["1"]], message="both delivered")
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*consumers, return_exceptions=True)
        await wait_for(lambda: tailer.subscriber_count == 0, message="both unsubscribed")
        assert tailer._by_node == {}


async def test_delay_histograms_time_the_relay_and_live_deliveries(etcd_server, redis_server,
                                                                   key_root, stream_key):
    """An operator reads where commit-to-delivery time goes: every relayed event is timed from
    its decision to its append, and every live event a watcher receives to its hand-over. The
    history a watcher replays when it connects is old news, not delivery delay."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched, control_stub(
        f"127.0.0.1:{sched.grpc_port}"
    ) as stub:
        registry = sched.metrics.registry

        def observed(name: str) -> float:
            return registry.get_sample_value(f"persys_scheduler_{name}_count") or 0.0

        await _register(stub, "d-node")
        for i in range(3):
            await _label(stub, "d-node", i)
        await wait_for(lambda: _count(stub, "d-node", 3), message="history relayed")
        # NodeJoined and the three labels, each timed once by the relay
        await wait_for(lambda: observed("event_relay_delay_seconds") >= 4,
                       message="relay delays observed")
        relayed = observed("event_relay_delay_seconds")

        received: list[pb.SchedulerEventView] = []
        call = stub.WatchEvents(pb.WatchEventsRequest(node_id="d-node", type="NodeLabelSet"))

        async def consume() -> None:
            async for event in call:
                received.append(event)
                if len(received) >= 5:
                    return

        consumer = asyncio.create_task(consume())
        await wait_for(lambda: len(received) >= 3, message="history replayed")
        assert observed("event_delivery_delay_seconds") == 0
        for i in range(3, 5):
            await _label(stub, "d-node", i)
        await asyncio.wait_for(consumer, 10)
        call.cancel()
        assert [e.details["value"] for e in received] == [str(i) for i in range(5)]
        assert observed("event_delivery_delay_seconds") == 2
        delivered_s = registry.get_sample_value("persys_scheduler_event_delivery_delay_seconds_sum")
        assert delivered_s is not None
        assert 0 <= delivered_s < 20  # seconds, not milliseconds
        await wait_for(lambda: observed("event_relay_delay_seconds") >= relayed + 2,
                       message="the live events' relay delays observed")
