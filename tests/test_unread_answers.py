"""Callers that do not read their answers, too many calls and too many connections, against
a real scheduler: unread answers are bounded per connection (RESOURCE_EXHAUSTED beyond, and
given back when the connection goes), calls in handlers and connections are bounded, and a
caller that reads is answered meanwhile.

The non-reader is raw HTTP/2 (the ``h2`` library): it sends its calls, reads frames (so it
answers pings and keepalive does not cut it) and never opens its flow-control window, the case
keepalive does not cover.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from handlers.api.unread import SMALL_ANSWER_BYTES, UnreadLedger
from handlers.settings.config import load_settings
from handlers.settings.reader import ConfigError
from proto.persys.control.v1 import control_pb2 as pb
from proto.persys.control.v1 import control_pb2_grpc
from tests.fixtures.harness import control_stub, make_settings, running_fleet, running_scheduler
from tests.fixtures.waiting import wait_for

LIST_NODES = "/persys.control.v1.AgentControl/ListNodes"


# -- the ledger (pure) ----------------------------------------------------------------------
def test_a_connection_over_its_bound_is_refused_before_any_work() -> None:
    ledger = UnreadLedger(per_connection=100_000, total=10_000_000)
    ledger.add("ipv4:10.0.0.1:1", 100_001)
    why = ledger.refusal_before("ipv4:10.0.0.1:1")
    assert why is not None
    assert "SCHEDULER_GRPC_MAX_UNREAD_BYTES_PER_CONNECTION=100000" in why
    assert ledger.refusal_before("ipv4:10.0.0.1:2") is None  # another connection: served
    ledger.release("ipv4:10.0.0.1:1", 100_001)
    assert ledger.refusal_before("ipv4:10.0.0.1:1") is None
    assert ledger.held == 0
    assert ledger.of("ipv4:10.0.0.1:1") == 0


@pytest.mark.parametrize(("held", "size", "refused"), [
    (0, 1_000_000, False),                      # fits
    (900_000, 200_000, True),                   # a large answer past the total
    (900_000, SMALL_ANSWER_BYTES, False),       # a small one never refused for the total
    (1_000_000, SMALL_ANSWER_BYTES + 1, True),
])
def test_an_answer_past_the_total_is_refused_unless_small(held: int, size: int,
                                                          refused: bool) -> None:
    ledger = UnreadLedger(per_connection=10_000_000, total=1_000_000)
    ledger.add("ipv4:10.0.0.9:9", held)
    why = ledger.refusal_of(size)
    assert (why is not None) == refused
    if why is not None:
        assert "SCHEDULER_GRPC_MAX_UNREAD_BYTES=1000000" in why


def test_a_call_whose_last_answer_would_not_fit_is_refused_before_any_work() -> None:
    ledger = UnreadLedger(per_connection=10_000_000, total=1_000_000)
    ledger.add("ipv4:10.0.0.1:1", 900_000)
    assert ledger.refusal_before("ipv4:10.0.0.2:1", "/x/ListNodes") is None  # size unknown
    ledger.sized("/x/ListNodes", 200_000)
    why = ledger.refusal_before("ipv4:10.0.0.2:1", "/x/ListNodes")
    assert why is not None
    assert "SCHEDULER_GRPC_MAX_UNREAD_BYTES" in why
    ledger.sized("/x/Heartbeat", 100)
    assert ledger.refusal_before("ipv4:10.0.0.2:1", "/x/Heartbeat") is None  # small: served
    ledger.release("ipv4:10.0.0.1:1", 900_000)
    assert ledger.refusal_before("ipv4:10.0.0.2:1", "/x/ListNodes") is None


def test_over_the_total_only_connections_that_hold_unread_answers_are_refused_first() -> None:
    ledger = UnreadLedger(per_connection=10_000_000, total=1_000_000)
    ledger.add("ipv4:10.0.0.1:1", 1_500_000)
    assert ledger.refusal_before("ipv4:10.0.0.1:1") is not None
    assert ledger.refusal_before("ipv4:10.0.0.2:1") is None  # it reads: its call runs


@pytest.mark.parametrize("name", ["SCHEDULER_GRPC_MAX_CONNECTIONS",
                                  "SCHEDULER_GRPC_MAX_CONCURRENT_RPCS",
                                  "SCHEDULER_GRPC_MAX_UNREAD_BYTES",
                                  "SCHEDULER_GRPC_MAX_UNREAD_BYTES_PER_CONNECTION"])
def test_the_limits_are_validated(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        load_settings({name: "0"}, insecure=True)


# -- against a real scheduler ---------------------------------------------------------------
class NonReader:
    """One HTTP/2 connection that calls and never lets an answer's DATA in."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setblocking(False)
        self.port = port
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        #: stream id -> grpc-status of the answers that ended (a refusal is headers only)
        self.ended: dict[int, str] = {}
        self.details: dict[int, str] = {}

    def call(self, path: str, body: bytes = b"") -> int:
        sid: int = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [
            (":method", "POST"), (":scheme", "http"), (":path", path),
            (":authority", f"127.0.0.1:{self.port}"), ("content-type", "application/grpc"),
            ("te", "trailers")])
        self.conn.send_data(sid, b"\x00" + len(body).to_bytes(4, "big") + body,
                            end_stream=True)
        self.flush()
        return sid

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def pump(self) -> None:
        """Read what came (answering pings, as h2 does), never acknowledging DATA."""
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                break
            if not data:
                break
            for event in self.conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    headers = {k.decode() if isinstance(k, bytes) else k:
                               v.decode() if isinstance(v, bytes) else v
                               for k, v in event.headers}
                    if "grpc-status" in headers:
                        self.ended[event.stream_id] = headers["grpc-status"]
                        self.details[event.stream_id] = headers.get("grpc-message", "")
        self.flush()

    def close(self) -> None:
        self.sock.close()


