"""Events under faults, with real processes: the relay's holder killed 10 times during a load,
and Redis down for a while during state changes. Every event arrives exactly once, in order."""

from __future__ import annotations

import asyncio

import pytest

from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import control_stub
from tests.fixtures.replicas import ReplicaSet
from tests.fixtures.waiting import wait_for


def _env(etcd, redis, key_root, stream_key) -> dict[str, str]:
    return {"ETCD_ENDPOINTS": etcd.endpoint, "REDIS_ADDR": redis.addr,
            "SCHEDULER_ETCD_ROOT": key_root, "SCHEDULER_EVENT_STREAM": stream_key,
            "SCHEDULER_LEADER_LEASE_TTL": "2", "SCHEDULER_LEADER_RENEW_DEADLINE": "1.2",
            "SCHEDULER_DNS_REGISTRATION": "false", "REDIS_EVENT_MAX_ENTRIES": "100000",
            "LOG_LEVEL": "warning"}


async def _register(stub, node_id: str) -> None:
    resp = await stub.RegisterNode(pb.RegisterNodeRequest(
        node_id=node_id, grpc_endpoint="127.0.0.1:1",
        capabilities=pb.NodeCapabilities(cpu_total_millicores=1000, memory_total_mb=1024)))
    assert resp.accepted, resp.reason


async def _all_labels(stub, node_id: str) -> list[pb.SchedulerEventView]:
    resp = await stub.ListEvents(pb.ListEventsRequest(limit=10_000, node_id=node_id,
                                                      type="NodeLabelSet"))
    return list(resp.events)


@pytest.mark.fault
@pytest.mark.timeout(240)
async def test_relay_holder_killed_ten_times_loses_and_duplicates_nothing(
    etcd_private, redis_private, key_root, stream_key, tmp_path
):
    replicas = ReplicaSet(tmp_path, _env(etcd_private, redis_private, key_root, stream_key))
    try:
        # the relay election is won by whoever campaigns first: start the relay replicas first
        for i in range(2):
            replicas.add(f"relay-{i}").start()
        # serves the load and is never killed; it does not campaign for the relay
        api = replicas.add("api", SCHEDULER_RELAY_ENABLED="false").start()
        async with control_stub(api.address) as stub:
            await _register(stub, "ev-node")
            stop = asyncio.Event()
            written: list[str] = []

            async def load() -> None:
                i = 0
                while not stop.is_set():
                    resp = await stub.SetNodeLabel(pb.SetNodeLabelRequest(
                        node_id="ev-node", key="seq", value=str(i)))
                    assert resp.accepted
                    written.append(str(i))
                    i += 1

            loader = asyncio.create_task(load())
            kills = 0
            try:
                await wait_for(lambda: len(written) >= 20 or loader.done(), timeout=20,
                               message="load running")
                if loader.done():
                    loader.result()
                while kills < 10:
                    holders = await asyncio.to_thread(
                        lambda: [r for r in replicas.replicas if r is not api and r.running()
                                 and r.health().get("relay") == "leader"])
                    if not holders:
                        await asyncio.sleep(0.05)  # allowed: polling for the next holder
                        continue
                    await asyncio.to_thread(holders[0].kill)
                    kills += 1
                    await asyncio.to_thread(replicas.add(f"relay-again-{kills}").start)
                    mark = len(written)
                    await wait_for(lambda mark=mark: len(written) > mark + 5, timeout=20,
                                   message="load continues")
            finally:
                stop.set()
                outcome = await asyncio.gather(loader, return_exceptions=True)
            assert not isinstance(outcome[0], BaseException), outcome
            assert written, "the load made no state change"
            assert kills == 10
        async with control_stub(api.address) as stub2:
            seen = await wait_for(lambda: _complete(stub2, written), timeout=60,
                                  message="every committed event relayed")
            values = [e.details["value"] for e in seen]
            assert values == written, "lost, duplicated or reordered events"
            ids = [tuple(int(p) for p in e.id.split("-")) for e in seen]
            assert ids == sorted(ids)
            assert len(set(ids)) == len(ids)
            print(f"relay killed {kills} times during {len(written)} state changes: "
                  f"all {len(seen)} events exactly once, in order")
    finally:
        replicas.stop_all()


async def _complete(stub, written: list[str]):
    seen = await _all_labels(stub, "ev-node")
    return seen if len(seen) >= len(written) else None


@pytest.mark.fault
@pytest.mark.timeout(240)
async def test_redis_down_during_changes_then_everything_arrives_in_order(
    etcd_private, redis_private, key_root, stream_key, tmp_path
):
    replicas = ReplicaSet(tmp_path, _env(etcd_private, redis_private, key_root, stream_key))
    try:
        api = replicas.add("api").start()
        async with control_stub(api.address) as stub:
            await _register(stub, "rd-node")
            written: list[str] = []
            for i in range(300):
                if i == 100:
                    redis_private.kill()
                if i == 200:
                    redis_private.restart()
                resp = await stub.SetNodeLabel(pb.SetNodeLabelRequest(
                    node_id="rd-node", key="seq", value=str(i)))
                assert resp.accepted, "scheduling must go on while Redis is down"
                written.append(str(i))
            seen = await wait_for(lambda: _complete_for(stub, "rd-node", written), timeout=60,
                                  message="the outbox drained after Redis came back")
            assert [e.details["value"] for e in seen] == written
    finally:
        replicas.stop_all()


async def _complete_for(stub, node_id, written):
    try:
        seen = await _all_labels(stub, node_id)
    except Exception:  # noqa: BLE001 - Redis may still be coming back
        return None
    return seen if len(seen) >= len(written) else None
