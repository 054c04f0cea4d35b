"""A create that fails or is cancelled midway leaves nothing behind (real radosgw and
OpenBao): Vault down, Vault refusing the claim or the final write, the client's deadline
passing during an RGW call, and the leftovers of a crashed create, which DeleteBucket removes."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest

from handlers.storage.buckets.validation import user_for
from ops.devstack.process import free_port
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


async def test_vault_down_on_create_answers_unavailable_and_makes_nothing(
        rgw_server, vault_prefix, bucket_prefix):
    env = bucket_env(rgw_server, None, vault_prefix,
                     PERSYS_VAULT_ADDR=f"http://127.0.0.1:{free_port()}",
                     PERSYS_VAULT_TOKEN="unused")
    cmds = commands(env)
    name = f"{bucket_prefix}-novault"
    try:
        err = await bucket_error(cmds.create(name))
        assert err.code == "UNAVAILABLE", str(err)
        admin = admin_rgw(rgw_server)
        assert admin.stats(name) is None
        assert not admin.user_exists(user_for(name))
        # GetBucketAccess with Vault down on an existing bucket: UNAVAILABLE as well
        admin_s3 = s3_client(rgw_server.endpoint, rgw_server.access_key, rgw_server.secret_key)
        admin_s3.create_bucket(Bucket=name)
        try:
            assert (await bucket_error(cmds.access(name))).code == "UNAVAILABLE"
        finally:
            admin_s3.delete_bucket(Bucket=name)
    finally:
        await cmds.aclose()


async def test_vault_write_failure_after_rgw_work_rolls_back(rgw_server, openbao_server,
                                                             vault_prefix, bucket_prefix):
    # "create" but no "update": the claim (cas=0) is allowed, the final write is not
    mount, _, path = vault_prefix.partition("/data/")
    role = f"noupdate-{uuid.uuid4().hex[:8]}"
    role_id, secret_id = openbao_server.approle(
        role, f'path "{mount}/data/{path}/*" {{ capabilities = ["create","read"] }}\n'
              f'path "{mount}/metadata/{path}/*" {{ capabilities = ["delete"] }}')
    env = bucket_env(rgw_server, None, vault_prefix, PERSYS_VAULT_ADDR=openbao_server.addr,
                     PERSYS_VAULT_APPROLE_ROLE_ID=role_id,
                     PERSYS_VAULT_APPROLE_SECRET_ID=secret_id)
    cmds = commands(env)
    name = f"{bucket_prefix}-noupdate"
    try:
        err = await bucket_error(cmds.create(name))
        assert err.code == "UNAVAILABLE", str(err)
        assert "permission denied" in str(err)
        assert str(err).endswith("; rolled back")
        assert admin_rgw(rgw_server).stats(name) is None
        assert not admin_rgw(rgw_server).user_exists(user_for(name))
        assert vault_read(openbao_server, vault_prefix, name) is None
    finally:
        await cmds.aclose()


async def test_vault_claim_denied_makes_nothing(rgw_server, openbao_server, vault_prefix,
                                                bucket_prefix):
    mount, _, path = vault_prefix.partition("/data/")
    role = f"ro-{uuid.uuid4().hex[:8]}"
    role_id, secret_id = openbao_server.approle(
        role, f'path "{mount}/data/{path}/*" {{ capabilities = ["read"] }}')
    env = bucket_env(rgw_server, None, vault_prefix, PERSYS_VAULT_ADDR=openbao_server.addr,
                     PERSYS_VAULT_APPROLE_ROLE_ID=role_id,
                     PERSYS_VAULT_APPROLE_SECRET_ID=secret_id)
    cmds = commands(env)
    name = f"{bucket_prefix}-readonly"
    try:
        err = await bucket_error(cmds.create(name))
        assert err.code == "UNAVAILABLE", str(err)
        assert "permission denied" in str(err)
        assert admin_rgw(rgw_server).stats(name) is None
        assert not admin_rgw(rgw_server).user_exists(user_for(name))
    finally:
        await cmds.aclose()


@pytest.mark.parametrize("slow_step", ["create_user", "create_bucket"])
async def test_a_create_cancelled_during_an_rgw_call_leaves_nothing(
        rgw_server, openbao_server, vault_prefix, bucket_prefix, slow_step):
    """The client's deadline passes while RGW is still making the user (or the bucket): the
    thread's call takes effect anyway, and the rollback, which waits for it, removes it and
    releases the name."""
    cmds = commands(bucket_env(rgw_server, openbao_server, vault_prefix))
    name = f"{bucket_prefix}-cancel-{slow_step.replace('_', '-')}"
    admin = admin_rgw(rgw_server)
    real = getattr(cmds._rgw, slow_step)
    entered, finished = threading.Event(), threading.Event()

    def slow(*args: Any) -> Any:
        entered.set()
        try:
            time.sleep(0.5)  # allowed: RGW's latency, in RGW's thread
            return real(*args)
        finally:
            finished.set()

    setattr(cmds._rgw, slow_step, slow)
    try:
        create = asyncio.create_task(cmds.create(name))
        await wait_for(entered.is_set, timeout=30, message=f"{slow_step} never called")
        create.cancel()  # the client's deadline passed
        with pytest.raises(asyncio.CancelledError):
            await create
        # RGW has finished the call the cancelled create started
        await wait_for(finished.is_set, timeout=30, message=f"{slow_step} never ended")
        assert not admin.user_exists(user_for(name))
        assert admin.stats(name) is None
        assert vault_read(openbao_server, vault_prefix, name) is None
        setattr(cmds._rgw, slow_step, real)
        info, _ = await cmds.create(name)  # the name is free again
        assert info.name == name
        await cmds.delete(name)
    finally:
        await cmds.aclose()


async def test_leftovers_of_a_crash_block_create_and_are_removed_by_delete(
        rgw_server, openbao_server, vault_prefix, bucket_prefix):
    env = bucket_env(rgw_server, openbao_server, vault_prefix)
    cmds = commands(env)
    name = f"{bucket_prefix}-crashed"
    admin = admin_rgw(rgw_server)
    try:
        # a create that died after making the user and writing the secret, before the bucket
        admin.create_user(user_for(name), "leftover")
        assert cmds.vault is not None
        await cmds.vault.write("secret", f"{vault_prefix.partition('/data/')[2]}/{name}",
                               {"access_key": "A", "secret_key": "S"})
        blocked = await bucket_error(cmds.create(name))
        assert blocked.code == "ALREADY_EXISTS"
        assert "DeleteBucket" in str(blocked)
        await cmds.delete(name)  # the bucket is gone, the leftovers are removed: success
        assert not admin.user_exists(user_for(name))
        assert vault_read(openbao_server, vault_prefix, name) is None
        assert (await bucket_error(cmds.delete(name))).code == "NOT_FOUND"
        # only a user left over (no secret): refused, and the claim is released again
        admin.create_user(user_for(name), "leftover")
        blocked = await bucket_error(cmds.create(name))
        assert blocked.code == "ALREADY_EXISTS"
        assert vault_read(openbao_server, vault_prefix, name) is None
        assert admin.user_exists(user_for(name))  # not ours to remove in a failed create
        await cmds.delete(name)
        info, _ = await cmds.create(name)
        assert info.name == name
        await cmds.delete(name)
    finally:
        await cmds.aclose()
