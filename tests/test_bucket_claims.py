"""Reviewer's reproductions for the bucket API (real RGW and OpenBao)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from handlers.storage.buckets import user_for
from tests.fixtures.storage import bucket_prefix, openbao_server, rgw_server, vault_prefix
from tests.fixtures.waiting import wait_for
from tests.test_buckets import admin_rgw, bucket_env, commands, vault_read

__all__ = ["bucket_prefix", "openbao_server", "rgw_server", "vault_prefix"]

pytestmark = pytest.mark.timeout(180)


async def test_a_create_cancelled_during_the_vault_claim_leaves_the_name_free(
        rgw_server, openbao_server, vault_prefix, bucket_prefix):
    """The client's deadline passes while Vault is writing the claim: the write still takes
    effect in its thread, so the claim must be released, or the name is blocked (create:
    ALREADY_EXISTS, delete: ABORTED) for CLAIM_LIVE_S."""
    cmds = commands(bucket_env(rgw_server, openbao_server, vault_prefix))
    assert cmds.vault is not None
    name = f"{bucket_prefix}-cancel-claim"
    real = cmds.vault._call
    entered, finished = threading.Event(), threading.Event()

    def slow(call: Any, what: str) -> Any:
        if what != "write" or entered.is_set():
            return real(call, what)
        entered.set()
        try:
            time.sleep(0.5)  # allowed: Vault's latency, in Vault's thread
            return real(call, what)
        finally:
            finished.set()

    cmds.vault._call = slow  # type: ignore[method-assign]
    try:
        create = asyncio.create_task(cmds.create(name))
        await wait_for(entered.is_set, timeout=30, message="the claim write never started")
        create.cancel()  # the client's deadline passed
        with pytest.raises(asyncio.CancelledError):
            await create
        await wait_for(finished.is_set, timeout=30, message="the claim write never ended")
        assert not admin_rgw(rgw_server).user_exists(user_for(name))
        assert vault_read(openbao_server, vault_prefix, name) is None, (
            "the cancelled create's claim stayed in Vault")
        info, _ = await cmds.create(name)  # the name is free again
        assert info.name == name
        await cmds.delete(name)
    finally:
        await cmds.aclose()


