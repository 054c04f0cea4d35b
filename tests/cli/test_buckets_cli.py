"""``persys buckets ...`` against a scheduler with the bucket API on a real Ceph RGW and
OpenBao."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.cli.stack import persys_async
from tests.fixtures.buckets import bucket_env, s3_client
from tests.fixtures.harness import make_settings, running_scheduler
from tests.fixtures.storage import bucket_prefix, openbao_server, rgw_server, vault_prefix

__all__ = ["bucket_prefix", "openbao_server", "rgw_server", "vault_prefix"]

pytestmark = pytest.mark.timeout(180)


async def test_bucket_commands(etcd_server, key_root, stream_key, rgw_server,  # type: ignore[no-untyped-def]
                               openbao_server, vault_prefix, bucket_prefix, monkeypatch) -> None:
    for name, value in bucket_env(rgw_server, openbao_server, vault_prefix).items():
        monkeypatch.setenv(name, value)
    name = f"{bucket_prefix}-cli"
    settings = make_settings(etcd_server, None, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        env = {"PERSYS_SERVER": f"127.0.0.1:{sched.grpc_port}"}

        async def ok(*args: str) -> str:
            code, out, err = await persys_async(*args, env=env)
            assert code == 0, (args, err)
            return out

        created = json.loads(await ok("buckets", "create", name, "-o", "json"))
        made, secret = created["bucket"], created["access"]["secret_key"]
        assert secret
        assert made["name"] == name
        assert made["phase"] == "Available"
        listed = json.loads(await ok("buckets", "list", "-o", "json"))["buckets"]
        assert name in {b["name"] for b in listed}
        got = json.loads(await ok("buckets", "get", made["id"], "-o", "json"))
        assert got["id"] == made["id"]
        access = json.loads(await ok("buckets", "access", made["id"], "-o", "json"))
        assert access["bucket"] == name
        assert access["secret_key"] == ""  # shown once, by create
        assert access["vault_path"]
        s3 = s3_client(rgw_server.endpoint, access["access_key"], secret)
        await asyncio.to_thread(s3.put_object, Bucket=name, Key="hello.txt", Body=b"hi")
        objects = json.loads(await ok("buckets", "objects", made["id"], "-o", "json"))
        assert [o["key"] for o in objects["objects"]] == ["hello.txt"]
        assert "hello.txt" in await ok("buckets", "objects", made["id"])
        code, _, err = await persys_async("buckets", "delete", made["id"], env=env)
        assert code == 1, err  # it holds an object
        await ok("buckets", "delete", made["id"], "--force")
        code, _, err = await persys_async("buckets", "get", made["id"], env=env)
        assert code == 1
        assert "NOT_FOUND" in err
