"""BucketCommands directly, against a real radosgw and a real OpenBao: versioning, duplicate
names, the AppRole token's renewal, and how a missing Vault, an unreachable RGW, wrong
control-plane keys and a bucket of another RGW user are answered."""

from __future__ import annotations

import logging
import uuid

import pytest

from handlers.settings.buckets import load_buckets_config
from handlers.storage.buckets.commands import BucketCommands
from handlers.vault.client import VaultKV
from ops.devstack.process import free_port
from tests.fixtures.buckets import (
    Clock,
    admin_rgw,
    bucket_env,
    bucket_error,
    commands,
    s3_client,
    vault_read,
)
from tests.fixtures.storage import bucket_prefix, openbao_server, rgw_server, vault_prefix

__all__ = ["bucket_prefix", "openbao_server", "rgw_server", "vault_prefix"]

pytestmark = pytest.mark.timeout(180)


async def test_versioning_and_duplicate_names(rgw_server, openbao_server, vault_prefix,
                                              bucket_prefix):
    cmds = commands(bucket_env(rgw_server, openbao_server, vault_prefix))
    name = f"{bucket_prefix}.versioned"
    try:
        info, _ = await cmds.create(name, region="default", versioning=True)
        assert info.versioning
        assert (await cmds.get(name)).versioning
        admin = s3_client(rgw_server.endpoint, rgw_server.access_key, rgw_server.secret_key)
        assert admin.get_bucket_versioning(Bucket=name)["Status"] == "Enabled"
        dup = await bucket_error(cmds.create(name.upper()))
        assert dup.code == "ALREADY_EXISTS"
        admin.put_object(Bucket=name, Key="k", Body=b"1")
        admin.put_object(Bucket=name, Key="k", Body=b"2")
        refused = await bucket_error(cmds.delete(name))
        assert refused.code == "FAILED_PRECONDITION"
        await cmds.delete(name, force=True)  # purges every version too
        assert (await bucket_error(cmds.get(name))).code == "NOT_FOUND"
    finally:
        await cmds.aclose()


async def test_approle_token_is_renewed_and_replaced(rgw_server, openbao_server, vault_prefix,
                                                     bucket_prefix, caplog):
    caplog.set_level(logging.INFO, logger="persys.vault")
    mount, _, path = vault_prefix.partition("/data/")
    role = f"rw-{uuid.uuid4().hex[:8]}"
    role_id, secret_id = openbao_server.approle(
        role, f'path "{mount}/data/{path}/*" {{ capabilities = ["create","read","update",'
              f'"delete"] }}\npath "{mount}/metadata/{path}/*" {{ capabilities = ["delete"] }}',
        token_ttl="2m")
    config = load_buckets_config(bucket_env(
        rgw_server, None, vault_prefix, PERSYS_VAULT_ADDR=openbao_server.addr,
        PERSYS_VAULT_APPROLE_ROLE_ID=role_id, PERSYS_VAULT_APPROLE_SECRET_ID=secret_id))
    assert config is not None
    assert config.vault is not None
    clock = Clock()
    vault = VaultKV(config.vault, clock=clock)
    cmds = BucketCommands(config, vault=vault)
    name = f"{bucket_prefix}-approle"
    try:
        _, access = await cmds.create(name)
        assert caplog.text.count("vault approle login ok") == 1
        clock.now += 100  # past 80 % of the 120 s lease
        assert (await cmds.access(name)).access_key == access.access_key
        assert "vault token renewed" in caplog.text
        # a revoked token is replaced by a fresh login, and the call still succeeds
        openbao_server.api("POST", "auth/token/revoke", {"token": vault._client.token})
        await cmds.delete(name)
        assert caplog.text.count("vault approle login ok") == 2
        assert vault_read(openbao_server, vault_prefix, name) is None
        assert secret_id not in caplog.text
        assert access.secret_key not in caplog.text
    finally:
        await cmds.aclose()


async def test_without_vault_reads_work_and_credential_calls_fail_precondition(
        rgw_server, vault_prefix):
    cmds = commands(bucket_env(rgw_server, None, vault_prefix))
    try:
        assert isinstance(await cmds.list(), list)
        for call in (cmds.create("abc-def"), cmds.delete("abc-def"), cmds.access("abc-def")):
            err = await bucket_error(call)
            assert err.code == "FAILED_PRECONDITION"
            assert "PERSYS_VAULT_ADDR" in str(err)
    finally:
        await cmds.aclose()


async def test_rgw_down_is_unavailable(vault_prefix):
    cmds = commands({"PERSYS_RGW_ENDPOINT": f"http://127.0.0.1:{free_port()}",
                     "PERSYS_RGW_ACCESS_KEY": "ak", "PERSYS_RGW_SECRET_KEY": "sk",
                     "PERSYS_RGW_VAULT_PATH_PREFIX": vault_prefix})
    try:
        for call in (cmds.list(), cmds.get("abc-def"), cmds.list_objects("abc-def")):
            assert (await bucket_error(call)).code == "UNAVAILABLE"
    finally:
        await cmds.aclose()


async def test_wrong_control_plane_keys_fail_precondition(rgw_server, vault_prefix):
    cmds = commands({"PERSYS_RGW_ENDPOINT": rgw_server.endpoint,
                     "PERSYS_RGW_ACCESS_KEY": rgw_server.access_key,
                     "PERSYS_RGW_SECRET_KEY": "wrong-secret",
                     "PERSYS_RGW_VAULT_PATH_PREFIX": vault_prefix})
    try:
        err = await bucket_error(cmds.list())
        assert err.code == "FAILED_PRECONDITION"
        assert "PERSYS_RGW_SECRET_KEY" in str(err)
        assert "wrong-secret" not in str(err)
    finally:
        await cmds.aclose()


async def test_a_foreign_bucket_is_never_deleted(rgw_server, openbao_server, vault_prefix,
                                                 bucket_prefix):
    admin = admin_rgw(rgw_server)
    uid = f"foreign-{bucket_prefix}"
    access_key, secret_key = admin.create_user(uid, "someone else")
    name = f"{bucket_prefix}-foreign"
    foreign = s3_client(rgw_server.endpoint, access_key, secret_key)
    cmds = commands(bucket_env(rgw_server, openbao_server, vault_prefix))
    try:
        # create_user gives max-buckets=-1; let this user own buckets
        admin.admin("POST", "user", {"uid": uid, "max-buckets": "10"})
        foreign.create_bucket(Bucket=name)
        foreign.put_object(Bucket=name, Key="theirs", Body=b"data")
        err = await bucket_error(cmds.delete(name, force=True))
        assert err.code == "FAILED_PRECONDITION"
        assert uid in str(err)
        assert foreign.list_objects_v2(Bucket=name)["KeyCount"] == 1
    finally:
        await cmds.aclose()
        foreign.delete_object(Bucket=name, Key="theirs")
        foreign.delete_bucket(Bucket=name)
        admin.delete_user(uid)
        admin.close()
