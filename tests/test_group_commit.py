"""Group commit on real etcd: changes that share a transaction keep their own outcomes."""

from __future__ import annotations

import asyncio
import json

from eventsource.commit import Change, Committer
from eventsource.errors import Conflict, StoreError
from eventsource.etcd import AsyncEtcd, Compare, Delete, Put
from eventsource.events import Event
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from tests.fixtures.metrics import counter_total


async def test_concurrent_changes_share_transactions_and_keep_their_outcomes(
        etcd_server, key_root):
    etcd = AsyncEtcd([etcd_server.endpoint])
    metrics = Metrics()
    layout = KeyLayout(key_root)
    committer = Committer(etcd, layout, metrics, outbox_enabled=True)
    stale = f"{key_root}/stale"
    await etcd.txn([], [Put(stale, b"v1")])
    try:
        async def one(i: int) -> int | str:
            # every fifth change compares a key that has moved on: only it must fail
            compares = ([Compare.mod(stale, 1)] if i % 5 == 0
                        else [Compare.absent(f"{key_root}/k/{i}")])
            change = Change(kind="test", compares=compares,
                            puts=[Put(f"{key_root}/k/{i}", str(i).encode())],
                            events=[Event(type="NodeLabelSet", node_id=f"n{i}",
                                          details={"key": "i", "value": str(i)}),
                                    Event(type="NodeLabelSet", node_id=f"n{i}",
                                          details={"key": "j", "value": str(i)})])
            try:
                return (await committer.commit(change)).revision
            except Conflict:
                return "conflict"

        results = await asyncio.gather(*(one(i) for i in range(200)))
        for i, result in enumerate(results):
            assert (result == "conflict") == (i % 5 == 0), (i, result)
        kvs, _ = await etcd.list_prefix(f"{key_root}/k/")
        assert sorted(int(kv.value) for kv in kvs) == [i for i in range(200) if i % 5]
        # fewer requests than changes: concurrent changes rode together
        requests = counter_total(metrics.etcd_txn_requests)
        grouped = counter_total(metrics.etcd_txn_requests, shape="group")
        assert grouped > 0, (requests, grouped)
        assert requests < 200, (requests, grouped)
        assert counter_total(metrics.etcd_txns, kind="test", result="committed") == 160
        assert counter_total(metrics.etcd_txns, kind="test", result="conflict") == 40
        # events of different changes in one transaction never share a stream id
        outbox, _ = await etcd.list_prefix(layout.outbox(""))
        ids = [(kv.mod_revision, json.loads(kv.value)["seq"]) for kv in outbox]
        assert len(ids) == 320
        assert len(set(ids)) == 320
    finally:
        await committer.aclose()
        etcd.close()


async def test_writes_of_one_key_keep_their_order_and_never_share_a_transaction(
        etcd_server, key_root):
    etcd = AsyncEtcd([etcd_server.endpoint])
    committer = Committer(etcd, KeyLayout(key_root), Metrics(), outbox_enabled=False)
    key = f"{key_root}/same"
    try:
        # unconditional puts of one key, submitted together: the last one submitted wins
        revisions = [c.revision for c in await asyncio.gather(*(committer.commit(Change(
            kind="test", puts=[Put(key, str(i).encode()), Put(f"{key}/{i}", b"x")]))
            for i in range(50)))]
        assert revisions == sorted(revisions)
        assert len(set(revisions)) == 50
        kv = await etcd.get(key)
        assert kv is not None
        assert kv.value == b"49"
        # a prefix delete goes alone and after what was queued before it
        done = await asyncio.gather(
            committer.commit(Change(kind="test", puts=[Put(f"{key}/late", b"x")])),
            committer.commit(Change(kind="test", deletes=[Delete(f"{key}/", prefix=True)])),
            committer.commit(Change(kind="test", puts=[Put(f"{key}/after", b"x")])),
        )
        assert done[0].revision < done[1].revision < done[2].revision
        kvs, _ = await etcd.list_prefix(f"{key}/")
        assert [kv.key for kv in kvs] == [f"{key}/after"]
    finally:
        await committer.aclose()
        etcd.close()


async def test_wide_changes_and_small_ones_stay_within_the_operation_limit(
        etcd_server, key_root, caplog):
    """etcd lets a nested transaction use only what its parent's longest list leaves."""
    etcd = AsyncEtcd([etcd_server.endpoint])
    committer = Committer(etcd, KeyLayout(key_root), Metrics(), outbox_enabled=False)
    try:
        def wide(i: int) -> Change:
            return Change(kind="test", puts=[Put(f"{key_root}/w{i}/{j}", b"x")
                                             for j in range(120)])

        def small(i: int) -> Change:
            return Change(kind="test", puts=[Put(f"{key_root}/s/{i}", b"x")])

        changes = [wide(i) if i % 10 == 0 else small(i) for i in range(100)]
        await asyncio.gather(*(committer.commit(c) for c in changes))
        assert len((await etcd.list_prefix(f"{key_root}/"))[0]) == 10 * 120 + 90
        # sent as built, not rescued by the one-by-one fallback
        assert "group commit refused" not in caplog.text
    finally:
        await committer.aclose()
        etcd.close()


