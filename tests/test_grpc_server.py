"""The scheduler's gRPC server under a burst of calls, on real etcd and Redis."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections import Counter

import grpc
import pytest

from handlers.api.grpcwrap import WrapCache
from proto.persys.control.v1 import control_pb2 as pb
from proto.persys.control.v1 import control_pb2_grpc
from tests.fixtures.harness import make_settings, running_scheduler

BURST = 3_000
CHANNELS = 4


async def test_a_burst_of_calls_waits_its_turn_instead_of_being_cancelled(
        etcd_server, redis_server, key_root, stream_key) -> None:
    """Every agent of a large fleet re-registers at once after a failover. grpc-core's default
    pending-call limits cancelled some of such a burst at random before any handler saw them
    (measured: 160 of 2,000), and each cancelled call became another re-registration."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        options = [("grpc.use_local_subchannel_pool", 1)]  # one connection per channel
        channels = [grpc.aio.insecure_channel(address, options=options)
                    for _ in range(CHANNELS)]
        try:
            stubs = [control_pb2_grpc.AgentControlStub(c) for c in channels]
            for stub in stubs:  # connected before the burst
                await _code(stub, "warm-up")
            codes = Counter(await asyncio.gather(*(_code(stubs[i % CHANNELS], f"ghost-{i}")
                                                   for i in range(BURST))))
        finally:
            for channel in channels:
                await channel.close()
        # every call reached the handler, which answers an unknown node NOT_FOUND (Go's answer)
        assert codes == {grpc.StatusCode.NOT_FOUND: BURST}, dict(codes)


async def _code(stub: control_pb2_grpc.AgentControlStub, node_id: str) -> grpc.StatusCode:
    try:
        await stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=60)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_metrics_listen_where_they_are_told(etcd_server, key_root, stream_key):
    """SCHEDULER_METRICS_ADDR keeps the plaintext /metrics and /health off other interfaces."""
    settings = make_settings(etcd_server, None, key_root, stream_key,
                             grpc_addr="0.0.0.0", metrics_addr="127.0.0.2")
    async with running_scheduler(settings) as sched:
        port = sched.http.port

        def health(host: str) -> int:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=3) as resp:
                return int(resp.status)

        assert await asyncio.to_thread(health, "127.0.0.2") == 200
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(health, "127.0.0.1")


def test_a_wrapped_handler_is_reused_while_its_inner_handler_is_the_same() -> None:
    async def behave(request: object, context: object) -> object:
        return request

    first = grpc.unary_unary_rpc_method_handler(behave)
    second = grpc.unary_unary_rpc_method_handler(behave)
    cache = WrapCache()
    made: list[grpc.RpcMethodHandler] = []

    def make(inner: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        made.append(inner)
        return grpc.unary_unary_rpc_method_handler(inner.unary_unary)

    wrapped = cache.get("/svc/A", first, make)
    assert cache.get("/svc/A", first, make) is wrapped
    # a different inner handler (an inner interceptor that builds one per call) is wrapped anew
    rewrapped = cache.get("/svc/A", second, make)
    assert rewrapped is not wrapped
    assert cache.get("/svc/B", first, make) is not wrapped
    assert made == [first, second, first]
