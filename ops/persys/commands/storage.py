"""``persys disks ...`` and ``persys buckets ...``: standalone volumes and S3 buckets."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from ops.persys.commands.common import output_option, require_accepted
from ops.persys.main import Session, pass_session
from ops.persys.output import emit, message_dict, new_table, stamp
from proto.persys.control.v1 import control_pb2


@click.group("disks")
def disks() -> None:
    """Standalone disks (create, list, get, delete)."""


def _disk_table(views: list[control_pb2.DiskView], wide: bool) -> Table:
    t = new_table("DISK", "NAME", "DRIVER", "SIZE", "PHASE", "NODE", "USED BY",
                  *(("ACCESS", "FS", "RETAIN", "MOUNT", "CREATED") if wide else ()))
    for d in views:
        row: list[Any] = [d.id, d.name, d.driver, f"{d.size_gb} GB", d.phase, d.node_id or "-",
                          ",".join(d.workload_refs) or "-"]
        if wide:
            row += [d.access_mode, d.fs_type, d.retain_policy, d.mount_path or "-",
                    stamp(d.created_at)]
        t.add_row(*row)
    return t


@disks.command("create")
@click.argument("name")
@click.option("--driver", default="local", show_default=True, help="local, ceph-rbd or nfs.")
@click.option("--size-gb", type=click.IntRange(1), required=True)
@click.option("--fs-type", default="")
@click.option("--access-mode", default="", help="ReadWriteOnce or ReadWriteMany.")
@click.option("--retain-policy", default="", help="Delete or Retain.")
@click.option("--node", "node_id", default="", help="The node of a local disk.")
@click.option("--mount-path", default="")
@output_option
@pass_session
def disk_create(session: Session, fmt: str, **fields: Any) -> None:
    answer = session.client.call("CreateDisk", control_pb2.CreateDiskRequest(**fields))
    emit(fmt, message_dict(answer.disk), lambda: _disk_table([answer.disk], fmt == "wide"))


@disks.command("list")
@output_option
@pass_session
def disk_list(session: Session, fmt: str) -> None:
    answer = session.client.call("ListDisks", control_pb2.ListDisksRequest())
    views = sorted(answer.disks, key=lambda d: d.id)
    emit(fmt, {"disks": [message_dict(d) for d in views]},
         lambda: _disk_table(views, fmt == "wide"))


@disks.command("get")
@click.argument("disk_id")
@output_option
@pass_session
def disk_get(session: Session, disk_id: str, fmt: str) -> None:
    answer = session.client.call("GetDisk", control_pb2.GetDiskRequest(disk_id=disk_id))
    emit(fmt, message_dict(answer.disk), lambda: _disk_table([answer.disk], True))


@disks.command("delete")
@click.argument("disk_id")
@click.option("--force", is_flag=True, help="Even while workloads use it.")
@pass_session
def disk_delete(session: Session, disk_id: str, force: bool) -> None:
    answer = session.client.call("DeleteDisk", control_pb2.DeleteDiskRequest(
        disk_id=disk_id, force=force))
    require_accepted(answer, f"disk {disk_id}")
    click.echo(f"disk {disk_id} deleted")


@click.group("buckets")
def buckets() -> None:
    """S3 buckets on Ceph RGW (create, list, get, delete, access, objects)."""


def _bucket_table(views: list[control_pb2.BucketView], wide: bool) -> Table:
    t = new_table("BUCKET", "NAME", "REGION", "PHASE", "OBJECTS", "SIZE",
                  *(("ENDPOINT", "VERSIONING", "CREATED", "ERROR") if wide else ()))
    for b in views:
        row: list[Any] = [b.id, b.name, b.region, b.phase, str(b.object_count),
                          f"{b.size_bytes} B"]
        if wide:
            row += [b.endpoint, str(b.versioning).lower(), stamp(b.created_at),
                    b.last_error or "-"]
        t.add_row(*row)
    return t


@buckets.command("create")
@click.argument("name")
@click.option("--region", default="")
@click.option("--versioning", is_flag=True)
@output_option
@pass_session
def bucket_create(session: Session, name: str, region: str, versioning: bool, fmt: str) -> None:
    """Create a bucket. Its secret key is printed this once; it is kept in Vault only."""
    answer = session.client.call("CreateBucket", control_pb2.CreateBucketRequest(
        name=name, region=region, versioning=versioning))

    def table() -> list[Any]:
        return [_bucket_table([answer.bucket], False), _access_table(answer.access),
                "the secret key is shown once: it is kept in Vault at "
                f"{answer.access.vault_path}"]

    emit(fmt, {"bucket": message_dict(answer.bucket), "access": message_dict(answer.access)},
         table)


def _access_table(a: control_pb2.BucketAccess) -> Table:
    t = new_table("", "")
    for key in ("endpoint", "region", "bucket", "s3_url", "access_key", "secret_key",
                "vault_path"):
        t.add_row(key, getattr(a, key) or "-")
    return t


@buckets.command("list")
@output_option
@pass_session
def bucket_list(session: Session, fmt: str) -> None:
    answer = session.client.call("ListBuckets", control_pb2.ListBucketsRequest())
    views = sorted(answer.buckets, key=lambda b: b.id)
    emit(fmt, {"buckets": [message_dict(b) for b in views]},
         lambda: _bucket_table(views, fmt == "wide"))


@buckets.command("get")
@click.argument("bucket_id")
@output_option
@pass_session
def bucket_get(session: Session, bucket_id: str, fmt: str) -> None:
    answer = session.client.call("GetBucket", control_pb2.GetBucketRequest(bucket_id=bucket_id))
    emit(fmt, message_dict(answer.bucket), lambda: _bucket_table([answer.bucket], True))


@buckets.command("delete")
@click.argument("bucket_id")
@click.option("--force", is_flag=True, help="Even when it holds objects.")
@pass_session
def bucket_delete(session: Session, bucket_id: str, force: bool) -> None:
    answer = session.client.call("DeleteBucket", control_pb2.DeleteBucketRequest(
        bucket_id=bucket_id, force=force))
    require_accepted(answer, f"bucket {bucket_id}")
    click.echo(f"bucket {bucket_id} deleted")


@buckets.command("access")
@click.argument("bucket_id")
@output_option
@pass_session
def bucket_access(session: Session, bucket_id: str, fmt: str) -> None:
    """The bucket's S3 endpoint, access key and where its secret is kept in Vault (the secret
    itself only `buckets create` prints)."""
    answer = session.client.call("GetBucketAccess",
                                 control_pb2.GetBucketAccessRequest(bucket_id=bucket_id))
    emit(fmt, message_dict(answer.access), lambda: _access_table(answer.access))


@buckets.command("objects")
@click.argument("bucket_id")
@click.option("--prefix", default="")
@click.option("--max-keys", type=click.IntRange(1, 1000), default=100, show_default=True)
@click.option("--continue", "token", default="", metavar="TOKEN", help="The next page.")
@output_option
@pass_session
def bucket_objects(session: Session, bucket_id: str, prefix: str, max_keys: int, token: str,
                   fmt: str) -> None:
    """List a bucket's objects, a page at a time."""
    answer = session.client.call("ListBucketObjects", control_pb2.ListBucketObjectsRequest(
        bucket_id=bucket_id, prefix=prefix, max_keys=max_keys, continuation_token=token))

    def table() -> list[Any]:
        t = new_table("KEY", "SIZE", "MODIFIED", "ETAG")
        for o in answer.objects:
            t.add_row(o.key, f"{o.size_bytes} B", o.last_modified, o.etag)
        more = (f"more: --continue {answer.next_continuation_token}"
                if answer.is_truncated else "")
        return [t, more] if more else [t]

    emit(fmt, message_dict(answer), table)


COMMANDS = [disks, buckets]
