"""The bucket API against a real radosgw (Ceph Pacific from Debian) and a real OpenBao.

What is proved here, with the known Go bugs (persys-facts I.18/I.19/I.21) in mind:

* CreateBucket makes an RGW user whose generated keys can put and list objects in their bucket
  and nothing else; the keys are in Vault, and not in etcd, the scheduler's logs or RGW's logs.
* GetBucket/ListBuckets report owner, object count and size from Admin Ops stats.
* GetBucketAccess says where the keys are, without the secret (returned once, by CreateBucket).
* DeleteBucket refuses a non-empty bucket without force; with force the bucket, its user and its
  Vault secret are gone; a foreign bucket is never deleted; leftovers of a crash are cleaned.
* Failures answer the right gRPC status: INVALID_ARGUMENT naming the field, NOT_FOUND,
  ALREADY_EXISTS, FAILED_PRECONDITION (not configured, not empty), UNAVAILABLE (Vault down on
  create, with the bucket and user rolled back).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import boto3
import grpc
import hvac
import pytest
import requests
from botocore.config import Config
from botocore.exceptions import ClientError

from handlers.settings.buckets import BucketsConfig, load_buckets_config
from handlers.settings.config import ConfigError
from handlers.storage.buckets import (
    BucketCommands,
    BucketError,
    _Rgw,
    bucket_name,
    canonical_query,
    user_for,
)
from handlers.vault.client import VaultError, VaultKV, refresh_after
from ops.devstack.process import free_port
from ops.openbao import OpenBaoProcess
from ops.rgw import RgwCluster
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import control_stub, make_settings, running_scheduler
from tests.fixtures.storage import bucket_prefix, openbao_server, rgw_server, vault_prefix
from tests.fixtures.waiting import wait_for

__all__ = ["bucket_prefix", "openbao_server", "rgw_server", "vault_prefix"]

pytestmark = pytest.mark.timeout(180)

BUCKET_ENV = ("PERSYS_RGW_ENDPOINT", "PERSYS_S3_ENDPOINT", "PERSYS_RGW_ACCESS_KEY",
              "PERSYS_S3_ACCESS_KEY", "PERSYS_RGW_SECRET_KEY", "PERSYS_S3_SECRET_KEY",
              "PERSYS_RGW_REGION", "PERSYS_RGW_ADMIN_PATH", "PERSYS_RGW_VAULT_PATH_PREFIX",
              "PERSYS_VAULT_ADDR", "PERSYS_VAULT_TOKEN", "PERSYS_VAULT_APPROLE_MOUNT",
              "PERSYS_VAULT_APPROLE_ROLE_ID", "PERSYS_VAULT_APPROLE_SECRET_ID")


# -- helpers ------------------------------------------------------------------------------------


def bucket_env(rgw: RgwCluster, bao: OpenBaoProcess | None, prefix: str,
               **extra: str) -> dict[str, str]:
    env = {"PERSYS_RGW_ENDPOINT": rgw.endpoint, "PERSYS_RGW_ACCESS_KEY": rgw.access_key,
           "PERSYS_RGW_SECRET_KEY": rgw.secret_key, "PERSYS_RGW_VAULT_PATH_PREFIX": prefix}
    if bao is not None:
        env.update(PERSYS_VAULT_ADDR=bao.addr, PERSYS_VAULT_TOKEN=bao.root_token)
    env.update(extra)
    return env


def commands(env: dict[str, str]) -> BucketCommands:
    config = load_buckets_config(env)
    assert config is not None
    vault = VaultKV(config.vault) if config.vault else None
    return BucketCommands(config, vault=vault)


def s3_client(endpoint: str, access_key: str, secret_key: str) -> Any:
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, region_name="default",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


def admin_rgw(rgw: RgwCluster) -> _Rgw:
    return _Rgw(BucketsConfig(endpoint=rgw.endpoint, access_key=rgw.access_key,
                              secret_key=rgw.secret_key))


def vault_read(bao: OpenBaoProcess, prefix: str, bucket: str) -> dict[str, str] | None:
    mount, _, path = prefix.partition("/data/")
    client = hvac.Client(url=bao.addr, token=bao.root_token, timeout=5)
    try:
        resp = client.secrets.kv.v2.read_secret_version(
            path=f"{path}/{bucket}", mount_point=mount, raise_on_deleted_version=True)
    except hvac.exceptions.InvalidPath:
        return None
    finally:
        client.adapter.close()
    return dict(resp["data"]["data"])


def etcd_dump(endpoint: str) -> bytes:
    """Every key and value in the etcd (all tests' roots), concatenated."""
    everything = base64.b64encode(b"\0").decode()
    resp = requests.post(f"http://{endpoint}/v3/kv/range",
                         json={"key": everything, "range_end": everything}, timeout=10)
    resp.raise_for_status()
    out = bytearray()
    for kv in resp.json().get("kvs", []):
        out += base64.b64decode(kv.get("key", "")) + b"\n"
        out += base64.b64decode(kv.get("value", "")) + b"\n"
    return bytes(out)


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def bucket_error(call: Awaitable[Any]) -> BucketError:
    with pytest.raises(BucketError) as info:
        await call
    return info.value


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


TIMINGS: dict[str, list[float]] = {}


async def timed(name: str, call: Callable[[], Awaitable[Any]]) -> Any:
    started = time.perf_counter()
    try:
        return await call()
    finally:
        TIMINGS.setdefault(name, []).append((time.perf_counter() - started) * 1000)


# -- pure units ---------------------------------------------------------------------------------


def test_canonical_query_sorts_encodes_and_keeps_bare_keys():
    assert canonical_query({"uid": "p1", "display-name": "Persys bucket x", "key": ""}) == (
        "display-name=Persys%20bucket%20x&key=&uid=p1")
    assert canonical_query({"prefix": "a/b+c~d"}) == "prefix=a%2Fb%2Bc~d"


@pytest.mark.parametrize("raw", ["", " ", "ab", "-abc", "abc-", "a" * 64, "has_underscore",
                                 "a..b", "192.168.1.1", "bad/name", "ok.but space"])
def test_bad_bucket_names_are_refused_naming_the_field(raw):
    with pytest.raises(BucketError) as info:
        bucket_name(raw, "name")
    assert info.value.code == "INVALID_ARGUMENT"
    assert str(info.value).startswith("name: ")


def test_bucket_names_are_trimmed_and_lower_cased():
    assert bucket_name("  My-Bucket.1 ", "name") == "my-bucket.1"
    assert user_for("my-bucket.1") == "persys-bkt-my-bucket.1"


@pytest.mark.parametrize(("lease", "after"), [(0, 2880), (3600, 2880), (120, 96), (70, 60),
                                              (40, 30), (20, 10), (8, 4)])
def test_token_refresh_schedule(lease, after):
    assert refresh_after(lease) == pytest.approx(after)
    assert refresh_after(lease or 3600) < (lease or 3600)


def test_config_is_optional_strict_and_hides_secrets():
    assert load_buckets_config({}) is None
    base = {"PERSYS_S3_ENDPOINT": "http://rgw:8080", "PERSYS_S3_ACCESS_KEY": "AK",
            "PERSYS_S3_SECRET_KEY": "very-secret"}
    config = load_buckets_config(base)
    assert config is not None
    assert (config.region, config.admin_path, config.kv_mount, config.kv_path) == (
        "default", "admin", "secret", "persys/rgw/buckets")
    assert config.vault is None
    assert "very-secret" not in repr(config)
    for env, variable in [
        ({"PERSYS_RGW_ENDPOINT": "http://rgw"}, "PERSYS_RGW_ACCESS_KEY"),
        ({**base, "PERSYS_RGW_ENDPOINT": "rgw:8080"}, "PERSYS_RGW_ENDPOINT"),
        ({**base, "PERSYS_RGW_VAULT_PATH_PREFIX": "secret/persys"},
         "PERSYS_RGW_VAULT_PATH_PREFIX"),
        ({**base, "PERSYS_VAULT_ADDR": "http://vault:8200"}, "PERSYS_VAULT_TOKEN"),
        ({**base, "PERSYS_VAULT_ADDR": "http://v:8200", "PERSYS_VAULT_APPROLE_ROLE_ID": "r"},
         "PERSYS_VAULT_APPROLE_SECRET_ID"),
    ]:
        with pytest.raises(ConfigError, match=variable):
            load_buckets_config(env)
    vault = load_buckets_config({**base, "PERSYS_VAULT_ADDR": "http://v:8200",
                                 "PERSYS_VAULT_TOKEN": "tok-secret"})
    assert vault is not None
    assert vault.vault is not None
    assert "tok-secret" not in repr(vault)


# -- the whole API over gRPC ---------------------------------------------------------------------


async def test_bucket_lifecycle_over_grpc(etcd_server, key_root, stream_key, rgw_server,
                                          openbao_server, vault_prefix, bucket_prefix,
                                          monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    for name, value in bucket_env(rgw_server, openbao_server, vault_prefix).items():
        monkeypatch.setenv(name, value)
    main, other = f"{bucket_prefix}-main", f"{bucket_prefix}-other"
    settings = make_settings(etcd_server, None, key_root, stream_key)
    async with running_scheduler(settings) as sched, control_stub(
            f"127.0.0.1:{sched.grpc_port}") as stub:
        created = await timed("CreateBucket", lambda: stub.CreateBucket(
            pb.CreateBucketRequest(name=f"  {main.upper()} ")))
        view, access = created.bucket, created.access
        assert (view.id, view.name, view.phase, view.region) == (main, main, "Available",
                                                                 "default")
        assert view.owner == "admin"
        assert view.object_count == 0
        assert not view.versioning
        assert view.endpoint == rgw_server.endpoint
        assert view.created_at.seconds > 0
        assert access.secret_key
        assert access.access_key
        assert access.bucket == main
        assert access.vault_path == f"{vault_prefix}/{main}"
        assert access.s3_url == f"s3://{main}"
        other_access = (await stub.CreateBucket(pb.CreateBucketRequest(name=other))).access

        # the keys are in Vault ...
        assert vault_read(openbao_server, vault_prefix, main) == {
            "endpoint": rgw_server.endpoint, "region": "default", "bucket": main,
            "access_key": access.access_key, "secret_key": access.secret_key,
            "s3_url": f"s3://{main}"}
        # ... and nowhere else: not in etcd, not in our logs, not in RGW's logs
        dump = etcd_dump(etcd_server.endpoint)
        for secret in (access.secret_key, other_access.secret_key, rgw_server.secret_key):
            assert secret.encode() not in dump
            assert secret not in caplog.text
        assert rgw_server.work_dir is not None
        for log_file in (rgw_server.work_dir / "log").glob("*"):
            text = log_file.read_bytes()
            assert access.secret_key.encode() not in text, log_file

        # the generated keys work in their bucket, and only there
        mine = s3_client(rgw_server.endpoint, access.access_key, access.secret_key)
        for i in range(5):
            mine.put_object(Bucket=main, Key=f"logs/{i}.txt", Body=b"x" * (10 + i))
        mine.put_object(Bucket=main, Key="readme", Body=b"hello")
        assert mine.list_objects_v2(Bucket=main)["KeyCount"] == 6
        for denied in (lambda: mine.put_object(Bucket=other, Key="k", Body=b"x"),
                       lambda: mine.list_objects_v2(Bucket=other),
                       lambda: mine.create_bucket(Bucket=f"{bucket_prefix}-stolen")):
            with pytest.raises(ClientError) as info:
                denied()
            assert info.value.response["Error"]["Code"] == "AccessDenied"
        theirs = s3_client(rgw_server.endpoint, other_access.access_key,
                           other_access.secret_key)
        with pytest.raises(ClientError):
            theirs.get_object(Bucket=main, Key="readme")

        listed = await timed("ListBuckets", lambda: stub.ListBuckets(pb.ListBucketsRequest()))
        names = [b.name for b in listed.buckets]
        assert names == sorted(names)
        assert {main, other} <= set(names)
        listed_main = next(b for b in listed.buckets if b.name == main)
        assert listed_main.object_count == 6
        assert listed_main.size_bytes == 5 * 10 + 10 + 5

        got = (await timed("GetBucket", lambda: stub.GetBucket(
            pb.GetBucketRequest(bucket_id=main.upper())))).bucket
        assert (got.object_count, got.size_bytes, got.owner) == (6, 65, "admin")
        assert got.created_at.seconds > 0
        assert got.updated_at.seconds > 0

        again = (await timed("GetBucketAccess", lambda: stub.GetBucketAccess(
            pb.GetBucketAccessRequest(bucket_id=main)))).access
        assert again.access_key == access.access_key
        assert again.secret_key == ""
        assert again.vault_path == access.vault_path
        assert again.endpoint == rgw_server.endpoint

        keys: list[str] = []
        token = ""
        pages = 0
        while True:
            page = await timed("ListBucketObjects", lambda t=token: stub.ListBucketObjects(
                pb.ListBucketObjectsRequest(bucket_id=main, prefix="logs/", max_keys=2,
                                            continuation_token=t)))
            pages += 1
            assert page.prefix == "logs/"
            assert len(page.objects) <= 2
            keys += [o.key for o in page.objects]
            if not page.is_truncated:
                assert page.next_continuation_token == ""
                break
            token = page.next_continuation_token
        assert keys == [f"logs/{i}.txt" for i in range(5)]
        assert pages == 3
        everything = await stub.ListBucketObjects(pb.ListBucketObjectsRequest(bucket_id=main))
        readme = next(o for o in everything.objects if o.key == "readme")
        assert readme.size_bytes == 5
        assert readme.etag
        assert '"' not in readme.etag
        assert readme.last_modified.endswith("Z")
        assert readme.storage_class == "STANDARD"

        refused = await rpc_error(stub.DeleteBucket(pb.DeleteBucketRequest(bucket_id=main)))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not empty" in refused.details()
        assert (await stub.GetBucket(pb.GetBucketRequest(bucket_id=main))).bucket.object_count

        deleted = await timed("DeleteBucket(force)", lambda: stub.DeleteBucket(
            pb.DeleteBucketRequest(bucket_id=main, force=True)))
        assert deleted.success
        assert not deleted.error_message
        gone = await rpc_error(stub.GetBucket(pb.GetBucketRequest(bucket_id=main)))
        assert gone.code() == grpc.StatusCode.NOT_FOUND
        assert vault_read(openbao_server, vault_prefix, main) is None
        assert not admin_rgw(rgw_server).user_exists(user_for(main))
        with pytest.raises(ClientError):
            mine.list_objects_v2(Bucket=main)
        missing = await rpc_error(stub.DeleteBucket(pb.DeleteBucketRequest(bucket_id=main)))
        assert missing.code() == grpc.StatusCode.NOT_FOUND

        empty = await timed("DeleteBucket", lambda: stub.DeleteBucket(
            pb.DeleteBucketRequest(bucket_id=other)))
        assert empty.success
        assert vault_read(openbao_server, vault_prefix, other) is None
        assert other not in [b.name for b in
                             (await stub.ListBuckets(pb.ListBucketsRequest())).buckets]
        assert access.secret_key not in caplog.text
    for name, values in sorted(TIMINGS.items()):  # shown with pytest -s
        print(f"bucket RPC {name}: n={len(values)} min={min(values):.1f}ms "
              f"max={max(values):.1f}ms")


async def test_invalid_arguments_name_the_field(etcd_server, key_root, stream_key, rgw_server,
                                                openbao_server, vault_prefix, monkeypatch):
    for name, value in bucket_env(rgw_server, openbao_server, vault_prefix).items():
        monkeypatch.setenv(name, value)
    settings = make_settings(etcd_server, None, key_root, stream_key)
    async with running_scheduler(settings) as sched, control_stub(
            f"127.0.0.1:{sched.grpc_port}") as stub:
        cases = [
            ("name: ", stub.CreateBucket(pb.CreateBucketRequest(name="ab"))),
            ("name: ", stub.CreateBucket(pb.CreateBucketRequest(name="Bad_Name"))),
            ("name: ", stub.CreateBucket(pb.CreateBucketRequest(name=""))),
            ("region: ", stub.CreateBucket(pb.CreateBucketRequest(name="fine-name",
                                                                  region="eu-west-1"))),
            ("bucket_id: ", stub.GetBucket(pb.GetBucketRequest(bucket_id="x"))),
            ("bucket_id: ", stub.DeleteBucket(pb.DeleteBucketRequest(bucket_id="-x-"))),
            ("bucket_id: ", stub.GetBucketAccess(pb.GetBucketAccessRequest(bucket_id=""))),
            ("bucket_id: ", stub.ListBucketObjects(pb.ListBucketObjectsRequest(
                bucket_id="a..b"))),
            ("max_keys: ", stub.ListBucketObjects(pb.ListBucketObjectsRequest(
                bucket_id="fine-name", max_keys=-1))),
        ]
        for field, call in cases:
            err = await rpc_error(call)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.details())
            assert err.details().startswith(field), err.details()
        for call in (stub.GetBucket(pb.GetBucketRequest(bucket_id="no-such-bucket-here")),
                     stub.GetBucketAccess(pb.GetBucketAccessRequest(
                         bucket_id="no-such-bucket-here")),
                     stub.ListBucketObjects(pb.ListBucketObjectsRequest(
                         bucket_id="no-such-bucket-here"))):
            assert (await rpc_error(call)).code() == grpc.StatusCode.NOT_FOUND


async def test_without_rgw_config_every_bucket_rpc_fails_precondition(
        etcd_server, key_root, stream_key, monkeypatch):
    for name in BUCKET_ENV:
        monkeypatch.delenv(name, raising=False)
    settings = make_settings(etcd_server, None, key_root, stream_key)
    async with running_scheduler(settings) as sched, control_stub(
            f"127.0.0.1:{sched.grpc_port}") as stub:
        assert sched.servicer.buckets is None
        for call in (stub.CreateBucket(pb.CreateBucketRequest(name="abc")),
                     stub.ListBuckets(pb.ListBucketsRequest()),
                     stub.GetBucket(pb.GetBucketRequest(bucket_id="abc")),
                     stub.DeleteBucket(pb.DeleteBucketRequest(bucket_id="abc")),
                     stub.GetBucketAccess(pb.GetBucketAccessRequest(bucket_id="abc")),
                     stub.ListBucketObjects(pb.ListBucketObjectsRequest(bucket_id="abc"))):
            err = await rpc_error(call)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "PERSYS_RGW_ENDPOINT" in err.details()


# -- BucketCommands directly --------------------------------------------------------------------


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
