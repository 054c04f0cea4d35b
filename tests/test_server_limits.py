"""WatchEvents in all and per caller identity (RESOURCE_EXHAUSTED beyond, a closed watcher
gives its place back), against a real scheduler; with mTLS, identities are certificates."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from handlers.app.grpc_limits import connection_options
from handlers.settings.config import Settings, load_settings
from handlers.settings.reader import ConfigError
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import control_stub, make_settings, running_scheduler
from tests.fixtures.waiting import wait_for
from tests.test_agent_identity import pki, settings_for, stub  # noqa: F401 - pki is a fixture


def test_connection_options_follow_the_settings() -> None:
    options = dict(connection_options(Settings(grpc_max_concurrent_streams=7,
                                               grpc_max_connection_age_s=60.0)))
    assert options["grpc.max_concurrent_streams"] == 7
    assert options["grpc.http.overload_protection"] == 1
    assert options["grpc.max_connection_age_ms"] == 60_000
    assert options["grpc.max_connection_idle_ms"] == 1_800_000
    assert "grpc.max_connection_age_ms" not in dict(connection_options(Settings()))


@pytest.mark.parametrize("name", ["SCHEDULER_WATCH_MAX", "SCHEDULER_WATCH_MAX_PER_CALLER",
                                  "SCHEDULER_GRPC_MAX_CONCURRENT_STREAMS"])
def test_limits_are_validated(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_settings({name: "0"}, insecure=True)


async def _refused(watch: grpc.aio.UnaryStreamCall, setting: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in watch:
            pass
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert setting in (caught.value.details() or "")


async def test_watchers_are_bounded_per_caller_and_in_all(etcd_server, redis_server, key_root,
                                                          stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             watch_max=3, watch_max_per_caller=2)
    async with running_scheduler(settings) as sched, \
            control_stub(f"127.0.0.1:{sched.grpc_port}") as client:
        limits = sched.servicer.watch_limits
        first = [client.WatchEvents(pb.WatchEventsRequest()) for _ in range(2)]
        await wait_for(lambda: limits.open == 2, message="two watchers open")
        await _refused(client.WatchEvents(pb.WatchEventsRequest()),
                       "SCHEDULER_WATCH_MAX_PER_CALLER=2")
        first[0].cancel()
        await wait_for(lambda: limits.open == 1, message="a closed watcher gives its place back")
        again = client.WatchEvents(pb.WatchEventsRequest())
        await wait_for(lambda: limits.open == 2, message="its place taken again")
        # the other RPCs are answered meanwhile
        await client.GetClusterSummary(pb.GetClusterSummaryRequest(), timeout=5)
        for call in (first[1], again):
            call.cancel()
        await wait_for(lambda: limits.open == 0, message="all closed")


async def test_watcher_identities_are_certificates(pki, etcd_server, redis_server,  # noqa: F811
                                                   key_root, stream_key) -> None:
    s = settings_for(pki, etcd_server, redis_server, key_root, stream_key,
                     watch_max=3, watch_max_per_caller=1)
    dashboard = pki.ca.issue("dashboard")
    async with running_scheduler(s) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        limits = sched.servicer.watch_limits
        op_ch, operator = stub(address, pki, pki.operator)
        dash_ch, dash = stub(address, pki, dashboard)
        third_ch, third = stub(address, pki, pki.ca.issue("automation"))
        try:
            mine = operator.WatchEvents(pb.WatchEventsRequest())
            theirs = dash.WatchEvents(pb.WatchEventsRequest())
            await wait_for(lambda: limits.open == 2, message="one watcher per certificate")
            await _refused(operator.WatchEvents(pb.WatchEventsRequest()),
                           "SCHEDULER_WATCH_MAX_PER_CALLER=1")
            assert "CN=persysctl" in (await _details(operator))
            extra = third.WatchEvents(pb.WatchEventsRequest())
            await wait_for(lambda: limits.open == 3, message="a third identity")
            fourth = pki.ca.issue("fourth")
            four_ch, four = stub(address, pki, fourth)
            try:
                await _refused(four.WatchEvents(pb.WatchEventsRequest()),
                               "SCHEDULER_WATCH_MAX=3")
            finally:
                await four_ch.close()
            for call in (mine, theirs, extra):
                call.cancel()
            await wait_for(lambda: limits.open == 0, message="all closed")
        finally:
            await asyncio.gather(op_ch.close(), dash_ch.close(), third_ch.close())


async def _details(client) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in client.WatchEvents(pb.WatchEventsRequest()):
            pass
    return caught.value.details() or ""
