"""Lease keepalives batched into gateway stream calls, on a real etcd: each caller gets its own
lease's outcome, many renewals cost one call, and failures and shutdown answer every caller."""

from __future__ import annotations

import asyncio
import math
import socket

import pytest

from eventsource.errors import LeaseLost, Unavailable
from eventsource.etcd import AsyncEtcd
from eventsource.keepalives import KeepaliveBatcher


async def test_one_call_renews_many_leases_and_reports_the_expired_one(etcd_server) -> None:
    etcd = AsyncEtcd([etcd_server.endpoint])
    try:
        live = [await etcd.lease_grant(30 + i) for i in range(3)]
        gone = await etcd.lease_grant(30)
        await etcd.lease_revoke(gone)
        ttls = await asyncio.wait_for(etcd.lease_keepalive_many([*live, gone]), 10)
        assert ttls == {live[0]: 30, live[1]: 31, live[2]: 32, gone: 0}
        assert await etcd.lease_keepalive_many([]) == {}
    finally:
        etcd.close()


async def test_concurrent_renewals_share_calls_and_each_gets_its_outcome(etcd_server) -> None:
    etcd = AsyncEtcd([etcd_server.endpoint])
    batcher = KeepaliveBatcher(etcd, linger_s=0.05, max_batch=256)
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


async def test_batches_are_bounded(etcd_server) -> None:
    etcd = AsyncEtcd([etcd_server.endpoint])
    batcher = KeepaliveBatcher(etcd, linger_s=0.05, max_batch=4, max_inflight=1)
    try:
        leases = [await etcd.lease_grant(15) for _ in range(10)]
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(batcher.renew(lease) for lease in leases)), 10)
        assert outcomes == [15] * 10
        assert batcher.calls == math.ceil(10 / 4)
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
        with pytest.raises(ValueError, match="max_batch"):
            KeepaliveBatcher(etcd, max_batch=0)
        with pytest.raises(ValueError, match="linger_s"):
            KeepaliveBatcher(etcd, linger_s=-1)
    finally:
        etcd.close()