async def test_prefix_compares_never_share_a_transaction_with_writes_under_them(
        etcd_server, key_root):
    # every compare of a group is evaluated before its writes: two claims that each check
    # "nothing new under the prefix" must not ride together, or both would win
    etcd = AsyncEtcd([etcd_server.endpoint])
    metrics = Metrics()
    committer = Committer(etcd, KeyLayout(key_root), metrics, outbox_enabled=False)
    prefix = f"{key_root}/claims/"
    try:
        _, listed_at = await etcd.list_prefix(prefix)

        async def claim(i: int) -> bool:
            try:
                await committer.commit(Change(kind="test", compares=[
                    Compare.unchanged_since(prefix, listed_at)],
                    puts=[Put(f"{prefix}{i}", b"x")]))
            except Conflict:
                return False
            return True

        # unrelated changes go first and fill the transactions in flight, so the claims queue
        # and are taken together: the first transaction that commits holds several of them
        others = [committer.commit(Change(kind="test", puts=[Put(f"{key_root}/o/{i}", b"x")]))
                  for i in range(40)]
        won = await asyncio.gather(*others, *(claim(i) for i in range(20)))
        assert sum(1 for w in won[40:] if w is True) == 1
        kvs, _ = await etcd.list_prefix(prefix)
        assert len(kvs) == 1
        # a deletion under the prefix does not count as a change
        await etcd.txn([], [Delete(kvs[0].key)])
        _, listed_at = await etcd.list_prefix(prefix)
        await etcd.txn([], [Delete(f"{prefix}nothing")])
        assert await claim(99)
        assert counter_total(metrics.etcd_txn_requests, shape="group") > 0
    finally:
        await committer.aclose()
        etcd.close()


async def test_a_group_without_conflicts_is_one_flat_transaction(etcd_server, key_root):
    """Conflict-free changes that fit etcd's operation limit go in one flat transaction: one
    request, nothing sent nested, every change committed at the same revision."""
    etcd = AsyncEtcd([etcd_server.endpoint])
    metrics = Metrics()
    layout = KeyLayout(key_root)
    committer = Committer(etcd, layout, metrics, outbox_enabled=True)
    try:
        changes = [Change(kind="test", compares=[Compare.absent(f"{key_root}/f/{i}")],
                          puts=[Put(f"{key_root}/f/{i}", b"v")],
                          events=[Event(type="NodeLabelSet", node_id=f"n{i}",
                                        details={"key": "k", "value": "v"})])
                   for i in range(30)]
        revisions = await asyncio.gather(*(committer.commit(c) for c in changes))
        grouped = counter_total(metrics.etcd_txn_requests, shape="group")
        assert grouped > 0
        assert counter_total(metrics.etcd_txn_requests, shape="group-nested") == 0
        assert len({r.revision for r in revisions}) <= counter_total(
            metrics.etcd_txn_requests)
        kvs, _ = await etcd.list_prefix(f"{key_root}/f/")
        assert len(kvs) == 30
        outbox, _ = await etcd.list_prefix(layout.outbox(""))
        assert len({(kv.mod_revision, json.loads(kv.value)["seq"]) for kv in outbox}) == 30
    finally:
        await committer.aclose()
        etcd.close()


async def test_a_flat_group_that_fails_a_compare_is_sent_again_nested(etcd_server,
                                                                      key_root) -> None:
    """``txn_group`` tries one flat transaction; when a compare fails it sends the group
    nested, so only the change whose compare failed fails."""
    etcd = AsyncEtcd([etcd_server.endpoint])
    try:
        stale = f"{key_root}/g/stale"
        await etcd.txn([], [Put(stale, b"v1")])
        subs = [([Compare.absent(f"{key_root}/g/{i}")], [Put(f"{key_root}/g/{i}", b"x")])
                for i in range(3)]
        revision, outcomes, second_try = await etcd.txn_group(subs)
        assert (outcomes, second_try) == ([True, True, True], False)
        failing = [([Compare.absent(f"{key_root}/g/a")], [Put(f"{key_root}/g/a", b"x")]),
                   ([Compare.mod(stale, 1)], [Put(f"{key_root}/g/b", b"x")]),
                   ([Compare.absent(f"{key_root}/g/c")], [Put(f"{key_root}/g/c", b"x")])]
        later, outcomes, second_try = await etcd.txn_group(failing)
        assert (outcomes, second_try) == ([True, False, True], True)
        assert later > revision
        assert await etcd.get(f"{key_root}/g/b") is None
        assert await etcd.get(f"{key_root}/g/c") is not None
    finally:
        etcd.close()


async def test_a_dead_lease_in_one_change_does_not_fail_the_others(etcd_server,
                                                                   key_root) -> None:
    """etcd refuses a whole transaction that puts a key on an unknown lease; the group is then
    sent change by change, so only that change fails."""
    etcd = AsyncEtcd([etcd_server.endpoint])
    metrics = Metrics()
    layout = KeyLayout(key_root)
    committer = Committer(etcd, layout, metrics, outbox_enabled=False)
    try:
        lease = await etcd.lease_grant(10)
        await etcd.lease_revoke(lease)
        def change(i: int) -> Change:
            return Change(kind="test", puts=[Put(f"{key_root}/l/{i}", b"v")])

        # four changes fill the transactions in flight; what comes next rides in one group
        ahead = [committer.commit(change(i)) for i in range(4)]
        dead = committer.commit(Change(kind="test", puts=[
            Put(f"{key_root}/l/dead", b"v", lease=lease)]))
        behind = [committer.commit(change(i)) for i in range(4, 9)]
        results = await asyncio.gather(*ahead, dead, *behind, return_exceptions=True)
        assert isinstance(results[4], StoreError), results[4]
        assert not any(isinstance(r, BaseException) for i, r in enumerate(results) if i != 4)
        assert counter_total(metrics.etcd_txn_requests, shape="group") > 0
        kvs, _ = await etcd.list_prefix(f"{key_root}/l/")
        assert sorted(kv.key.rsplit("/", 1)[1] for kv in kvs) == [str(i) for i in range(9)]
    finally:
        await committer.aclose()
        etcd.close()
