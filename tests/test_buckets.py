"""The bucket API against a real radosgw (Ceph Pacific from Debian) and a real OpenBao.

What is proved here, with the known Go bugs in mind (docs/compatibility.md, "Bucket API rules",
"Vault access" and "Open authorization"):

* CreateBucket makes an RGW user whose generated keys can put and list objects in their bucket
  and nothing else; the keys are in Vault, and not in etcd, the scheduler's logs or RGW's logs.
* GetBucket/ListBuckets report owner, object count and size from Admin Ops stats.
* GetBucketAccess says where the keys are, without the secret (returned once, by CreateBucket).
* DeleteBucket refuses a non-empty bucket without force; with force the bucket, its user and its
  Vault secret are gone; a foreign bucket is never deleted; leftovers of a crash are cleaned.
* Failures answer the right gRPC status: INVALID_ARGUMENT naming the field, NOT_FOUND,
  ALREADY_EXISTS, FAILED_PRECONDITION (not configured, not empty), UNAVAILABLE (Vault down on
  create, with the bucket and user rolled back).

This file drives the whole API over gRPC; BucketCommands is driven directly by
test_bucket_commands.py, test_bucket_rollback.py (failed and cancelled creates) and
test_bucket_claims.py (the name claim in Vault); the pure parts are in test_bucket_units.py.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
import requests
from botocore.exceptions import ClientError

from handlers.storage.buckets.validation import user_for
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.buckets import admin_rgw, bucket_env, s3_client, vault_read
from tests.fixtures.harness import control_stub, make_settings, running_scheduler
from tests.fixtures.storage import bucket_prefix, openbao_server, rgw_server, vault_prefix

__all__ = ["bucket_prefix", "openbao_server", "rgw_server", "vault_prefix"]

pytestmark = pytest.mark.timeout(180)

BUCKET_ENV = ("PERSYS_RGW_ENDPOINT", "PERSYS_S3_ENDPOINT", "PERSYS_RGW_ACCESS_KEY",
              "PERSYS_S3_ACCESS_KEY", "PERSYS_RGW_SECRET_KEY", "PERSYS_S3_SECRET_KEY",
              "PERSYS_RGW_REGION", "PERSYS_RGW_ADMIN_PATH", "PERSYS_RGW_VAULT_PATH_PREFIX",
              "PERSYS_VAULT_ADDR", "PERSYS_VAULT_TOKEN", "PERSYS_VAULT_APPROLE_MOUNT",
              "PERSYS_VAULT_APPROLE_ROLE_ID", "PERSYS_VAULT_APPROLE_SECRET_ID")


# -- helpers ------------------------------------------------------------------------------------


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


TIMINGS: dict[str, list[float]] = {}


async def timed(name: str, call: Callable[[], Awaitable[Any]]) -> Any:
    started = time.perf_counter()
    try:
        return await call()
    finally:
        TIMINGS.setdefault(name, []).append((time.perf_counter() - started) * 1000)


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
