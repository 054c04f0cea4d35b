"""Replay: projections rebuilt from etcd at a revision equal the live ones; event views too."""

from __future__ import annotations

from eventsource.stream.clients import redis_url, writer_client
from eventsource.stream.eventlog import RedisEventLog
from ops.cli import build_parser
from ops.replay import (
    check_invariants,
    cluster_snapshot,
    rebuild_cluster,
    rebuild_events,
    replay,
)
from projections.event_views import EventView, ViewFilter
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    container_spec,
    control_stub,
    make_settings,
    running_fleet,
    running_scheduler,
)
from tests.fixtures.waiting import wait_for


async def test_rebuilt_projection_and_event_view_equal_the_live_ones(
    etcd_server, redis_server, key_root, stream_key
):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 4) as fleet, control_stub(address) as stub:
            await fleet.wait_registered()
            for i in range(12):
                resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                    workload_id=f"rp-{i}", spec=container_spec(cpu_m=200, mem_mb=128)))
                assert resp.success, resp.error_message
            await stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id="rp-3"))
            await wait_for(lambda: sched.cluster.specs.get("rp-3") is None, timeout=10,
                           message="rp-3 finalised")
        # the fleet is gone; let liveness keys expire? no: compare at one pinned revision
        revision = await sched.etcd.current_revision()
        await sched.cluster.wait_for(revision, timeout=10)
        live = cluster_snapshot(sched.cluster)
        rebuilt = await rebuild_cluster(sched.etcd, sched.layout, revision)
        assert cluster_snapshot(rebuilt) == live
        assert check_invariants(rebuilt) == []

        assert sched.event_log is not None
        await wait_for(lambda: _outbox_empty(sched), timeout=10, message="outbox relayed")
        replayed = await rebuild_events(sched.event_log)
        live_view = EventView()
        live_view.extend(await sched.event_log.range(None, 10_000))
        assert replayed.snapshot() == live_view.snapshot()
        scheduled = replayed.newest(ViewFilter(type="WorkloadScheduled"), 100)
        assert {e.workload_id for e in scheduled} == {f"rp-{i}" for i in range(12)}
        assert [e.workload_id for e in replayed.newest(ViewFilter(type="WorkloadDeleted"),
                                                        10)] == ["rp-3"]


async def _outbox_empty(sched) -> bool:
    kvs, _ = await sched.etcd.list_prefix(sched.layout.outbox_prefix)
    return not kvs


def test_event_view_is_bounded_and_ignores_replays():
    from eventsource.events import StreamEntry

    def entry(i: int, node: str) -> StreamEntry:
        return StreamEntry(stream_id=f"{i}-0", event_id=f"e{i}", type="NodeLabelSet",
                           workload_id="", node_id=node, reason="", timestamp="", details={},
                           revision=i, seq=0, ts=i, prev=f"{i - 1}-0" if i > 1 else "")

    view = EventView(capacity=5)
    for i in range(1, 11):
        view.add(entry(i, "a" if i % 2 else "b"))
    assert not view.add(entry(7, "a"))
    assert [e.stream_id for e in view.entries] == [f"{i}-0" for i in range(6, 11)]
    assert [e.stream_id for e in view.newest(ViewFilter(node_id="a"), 10)] == ["7-0", "9-0"]
    assert not view.complete
    assert isinstance(RedisEventLog, type)


def test_a_bad_redis_db_breaks_only_replay(monkeypatch) -> None:
    """REDIS_DB is read by replay's option; a bad value must not break every subcommand."""
    monkeypatch.setenv("REDIS_DB", "")
    assert build_parser().parse_args(["replay"]).redis_db == 0
    monkeypatch.setenv("REDIS_DB", "abc")
    assert build_parser().parse_args(["serve"]).command == "serve"


async def test_replay_answers_what_it_could_not_check_with_exit_2(etcd_server, capsys) -> None:
    parser = build_parser()
    assert await replay(parser.parse_args(["replay", "--etcd", "127.0.0.1:1"])) == 2
    assert "could not read the state" in capsys.readouterr().err
    assert await replay(parser.parse_args(["replay", "--revision", "-5"])) == 2
    ahead = ["replay", "--etcd", etcd_server.endpoint, "--revision", "999999999"]
    assert await replay(parser.parse_args(ahead)) == 2
    assert "ahead of etcd's current revision" in capsys.readouterr().err


def test_redis_urls_take_the_password_as_is() -> None:
    url = redis_url("h:6379", "Zk3s9/Qx+7=#a%41?", 2)
    assert url.endswith("@h:6379/2")
    pool = writer_client(url).connection_pool
    assert pool.connection_kwargs["password"] == "Zk3s9/Qx+7=#a%41?"
