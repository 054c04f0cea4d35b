"""The name claim in Vault (real RGW and OpenBao): one creator wins a name across replicas,
a claim whose write was cancelled or whose answer was lost is released, and DeleteBucket
leaves a create in progress alone. The first test is a reviewer's reproduction."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from handlers.storage.buckets.model import BucketError
from handlers.storage.buckets.validation import user_for
from handlers.vault.client import VaultError
from tests.fixtures.buckets import (
    admin_rgw,
    bucket_env,
    bucket_error,
    commands,
    s3_client,
    vault_read,
)
from tests.fixtures.storage import bucket_prefix, openbao_server, rgw_server, vault_prefix
from tests.fixtures.waiting import wait_for

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


async def test_replicas_racing_for_one_name_get_one_working_bucket(
        rgw_server, openbao_server, vault_prefix, bucket_prefix):
    env = bucket_env(rgw_server, openbao_server, vault_prefix)
    replicas = [commands(env) for _ in range(4)]
    try:
        for round_ in range(3):
            name = f"{bucket_prefix}-race{round_}"
            results = await asyncio.gather(*(r.create(name) for r in replicas),
                                           return_exceptions=True)
            won = [r for r in results if not isinstance(r, BaseException)]
            lost = [r for r in results if isinstance(r, BaseException)]
            assert len(won) == 1, results
            assert all(isinstance(e, BucketError) and e.code == "ALREADY_EXISTS"
                       for e in lost), lost
            _, access = won[0]
            stored = vault_read(openbao_server, vault_prefix, name)
            assert stored is not None
            assert stored["access_key"] == access.access_key
            assert stored["secret_key"] == access.secret_key
            client = s3_client(rgw_server.endpoint, access.access_key, access.secret_key)
            client.put_object(Bucket=name, Key="k", Body=b"v")
            assert client.list_objects_v2(Bucket=name)["KeyCount"] == 1
            await replicas[0].delete(name, force=True)
    finally:
        for r in replicas:
            await r.aclose()


async def test_a_claim_whose_answer_was_lost_is_released(rgw_server, openbao_server,
                                                         vault_prefix, bucket_prefix):
    """Vault applied the claim but its answer never came: the claim is recognised by its
    nonce and removed, so a retry is not told the name is being created elsewhere."""
    cmds = commands(bucket_env(rgw_server, openbao_server, vault_prefix))
    assert cmds.vault is not None
    name = f"{bucket_prefix}-lostclaim"
    write = cmds.vault.write

    async def applied_then_lost(*args: Any, **kwargs: Any) -> int:
        await write(*args, **kwargs)
        raise VaultError("unavailable", "vault: read timed out")

    cmds.vault.write = applied_then_lost  # type: ignore[method-assign]
    try:
        err = await bucket_error(cmds.create(name))
        assert err.code == "UNAVAILABLE"
        assert vault_read(openbao_server, vault_prefix, name) is None
        cmds.vault.write = write  # type: ignore[method-assign]
        info, _ = await cmds.create(name)
        assert info.name == name
        await cmds.delete(name)
    finally:
        await cmds.aclose()


async def test_delete_leaves_a_create_in_progress_alone(rgw_server, openbao_server,
                                                        vault_prefix, bucket_prefix):
    """DeleteBucket of a name another replica is creating (claimed, bucket not made yet) is
    refused instead of removing that create's user and keys; a stale claim is a leftover."""
    cmds = commands(bucket_env(rgw_server, openbao_server, vault_prefix))
    assert cmds.vault is not None
    name = f"{bucket_prefix}-inprogress"
    path = f"{vault_prefix.partition('/data/')[2]}/{name}"
    admin = admin_rgw(rgw_server)
    try:
        admin.create_user(user_for(name), "the other replica's create")
        await cmds.vault.write("secret", path, {"state": "creating", "claim": "x",
                                                "since": str(int(time.time()))}, cas=0)
        assert (await bucket_error(cmds.delete(name))).code == "ABORTED"
        assert admin.user_exists(user_for(name))
        # a claim older than any create can last is a crashed attempt's: removed
        await cmds.vault.write("secret", path, {"state": "creating", "claim": "x",
                                                "since": str(int(time.time()) - 3600)})
        await cmds.delete(name)
        assert not admin.user_exists(user_for(name))
        assert vault_read(openbao_server, vault_prefix, name) is None
    finally:
        await cmds.aclose()
