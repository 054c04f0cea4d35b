"""Lease keepalives batched into gateway stream calls, on a real etcd: each caller gets its own
lease's outcome, many renewals cost one call, and failures and shutdown answer every caller.
Also the endpoint failover that stream calls and unary calls share."""

from __future__ import annotations

import asyncio
import http.server
import math
import socket
import threading
from collections.abc import Sequence

import pytest

from eventsource.errors import LeaseLost, Unavailable
from eventsource.etcd import BULK, KEEPALIVE_BATCH_MAX, AsyncEtcd, Lane
from eventsource.keepalives import KeepaliveBatcher
from tests.fixtures.waiting import wait_for


async def test_one_call_renews_a_full_batch_and_reports_the_expired_one(etcd_server) -> None:
    etcd = AsyncEtcd([etcd_server.endpoint])
    try:
        live = [await etcd.lease_grant(30 + i) for i in range(KEEPALIVE_BATCH_MAX - 1)]
        gone = await etcd.lease_grant(30)
        await etcd.lease_revoke(gone)
        ttls = await asyncio.wait_for(etcd.lease_keepalive_many([*live, gone]), 10)
        assert ttls == {**{lease: 30 + i for i, lease in enumerate(live)}, gone: 0}
        assert await etcd.lease_keepalive_many([]) == {}
        with pytest.raises(ValueError, match="at most"):
            await etcd.lease_keepalive_many([*live, gone, gone])
    finally:
        etcd.close()


async def test_concurrent_renewals_share_calls_and_each_gets_its_outcome(etcd_server) -> None:
    etcd = AsyncEtcd([etcd_server.endpoint])
    batcher = KeepaliveBatcher(etcd, linger_s=0.05)
    try:
        leases = [await etcd.lease_grant(20) for _ in range(10)]
        gone = await etcd.lease_grant(20)
        await etcd.lease_revoke(gone)
        # 40 heartbeats: each lease four times (two replicas' worth of agents), plus one lost
        asks = [*(lease for lease in leases for _ in range(4)), gone]
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(batcher.renew(lease) for lease in asks), return_exceptions=True), 10)
        assert outcomes[:-1] == [20] * 40
        assert isinstance(outcomes[-1], LeaseLost)
        assert batcher.calls == 1
        assert batcher.leases_sent == 11
    finally:
        await batcher.aclose()
        etcd.close()


@pytest.mark.parametrize("max_inflight", [1, 2])
async def test_batches_are_bounded_and_every_lease_is_answered(etcd_server,
                                                               max_inflight: int) -> None:
    # 100 renewals at once: more than the gateway answers in one call (measured: 17 of 64),
    # so this also shows that the batch bound keeps every lease answered
    etcd = AsyncEtcd([etcd_server.endpoint])
    batcher = KeepaliveBatcher(etcd, linger_s=0.05, max_inflight=max_inflight)
    try:
        leases = [await etcd.lease_grant(15) for _ in range(100)]
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(batcher.renew(lease) for lease in leases)), 20)
        assert outcomes == [15] * 100
        assert batcher.calls == math.ceil(100 / KEEPALIVE_BATCH_MAX)
    finally:
        await batcher.aclose()
        etcd.close()


class _Answers(AsyncEtcd):
    """An etcd client whose keepalive answers are given: for the batcher's handling of
    answers a real etcd does not produce on demand (a missing answer, a client bug)."""

    def __init__(self, answer: dict[int, int] | Exception) -> None:
        super().__init__(["127.0.0.1:9"])
        self.answer = answer

    async def lease_keepalive_many(self, lease_ids: Sequence[int], *,
                                   lane: Lane = BULK) -> dict[int, int]:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def test_a_lease_without_an_answer_is_unavailable_not_lost() -> None:
    etcd = _Answers({1: 30, 2: 0})
    batcher = KeepaliveBatcher(etcd, linger_s=0.0)
    try:
        one, two, three = await asyncio.wait_for(asyncio.gather(
            batcher.renew(1), batcher.renew(2), batcher.renew(3), return_exceptions=True), 5)
        assert one == 30
        assert isinstance(two, LeaseLost)
        assert isinstance(three, Unavailable)
        assert not isinstance(three, LeaseLost)
    finally:
        await batcher.aclose()
        etcd.close()


async def test_an_unexpected_error_still_answers_every_caller() -> None:
    etcd = _Answers(ValueError("a bug in the client"))
    batcher = KeepaliveBatcher(etcd, linger_s=0.0)
    try:
        outcomes = await asyncio.wait_for(asyncio.gather(
            batcher.renew(1), batcher.renew(2), return_exceptions=True), 5)
        assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
        # the batcher is not wedged: a later renewal gets a call, and an answer, of its own
        again = await asyncio.wait_for(asyncio.gather(batcher.renew(1), return_exceptions=True), 5)
        assert isinstance(again[0], Unavailable)
        assert batcher.calls == 2
    finally:
        await batcher.aclose()
        etcd.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_unreachable_etcd_answers_every_caller() -> None:
    etcd = AsyncEtcd([f"127.0.0.1:{_closed_port()}"], timeout=1.0)
    batcher = KeepaliveBatcher(etcd, linger_s=0.01)
    try:
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(batcher.renew(n) for n in (1, 2, 3)), return_exceptions=True), 10)
        assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
    finally:
        await batcher.aclose()
        etcd.close()


