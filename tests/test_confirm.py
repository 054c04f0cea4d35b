"""``persys-scheduler confirm-empty-state`` against a real etcd: it ends recovery mode only when
the state is really empty, and it never touches state keys."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from eventsource.etcd import AsyncEtcd, Put
from eventsource.keys import KeyLayout
from handlers.cluster.modes import NORMAL, RECOVERY, decide_mode
from handlers.cluster.supervisor import has_state
from ops.confirm import confirm_empty_state
from ops.devstack.etcd import EtcdProcess


@pytest.fixture
async def etcd(etcd_server: EtcdProcess) -> AsyncIterator[AsyncEtcd]:
    client = AsyncEtcd([etcd_server.endpoint], timeout=3.0)
    try:
        yield client
    finally:
        client.close()


async def mark(etcd: AsyncEtcd, layout: KeyLayout) -> None:
    assert (await etcd.txn([], [Put(layout.initialized, b"2026-01-01T00:00:00Z")])).succeeded


async def test_confirming_an_empty_state_deletes_only_the_marker(
        etcd: AsyncEtcd, key_root: str) -> None:
    layout = KeyLayout(key_root)
    await mark(etcd, layout)
    assert not await has_state(etcd, layout)

    code, message = await confirm_empty_state(etcd, layout)
    assert (code, message.split(":")[0]) == (0, "confirmed")
    assert await etcd.get(layout.initialized) is None
    # a second confirmation has nothing to do, and says so
    code, message = await confirm_empty_state(etcd, layout)
    assert code == 0
    assert "no initialized marker" in message


async def test_confirming_is_refused_when_state_exists(etcd: AsyncEtcd, key_root: str) -> None:
    layout = KeyLayout(key_root)
    await mark(etcd, layout)
    await etcd.txn([], [Put(layout.node("n1"), b"{}")])

    code, message = await confirm_empty_state(etcd, layout)
    assert code == 1
    assert "refused" in message
    assert await etcd.get(layout.initialized) is not None
    assert await etcd.get(layout.node("n1")) is not None


def test_the_recovery_reason_names_the_command() -> None:
    from handlers.cluster.modes import Probe

    mode, reason = decide_mode(Probe(etcd_ok=True, initialized=True, has_state=False,
                                     allow_empty_state=False))
    assert mode == RECOVERY
    assert "persys-scheduler confirm-empty-state" in reason
    assert decide_mode(Probe(etcd_ok=True, initialized=False, has_state=False,
                             allow_empty_state=False))[0] == NORMAL
