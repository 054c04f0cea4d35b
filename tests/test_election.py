"""The Go-compatible election (etcd ``concurrency.Election`` semantics) on a real etcd.

Leases use a 2 s TTL (etcd's minimum) so failover by expiry stays well under the test budget.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

import pytest

from eventsource.clock import FakeClock
from eventsource.election import Election, Leadership, Session, leader_key, observe_leader
from eventsource.errors import Conflict, LeaseLost
from eventsource.etcd import AsyncEtcd, Put
from eventsource.keys import KeyLayout
from eventsource.stream.clients import reraise_swallowed_cancel
from handlers.cluster.topology import Topology, settle_topology
from tests.fixtures.relay_fixtures import etcd

__all__ = ["etcd"]  # fixtures

TTL = 2


@pytest.fixture
def prefix(key_root: str) -> str:
    return f"{key_root}/persys/scheduler/leader"


@pytest.fixture
async def sessions(etcd) -> AsyncIterator[list[Session]]:
    opened: list[Session] = []
    try:
        yield opened
    finally:
        for session in opened:
            await session.close()


async def new_session(etcd: AsyncEtcd, opened: list[Session], **kwargs) -> Session:
    session = await Session(etcd, ttl=TTL, **kwargs).start()
    opened.append(session)
    return session


def election(etcd: AsyncEtcd, session: Session, prefix: str, value: str) -> Election:
    return Election(etcd, session, prefix, value, poll_interval=0.2)


async def still_waiting(task: asyncio.Task[Leadership], seconds: float = 0.3) -> bool:
    done, _ = await asyncio.wait({task}, timeout=seconds)
    return not done


async def fenced_put(etcd: AsyncEtcd, lead: Leadership, key: str) -> bool:
    result = await etcd.txn(lead.fence(), [Put(key, b"x")])
    return result.succeeded


async def test_one_of_two_leads_with_the_go_key_format(etcd, prefix, sessions, key_root) -> None:
    first = await new_session(etcd, sessions)
    second = await new_session(etcd, sessions)
    lead = await election(etcd, first, prefix, "replica-a").campaign()
    assert lead.key == f"{prefix}/{first.lease_id:x}" == leader_key(prefix, first.lease_id)
    assert re.fullmatch(re.escape(prefix) + r"/[0-9a-f]+", lead.key)
    kv = await etcd.get(lead.key)
    assert kv is not None
    assert kv.create_revision == lead.term
    assert kv.lease == first.lease_id
    assert kv.value == b"replica-a"
    observed = await observe_leader(etcd, prefix)
    assert observed is not None
    assert (observed.key, observed.value) == (lead.key, b"replica-a")

    waiting = asyncio.create_task(election(etcd, second, prefix, "replica-b").campaign())
    try:
        assert await still_waiting(waiting)
        assert await fenced_put(etcd, lead, f"{key_root}/fenced")
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)


async def test_other_leads_when_the_leader_session_closes(etcd, prefix, sessions, key_root):
    first = await new_session(etcd, sessions)
    second = await new_session(etcd, sessions)
    old = await election(etcd, first, prefix, "a").campaign()
    waiting = asyncio.create_task(election(etcd, second, prefix, "b").campaign())
    assert await still_waiting(waiting)
    await first.close()  # revokes the lease
    async with asyncio.timeout(TTL):
        new = await waiting
    assert new.key == leader_key(prefix, second.lease_id)
    assert new.term > old.term
    assert not await fenced_put(etcd, old, f"{key_root}/fenced")
    assert await fenced_put(etcd, new, f"{key_root}/fenced")
    assert first.lost.is_set()
    assert not old.held()


@pytest.mark.slow
async def test_failover_when_the_leader_lease_expires(etcd, prefix, sessions, key_root) -> None:
    first = await new_session(etcd, sessions)
    second = await new_session(etcd, sessions)
    old = await election(etcd, first, prefix, "a").campaign()
    waiting = asyncio.create_task(election(etcd, second, prefix, "b").campaign())
    assert await still_waiting(waiting)
    started = time.monotonic()
    await first.close(revoke=False)  # what a crash looks like: the lease runs out
    async with asyncio.timeout(TTL + 3):
        new = await waiting
    # docs/architecture.md, "Leadership, sharding and liveness": about TTL + 1 s (etcd's
    # expiry check + the campaign); slack for load
    assert time.monotonic() - started < TTL + 2
    assert not await fenced_put(etcd, old, f"{key_root}/fenced")
    assert await fenced_put(etcd, new, f"{key_root}/fenced")


async def test_resign_hands_over(etcd, prefix, sessions) -> None:
    first = await new_session(etcd, sessions)
    second = await new_session(etcd, sessions)
    first_election = election(etcd, first, prefix, "a")
    old = await first_election.campaign()
    waiting = asyncio.create_task(election(etcd, second, prefix, "b").campaign())
    assert await still_waiting(waiting)
    await first_election.resign()
    assert await etcd.get(old.key) is None
    async with asyncio.timeout(TTL):
        new = await waiting
    assert new.session is second
    assert not first.lost.is_set()  # resigning keeps the session


async def test_cancelled_campaign_removes_its_key(etcd, prefix, sessions) -> None:
    first = await new_session(etcd, sessions)
    second = await new_session(etcd, sessions)
    await election(etcd, first, prefix, "a").campaign()
    waiting = asyncio.create_task(election(etcd, second, prefix, "b").campaign())
    assert await still_waiting(waiting)
    candidate = leader_key(prefix, second.lease_id)
    assert await etcd.get(candidate) is not None
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert await etcd.get(candidate) is None


async def test_campaign_fails_once_its_own_lease_is_gone(etcd, prefix, sessions) -> None:
    first = await new_session(etcd, sessions)
    second = await new_session(etcd, sessions)
    await election(etcd, first, prefix, "a").campaign()
    waiting = asyncio.create_task(election(etcd, second, prefix, "b").campaign())
    assert await still_waiting(waiting)
    await etcd.lease_revoke(second.lease_id)  # behind the session's back
    async with asyncio.timeout(TTL + 1):
        with pytest.raises(LeaseLost):
            await waiting
    assert second.lost.is_set()
    with pytest.raises(LeaseLost):
        await election(etcd, second, prefix, "b").campaign()


async def test_second_campaign_on_one_session_keeps_the_term(etcd, prefix, sessions) -> None:
    session = await new_session(etcd, sessions)
    lead = await election(etcd, session, prefix, "a").campaign()
    again = await election(etcd, session, prefix, "b").campaign()
    assert again.key == lead.key
    assert again.term == lead.term
    kv = await etcd.get(lead.key)
    assert kv is not None
    assert kv.value == b"b"  # proclaimed, as Go does


async def test_go_semantics_shard_keys_count_under_the_failover_prefix(
    etcd, prefix, sessions
) -> None:
    """Go ranges the whole ``<prefix>/``: an older shard campaigner blocks the failover one."""
    shard_session = await new_session(etcd, sessions)
    shard = await election(etcd, shard_session, f"{prefix}/shard-0", "s").campaign()
    failover_session = await new_session(etcd, sessions)
    waiting = asyncio.create_task(election(etcd, failover_session, prefix, "f").campaign())
    assert await still_waiting(waiting)
    observed = await observe_leader(etcd, prefix)
    assert observed is not None
    assert observed.key == shard.key
    await shard_session.close()
    async with asyncio.timeout(TTL):
        lead = await waiting
    assert lead.key == leader_key(prefix, failover_session.lease_id)


async def test_renew_deadline_counts_from_the_last_send(etcd) -> None:
    clock = FakeClock()
    session = await Session(etcd, ttl=TTL, clock=clock).start()
    try:
        assert session.renew_deadline_ok(1.0)
        clock.advance(1.5)
        assert not session.renew_deadline_ok(1.0)
        assert session.renew_deadline_ok(TTL)
    finally:
        await session.close()
    assert session.lost.is_set()
    assert not session.renew_deadline_ok(TTL)


async def test_a_swallowed_cancellation_is_still_honoured_by_the_leader_loop() -> None:
    """Some awaited calls return normally although their task was cancelled (the leader loop
    once outlived shutdown that way); the loop's check raises the cancellation it missed."""

    async def swallowing_call() -> None:  # what such a library call does
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return

    reached_loop = asyncio.Event()

    async def leader_like() -> None:
        await swallowing_call()
        reached_loop.set()
        while True:
            reraise_swallowed_cancel()
            await asyncio.sleep(0)

    task = asyncio.create_task(leader_like())
    await asyncio.sleep(0)  # into swallowing_call
    task.cancel()
    await asyncio.wait_for(reached_loop.wait(), 5)
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done, "the loop ran on after its cancellation"
    assert task.cancelled()


async def test_a_campaign_whose_guard_changed_writes_no_candidate_key(etcd, key_root) -> None:
    """The window between a replica's shard-topology check and its campaign: a record changed
    in between fails the campaign's own transaction, before any candidate key exists, and an
    unchanged one lets it lead."""
    layout = KeyLayout(root=key_root)
    guard = await settle_topology(etcd, layout, Topology("active-active", 4))
    await etcd.txn([], [Put(layout.topology, b'{"haMode":"active-active","shardCount":5}')])
    prefix = layout.leader_election(active_active=True, shard_index=0)
    async with Session(etcd, ttl=TTL) as session:
        with pytest.raises(Conflict, match="guarded key changed"):
            await Election(etcd, session, prefix, "stale", guard=[guard]).campaign()
        candidates, _ = await etcd.list_prefix(prefix + "/")
        assert candidates == []
        fresh = await settle_topology(etcd, layout, Topology("active-active", 5))
        leadership = await Election(etcd, session, prefix, "fresh", guard=[fresh]).campaign()
        assert leadership.key.startswith(prefix + "/")