async def test_close_answers_callers_whose_call_is_in_flight(etcd_server) -> None:
    etcd = AsyncEtcd([etcd_server.endpoint], max_workers=1)
    release = threading.Event()
    busy = etcd._lanes[BULK].submit(release.wait, 30)  # the call waits for the only thread
    batcher = KeepaliveBatcher(etcd, linger_s=0.0)
    try:
        lease = await etcd.lease_grant(15)
        waiting = asyncio.ensure_future(batcher.renew(lease))
        await wait_for(lambda: batcher.calls, timeout=5, message="the call never started")
        await asyncio.wait_for(batcher.aclose(), 5)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(waiting, 5)
    finally:
        release.set()
        await asyncio.wrap_future(busy)
        etcd.close()


async def test_close_answers_waiting_callers_and_refuses_new_ones(etcd_server) -> None:
    etcd = AsyncEtcd([etcd_server.endpoint])
    batcher = KeepaliveBatcher(etcd, linger_s=60.0)  # nothing is sent before the close
    try:
        waiting = asyncio.ensure_future(batcher.renew(12345))
        await asyncio.sleep(0)  # allowed: lets the renewal queue itself, it waits on nothing
        await batcher.aclose()
        with pytest.raises(Unavailable):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(Unavailable):
            await batcher.renew(12345)
        assert batcher.calls == 0
    finally:
        etcd.close()


def test_bad_bounds_are_refused() -> None:
    etcd = AsyncEtcd(["127.0.0.1:2379"])
    try:
        with pytest.raises(ValueError, match="max_batch must be"):
            KeepaliveBatcher(etcd, max_batch=0)
        with pytest.raises(ValueError, match="max_batch must be"):
            KeepaliveBatcher(etcd, max_batch=KEEPALIVE_BATCH_MAX + 1)
        with pytest.raises(ValueError, match="max_inflight must be"):
            KeepaliveBatcher(etcd, max_inflight=0)
        with pytest.raises(ValueError, match="linger_s must not"):
            KeepaliveBatcher(etcd, linger_s=-1)
    finally:
        etcd.close()


async def test_a_full_batch_of_the_largest_lease_ids_fits_the_streaming_body(etcd_server) -> None:
    etcd = AsyncEtcd([etcd_server.endpoint])
    try:
        largest = [2**63 - 1 - i for i in range(KEEPALIVE_BATCH_MAX)]  # 19 digits each
        ttls = await asyncio.wait_for(etcd.lease_keepalive_many(largest), 10)
        assert ttls == dict.fromkeys(largest, 0)  # every one answered (none exists)
    finally:
        etcd.close()


class _Refusing(http.server.BaseHTTPRequestHandler):
    """An etcd member that cannot serve: 503, or 200 with an in-band 503 error line."""

    in_band = False

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.in_band:
            body = b'{"error":{"grpc_code":14,"http_code":503,"message":"no leader"}}\n'
            self.send_response(200)
        else:
            body = b'{"error":"etcdserver: no leader","code":14}'
            self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


@pytest.mark.parametrize("in_band", [False, True])
async def test_keepalives_fail_over_from_a_member_that_cannot_serve(etcd_server,
                                                                    in_band: bool) -> None:
    handler = type("Handler", (_Refusing,), {"in_band": in_band})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    direct = AsyncEtcd([etcd_server.endpoint])
    etcd = AsyncEtcd([f"127.0.0.1:{server.server_address[1]}", etcd_server.endpoint])
    try:
        lease = await direct.lease_grant(25)
        assert await asyncio.wait_for(etcd.lease_keepalive_many([lease]), 10) == {lease: 25}
        assert etcd._current == 1  # later calls go to the member that answered
    finally:
        etcd.close()
        direct.close()
        server.shutdown()
        server.server_close()
        thread.join(5)


class _Gated(AsyncEtcd):
    """Keepalive calls that wait for a gate, to watch how many are in flight."""

    def __init__(self) -> None:
        super().__init__(["127.0.0.1:9"])
        self.gate = asyncio.Event()
        self.active = 0
        self.most = 0

    async def lease_keepalive_many(self, lease_ids: Sequence[int], *,
                                   lane: Lane = BULK) -> dict[int, int]:
        self.active += 1
        self.most = max(self.most, self.active)
        try:
            await self.gate.wait()
            return dict.fromkeys(lease_ids, 10)
        finally:
            self.active -= 1


async def test_no_more_calls_than_max_inflight_and_the_rest_follow() -> None:
    etcd = _Gated()
    batcher = KeepaliveBatcher(etcd, linger_s=0.0, max_inflight=2)
    try:
        renewals = asyncio.gather(*(batcher.renew(lease) for lease in range(1, 101)))
        await wait_for(lambda: etcd.active == 2, timeout=5, message="two calls in flight")
        assert batcher.calls == 2  # the other 68 leases wait for a free call
        etcd.gate.set()
        assert await asyncio.wait_for(renewals, 5) == [10] * 100
        assert etcd.most == 2
        assert batcher.calls == math.ceil(100 / KEEPALIVE_BATCH_MAX)
    finally:
        await batcher.aclose()
        etcd.close()


async def test_unary_calls_fail_over_the_same_way(etcd_server, key_root) -> None:
    # the stream call and the unary calls share one failover loop (AsyncEtcd._on_endpoints)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoints = [f"127.0.0.1:{_closed_port()}", f"127.0.0.1:{server.server_address[1]}",
                 etcd_server.endpoint]
    etcd = AsyncEtcd(endpoints, timeout=2.0)
    try:
        assert await asyncio.wait_for(etcd.get(f"{key_root}/absent"), 20) is None
        assert etcd._current == 2
    finally:
        etcd.close()
        server.shutdown()
        server.server_close()
        thread.join(5)
