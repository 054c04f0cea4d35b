"""Endpoint failover never applies a write twice, and a caller that gave up sends nothing.

Endpoint A is a stand-in gateway that answers every call with 503 (as etcd's gateway does for
"request timed out" and "leader changed", after which a write may well have been applied);
endpoint B is a real etcd. A read fails over to B; a write does not (its outcome is unknown).
A refused connection proves the request was not sent: then a write fails over too.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eventsource.errors import OutcomeUnknown, Unavailable
from eventsource.etcd import AsyncEtcd, Put
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.records import WorkloadSpec, encode
from ops.devstack.process import free_port
from projections.cluster import ClusterProjection
from tests.fixtures.waiting import wait_for


class Busy503(BaseHTTPRequestHandler):
    calls: list[str] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        Busy503.calls.append(self.path)
        body = b'{"error":"etcdserver: request timed out","code":14}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def busy_endpoint() -> Iterator[str]:
    Busy503.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy503)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_a_write_with_an_unknown_outcome_is_not_sent_elsewhere(
        busy_endpoint, etcd_server, key_root) -> None:
    etcd = AsyncEtcd([busy_endpoint, etcd_server.endpoint])
    try:
        with pytest.raises(OutcomeUnknown):
            await etcd.txn([], [Put(f"{key_root}/once", b"v")])
        assert Busy503.calls == ["/v3/kv/txn"]
        assert await etcd.get(f"{key_root}/once") is None  # a read: A answers 503, B answers
        assert Busy503.calls == ["/v3/kv/txn", "/v3/kv/range"]
    finally:
        etcd.close()


async def test_a_write_that_was_not_sent_goes_to_the_next_endpoint(etcd_server,
                                                                   key_root) -> None:
    refused = f"127.0.0.1:{free_port()}"  # nothing listens: the request never left
    etcd = AsyncEtcd([refused, etcd_server.endpoint])
    try:
        await etcd.txn([], [Put(f"{key_root}/moved", b"v")])
        kv = await etcd.get(f"{key_root}/moved")
        assert kv is not None
        assert kv.version == 1
    finally:
        etcd.close()


def test_nothing_is_sent_once_the_caller_has_given_up(busy_endpoint) -> None:
    etcd = AsyncEtcd([busy_endpoint])
    try:
        with pytest.raises(Unavailable):
            etcd._post_blocking("/kv/txn", {"compare": [], "success": []},
                                time.monotonic() - 0.1)
        assert Busy503.calls == []
    finally:
        etcd.close()


async def test_a_key_that_is_not_utf8_does_not_stop_the_projections(etcd_server,
                                                                    key_root) -> None:
    etcd = AsyncEtcd([etcd_server.endpoint])
    layout = KeyLayout(key_root)
    cluster = ClusterProjection(etcd, layout, Metrics())
    task = asyncio.create_task(cluster.run())
    try:
        await cluster.wait_ready()
        odd = base64.b64encode(key_root.encode() + b"/nodes/x\xff").decode()
        await etcd.post("/kv/put", {"key": odd, "value": base64.b64encode(b"{}").decode()})
        spec = WorkloadSpec(id="w1", type="container", image="nginx:1")
        await etcd.txn([], [Put(layout.spec("w1"), encode(spec))])
        await wait_for(lambda: cluster.specs.get("w1") is not None, timeout=5,
                       message="the projections stopped at the odd key")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        etcd.close()


async def test_an_unreachable_etcd_is_reported_with_its_cause() -> None:
    """etcd3gw's connection errors print as empty strings: the operator must still read why."""
    etcd = AsyncEtcd(["127.0.0.1:1"], timeout=2.0)
    try:
        with pytest.raises(Unavailable) as info:
            await etcd.get("/x")
    finally:
        etcd.close()
    message = str(info.value)
    assert "all endpoints failed" in message
    assert "Connection" in message.split("all endpoints failed:", 1)[1], message