@contextlib.asynccontextmanager
async def non_reader(port: int) -> AsyncIterator[NonReader]:
    caller = NonReader(port)
    try:
        yield caller
    finally:
        caller.close()


RESOURCE_EXHAUSTED = str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])


async def test_a_caller_that_does_not_read_is_refused_past_its_bound_and_others_are_served(
        etcd_server, redis_server, key_root, stream_key) -> None:
    per_connection = 64 * 1024
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             grpc_max_unread_bytes_per_connection=per_connection)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 40) as fleet, control_stub(address) as stub:
            await fleet.wait_registered()
            answer = len((await stub.ListNodes(pb.ListNodesRequest())).SerializeToString())
            assert answer > 4 * 1024  # 40 nodes: a few kB per answer
            ledger = sched.grpc.unread
            async with non_reader(sched.grpc_port) as caller:
                # enough calls that those past the window and the socket buffers stay unread
                asked = [caller.call(LIST_NODES) for _ in range(400)]

                def refused() -> bool:
                    caller.pump()
                    return any(code == RESOURCE_EXHAUSTED for code in caller.ended.values())

                await wait_for(refused, timeout=30, message="the non-reader was refused")
                sid = next(s for s, code in caller.ended.items() if code == RESOURCE_EXHAUSTED)
                assert "SCHEDULER_GRPC_MAX_UNREAD_BYTES_PER_CONNECTION" in caller.details[sid]
                held = ledger.held
                assert per_connection < held <= per_connection + 2 * answer
                assert len(caller.ended) < len(asked)  # some of its answers still wait
                # a caller that reads is answered meanwhile, a large answer too
                summary = await stub.GetClusterSummary(pb.GetClusterSummaryRequest(), timeout=5)
                assert summary.total_nodes == 40
                assert len((await stub.ListNodes(pb.ListNodesRequest(), timeout=5)).nodes) == 40
                registry = sched.metrics.registry
                assert registry.get_sample_value(
                    "persys_scheduler_grpc_unread_answer_bytes") >= per_connection
                assert registry.get_sample_value("persys_scheduler_grpc_calls_refused_unread_total",
                                                 {"method": LIST_NODES}) >= 1
            # the connection gone, its answers are given back
            await wait_for(lambda: ledger.held == 0, timeout=15,
                           message="unread answers given back when the connection closed")


async def test_calls_in_handlers_are_bounded(etcd_server, redis_server, key_root,
                                             stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             grpc_max_concurrent_rpcs=3)
    async with running_scheduler(settings) as sched, \
            control_stub(f"127.0.0.1:{sched.grpc_port}") as client:
        watches = [client.WatchEvents(pb.WatchEventsRequest()) for _ in range(3)]
        await wait_for(lambda: sched.servicer.watch_limits.open == 3,
                       message="three watchers open")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.GetClusterSummary(pb.GetClusterSummaryRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        watches[0].cancel()
        await wait_for(lambda: sched.servicer.watch_limits.open == 2,
                       message="a watcher closed")

        async def answered() -> bool:
            try:
                await client.GetClusterSummary(pb.GetClusterSummaryRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                return False
            return True

        await wait_for(answered, timeout=10, message="served again below the bound")
        for watch in watches[1:]:
            watch.cancel()


async def test_connections_are_bounded(etcd_server, redis_server, key_root,
                                       stream_key) -> None:
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             grpc_max_connections=3)
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
        channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(4)]
        try:
            stubs = [control_pb2_grpc.AgentControlStub(c) for c in channels]
            for stub in stubs[:3]:
                await stub.GetClusterSummary(pb.GetClusterSummaryRequest(), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stubs[3].GetClusterSummary(pb.GetClusterSummaryRequest(), timeout=3)
            assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                           grpc.StatusCode.DEADLINE_EXCEEDED)
            # the three served connections still are
            for stub in stubs[:3]:
                await stub.GetClusterSummary(pb.GetClusterSummaryRequest(), timeout=5)
            await channels[0].close()

            async def admitted() -> bool:
                try:
                    await stubs[3].GetClusterSummary(pb.GetClusterSummaryRequest(), timeout=2)
                except grpc.aio.AioRpcError:
                    return False
                return True

            await wait_for(admitted, timeout=20, message="a freed place is taken")
        finally:
            await asyncio.gather(*(c.close() for c in channels))
