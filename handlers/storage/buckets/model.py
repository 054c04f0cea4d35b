"""What the bucket API answers: its records, its error, and their proto messages.

Apart because every other bucket module speaks these types (the RGW client fills an
``ObjectPage``, the commands return ``BucketInfo`` and ``AccessInfo``, the servicer converts
them), and none of them should import another for its vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from proto.persys.control.v1 import control_pb2

PHASE_AVAILABLE = "Available"


class BucketError(Exception):
    """``code`` is the gRPC status name the servicer answers with; ``rgw_code`` is RGW's
    error code when RGW refused (``BucketNotEmpty``, ``UserAlreadyExists``, ...)."""

    def __init__(self, code: str, message: str, *, rgw_code: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.rgw_code = rgw_code


@dataclass(frozen=True, slots=True)
class BucketInfo:
    name: str
    region: str
    endpoint: str
    owner: str = ""
    versioning: bool = False
    object_count: int = 0
    size_bytes: int = 0
    created_at: datetime | None = None
    updated_at: datetime | None = None
    last_error: str = ""


@dataclass(frozen=True, slots=True)
class AccessInfo:
    endpoint: str
    region: str
    bucket: str
    access_key: str
    secret_key: str
    vault_path: str
    s3_url: str


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    key: str
    size_bytes: int
    etag: str
    last_modified: str
    storage_class: str


@dataclass(frozen=True, slots=True)
class ObjectPage:
    objects: list[ObjectEntry]
    next_continuation_token: str
    is_truncated: bool
    prefix: str


# -- proto conversion ----------------------------------------------------------------------------


def bucket_view(info: BucketInfo) -> control_pb2.BucketView:
    view = control_pb2.BucketView(
        id=info.name, name=info.name, region=info.region, owner=info.owner,
        endpoint=info.endpoint, versioning=info.versioning, object_count=info.object_count,
        size_bytes=info.size_bytes, phase=PHASE_AVAILABLE, last_error=info.last_error)
    if info.created_at is not None:
        view.created_at.FromDatetime(info.created_at)
    if info.updated_at is not None:
        view.updated_at.FromDatetime(info.updated_at)
    return view


def access_message(access: AccessInfo) -> control_pb2.BucketAccess:
    return control_pb2.BucketAccess(
        endpoint=access.endpoint, region=access.region, bucket=access.bucket,
        access_key=access.access_key, secret_key=access.secret_key,
        vault_path=access.vault_path, s3_url=access.s3_url)


def object_message(entry: ObjectEntry) -> control_pb2.ObjectInfo:
    return control_pb2.ObjectInfo(key=entry.key, size_bytes=entry.size_bytes, etag=entry.etag,
                                  last_modified=entry.last_modified,
                                  storage_class=entry.storage_class)
