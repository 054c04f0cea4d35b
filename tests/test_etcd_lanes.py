"""The etcd client's lanes, on a real etcd: this process's own session and probe calls never
wait behind bulk work (a probe queued behind placements once put a healthy replica in degraded
mode at 5,000 nodes)."""

from __future__ import annotations

import asyncio
import threading

from eventsource.etcd import BULK, SESSION, AsyncEtcd


async def test_session_and_probe_calls_pass_a_busy_bulk_lane(etcd_server, key_root) -> None:
    etcd = AsyncEtcd([etcd_server.endpoint], max_workers=1)
    release = threading.Event()
    # the bulk lane's only thread is busy (as behind a burst of placements)
    busy = etcd._lanes[BULK].submit(release.wait, 30)
    try:
        lease = await asyncio.wait_for(etcd.lease_grant(10), 5)  # session lane by default
        assert await asyncio.wait_for(etcd.lease_keepalive(lease), 5) > 0
        assert await asyncio.wait_for(etcd.get(f"{key_root}/x", lane=SESSION), 5) is None
        queued = asyncio.ensure_future(etcd.get(f"{key_root}/x"))
        done, _ = await asyncio.wait({queued}, timeout=0.3)
        assert not done, "a bulk call ran although the bulk lane was busy: the test proves nothing"
        release.set()
        assert await asyncio.wait_for(queued, 5) is None
        await asyncio.wait_for(etcd.lease_revoke(lease), 5)
    finally:
        release.set()
        await asyncio.wrap_future(busy)
        etcd.close()
