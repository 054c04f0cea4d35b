"""Projections over real etcd: list at R, watch from R+1, re-list after compaction."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from eventsource.errors import Unavailable
from eventsource.etcd import AsyncEtcd, Delete, Put
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.records import Node, decode, encode
from ops.devstack.etcdapi import etcd_compact
from projections.prefix import PrefixProjection
from tests.fixtures.waiting import wait_for


def _node(node_id: str, cpu: float = 1.0) -> bytes:
    return encode(Node(node_id=node_id, status="Ready", total_cpu=cpu))


def _nodes_projection(etcd: AsyncEtcd, layout: KeyLayout, **options: Any
                     ) -> PrefixProjection[Node]:
    """The node projection over ``layout``'s prefix (``options``: metrics, key_filter)."""
    options.setdefault("metrics", Metrics())
    return PrefixProjection(etcd, layout.nodes_prefix, lambda _id, raw: decode(Node, raw),
                            name="nodes", **options)


def _assert_snapshot_matches(projection: PrefixProjection[Node]) -> None:
    """``snapshot()`` (what a reconcile cycle plans on) holds exactly the items' values, and
    is a copy that later changes do not reach."""
    snap = projection.snapshot()
    assert snap == {item_id: item.value for item_id, item in projection.items.items()}
    assert projection.values() == list(snap.values())
    snap.clear()
    assert len(projection.snapshot()) == len(projection.items)


async def test_projection_follows_puts_deletes_and_survives_an_etcd_restart(etcd_private, key_root):
    etcd = AsyncEtcd([etcd_private.endpoint])
    layout = KeyLayout(key_root)
    projection = _nodes_projection(etcd, layout, key_filter=lambda item_id: "/" not in item_id)
    for i in range(5):
        await etcd.txn([], [Put(layout.node(f"n{i}"), _node(f"n{i}"))])
    task = asyncio.create_task(projection.run())
    try:
        await wait_for(lambda: len(projection.items) == 5, message="initial list")
        await etcd.txn([], [Put(layout.node("n5"), _node("n5"))])
        await wait_for(lambda: "n5" in projection.items, message="watched put")
        # a status sub-key is not a node
        await etcd.txn([], [Put(layout.node_status("n5"), b"Ready")])
        # etcd restarts under the watch: the projection resumes from its last revision
        etcd_private.kill()
        etcd_private.restart()
        for i in range(6, 30):
            await etcd.txn([], [Put(layout.node(f"n{i}"), _node(f"n{i}"))])
        await etcd.txn([], [Delete(layout.node("n0"))])
        # a record that no longer decodes leaves the projection (and its snapshot)
        await etcd.txn([], [Put(layout.node("n7"), b"{not json")])
        revision = await etcd.current_revision()
        await wait_for(lambda: projection.revision >= revision, message="caught up")
        assert set(projection.items) == {f"n{i}" for i in range(1, 30)} - {"n7"}
        assert "n5/status" not in projection.items
        _assert_snapshot_matches(projection)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        etcd.close()


async def test_relist_after_watch_start_revision_was_compacted(etcd_server, key_root):
    etcd = AsyncEtcd([etcd_server.endpoint])
    layout = KeyLayout(key_root)
    projection = _nodes_projection(etcd, layout)
    try:
        await etcd.txn([], [Put(layout.node("a"), _node("a"))])
        kvs, listed_at = await etcd.list_prefix(layout.nodes_prefix)
        projection.load(kvs, listed_at)
        # the world moves on and etcd compacts past the listing revision
        await etcd.txn([], [Put(layout.node("b"), _node("b", 2.0))])
        await etcd.txn([], [Delete(layout.node("a"))])
        current = await etcd.current_revision()
        etcd_compact(etcd_server.url, current)
        task = asyncio.create_task(projection.run_from(listed_at))
        try:
            await wait_for(lambda: projection.restarts >= 1, message="compaction noticed")
            await wait_for(lambda: set(projection.items) == {"b"}, message="re-listed")
            assert projection.items["b"].value.total_cpu == 2.0
            assert projection.revision >= current
            _assert_snapshot_matches(projection)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        etcd.close()


async def test_revision_waiters_wake_in_order_and_a_timed_out_one_is_skipped(
        etcd_server, key_root):
    etcd = AsyncEtcd([etcd_server.endpoint])
    layout = KeyLayout(key_root)
    projection = _nodes_projection(etcd, layout)
    try:
        kvs, listed_at = await etcd.list_prefix(layout.nodes_prefix)
        projection.load(kvs, listed_at)
        await projection.wait_for_revision(listed_at)  # already there: returns at once
        woken: list[int] = []

        async def wait(offset: int) -> None:
            await projection.wait_for_revision(listed_at + offset)
            woken.append(offset)

        waiters = [asyncio.create_task(wait(offset)) for offset in (3, 1, 2, 1)]
        with pytest.raises(Unavailable):  # times out; its heap entry must not stop the rest
            await projection.wait_for_revision(listed_at + 2, timeout=0.05)
        task = asyncio.create_task(projection.run_from(listed_at))
        try:
            for i in range(3):
                await etcd.txn([], [Put(layout.node(f"w{i}"), _node(f"w{i}"))])
            await asyncio.wait_for(asyncio.gather(*waiters), 10)
            assert woken == [1, 1, 2, 3]
            assert projection._waiters == []
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        etcd.close()
