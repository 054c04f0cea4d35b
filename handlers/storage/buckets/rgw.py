"""The blocking RGW client: boto3 for S3, ``requests`` signed with SigV4 for Admin Ops.

Apart from the commands because this is the wire protocol alone: every method blocks, is
thread-safe, and answers RGW's refusals as ``RgwError`` (status and RGW code); running it off
the event loop, with deadlines, is ``calls.RgwCalls``'s job, and what the answers mean to a
command is the commands'.

How: S3 calls use boto3 (path-style, SigV4, the configured region). Admin Ops calls use
``requests`` signed by botocore's ``S3SigV4Auth`` (plain ``SigV4Auth`` omits
``X-Amz-Content-SHA256`` and RGW refuses it) over a canonical query: sorted, RFC 3986 encoded
(space as ``%20``), bare keys as ``k=``. No hand-rolled signer.

Operations notes: give the beast frontend ``tcp_nodelay=1`` (``rgw frontends = beast
endpoint=... tcp_nodelay=1``); without it every boto3 call on a kept-alive connection waits
~40 ms for a delayed ACK (measured: GetBucketVersioning 45 ms -> 4 ms). The bucket policy names
``arn:aws:iam:::user/<uid>``, i.e. users without an RGW tenant.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote

import boto3  # type: ignore[import-untyped]
import requests
from botocore import exceptions as boto_exc  # type: ignore[import-untyped]
from botocore.auth import S3SigV4Auth  # type: ignore[import-untyped]
from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
from botocore.config import Config  # type: ignore[import-untyped]
from botocore.credentials import Credentials  # type: ignore[import-untyped]
from requests.adapters import HTTPAdapter

from handlers.settings.buckets import BucketsConfig
from handlers.storage.buckets.model import ObjectEntry, ObjectPage

log = logging.getLogger("persys.buckets")

T = TypeVar("T")

#: How often CreateBucket tries the new keys before it gives up (RGW caches users briefly).
VERIFY_ATTEMPTS = 5


class RgwError(Exception):
    """RGW answered with an error (``status`` 0: no answer at all)."""

    def __init__(self, status: int, code: str, message: str = "") -> None:
        super().__init__(f"{status} {code}{': ' + message if message else ''}")
        self.status = status
        self.code = code


def canonical_query(params: Mapping[str, str]) -> str:
    """The SigV4 canonical query (also sent as is): sorted, RFC 3986, bare keys as ``k=``."""
    pairs = sorted((quote(k, safe="-_.~"), quote(v, safe="-_.~")) for k, v in params.items())
    return "&".join(f"{k}={v}" for k, v in pairs)


def bucket_policy(bucket: str, user: str) -> str:
    """A policy that lets ``user`` do anything to ``bucket`` and its objects, and no more."""
    return json.dumps({
        "Version": "2012-10-17",
        "Statement": [{
            "Sid": "PersysBucketUser",
            "Effect": "Allow",
            "Principal": {"AWS": [f"arn:aws:iam:::user/{user}"]},
            "Action": ["s3:*"],
            "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
        }],
    }, separators=(",", ":"))


def parse_time(raw: object) -> datetime | None:
    if isinstance(raw, datetime):
        return raw
    if not isinstance(raw, str) or not raw:
        return None
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None


def stats_fields(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The ``BucketInfo`` fields in an Admin Ops bucket stats answer."""
    usage = stats.get("usage") or {}
    main = usage.get("rgw.main") or {}
    return {
        "owner": str(stats.get("owner") or ""),
        "object_count": int(main.get("num_objects") or 0),
        "size_bytes": int(main.get("size") or 0),
        "created_at": parse_time(stats.get("creation_time")),
        "updated_at": parse_time(stats.get("mtime")),
    }


def _one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


class RgwClient:
    """boto3 for S3, signed ``requests`` for Admin Ops. Thread-safe; every method blocks."""

    def __init__(self, config: BucketsConfig) -> None:
        self.config = config
        self._creds = Credentials(config.access_key, config.secret_key)
        self._timeout = (config.connect_timeout_s, config.read_timeout_s)
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_maxsize=config.s3_workers, max_retries=0)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._lock = threading.Lock()
        self._client: Any = None
        self._uid = ""

    def close(self) -> None:
        self._session.close()
        if self._client is not None:
            self._client.close()

    # -- transports ----------------------------------------------------------------------------

    def s3(self) -> Any:
        """The control-plane boto3 client, built on first use (on an s3 thread)."""
        with self._lock:
            if self._client is None:
                self._client = boto3.session.Session().client(
                    "s3", endpoint_url=self.config.endpoint,
                    aws_access_key_id=self.config.access_key,
                    aws_secret_access_key=self.config.secret_key,
                    region_name=self.config.region,
                    config=Config(
                        signature_version="s3v4", s3={"addressing_style": "path"},
                        connect_timeout=self.config.connect_timeout_s,
                        read_timeout=self.config.read_timeout_s,
                        retries={"max_attempts": 1, "mode": "standard"},
                        max_pool_connections=self.config.s3_workers))
            return self._client

    def signed(self, method: str, path: str, params: Mapping[str, str], *,
               creds: Any = None, timeout: float | None = None) -> requests.Response:
        """One SigV4 request (S3SigV4Auth) to ``<endpoint><path>?<canonical query>``."""
        query = canonical_query(params)
        url = f"{self.config.endpoint}{path}" + (f"?{query}" if query else "")
        request = AWSRequest(method=method, url=url, data=b"")
        S3SigV4Auth(creds or self._creds, "s3", self.config.region).add_auth(request)
        read = timeout if timeout is not None else self.config.read_timeout_s
        try:
            return self._session.request(method, url, headers=dict(request.headers.items()),
                                         timeout=(self.config.connect_timeout_s, read))
        except requests.exceptions.RequestException as exc:
            raise RgwError(0, type(exc).__name__, _one_line(exc)) from None

    def admin(self, method: str, resource: str, params: Mapping[str, str], *,
              timeout: float | None = None) -> Any:
        """An Admin Ops call; the parsed JSON answer (``None`` when empty)."""
        resp = self.signed(method, f"/{self.config.admin_path}/{resource}", params,
                           timeout=timeout)
        if resp.status_code >= 300:
            code = "HTTP"
            try:
                code = str(resp.json().get("Code") or code)
            except ValueError:
                pass
            raise RgwError(resp.status_code, code, f"admin {method} {resource}")
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError as exc:
            raise RgwError(resp.status_code, "BadJSON",
                           f"admin {method} {resource} answered non-JSON") from exc

    def _boto(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except boto_exc.ClientError as exc:
            err = exc.response.get("Error") or {}
            status = int((exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
            raise RgwError(status or 500, str(err.get("Code") or "Unknown"),
                           _one_line(err.get("Message") or "")) from None
        except boto_exc.BotoCoreError as exc:
            raise RgwError(0, type(exc).__name__, _one_line(exc)) from None

    # -- S3 ------------------------------------------------------------------------------------

    def head_bucket(self, name: str) -> bool:
        try:
            self._boto(lambda: self.s3().head_bucket(Bucket=name))
        except RgwError as exc:
            if exc.status == 404:
                return False
            if exc.status == 403:
                # exists but belongs to someone else, or our keys are bad: ListBuckets tells
                self._boto(lambda: self.s3().list_buckets())
                return True
            raise
        return True

    def create_bucket(self, name: str) -> None:
        self._boto(lambda: self.s3().create_bucket(Bucket=name))

    def put_versioning(self, name: str, enabled: bool) -> None:
        status = "Enabled" if enabled else "Suspended"
        self._boto(lambda: self.s3().put_bucket_versioning(
            Bucket=name, VersioningConfiguration={"Status": status}))

    def get_versioning(self, name: str) -> bool:
        resp = self._boto(lambda: self.s3().get_bucket_versioning(Bucket=name))
        return bool(resp.get("Status") == "Enabled")

    def put_policy(self, name: str, user: str) -> None:
        policy = bucket_policy(name, user)
        self._boto(lambda: self.s3().put_bucket_policy(Bucket=name, Policy=policy))

    def whoami(self) -> str:
        """The control-plane user's uid (the owner ListBuckets reports), cached."""
        with self._lock:
            if self._uid:
                return self._uid
        resp = self._boto(lambda: self.s3().list_buckets())
        uid = str((resp.get("Owner") or {}).get("ID") or "")
        if not uid:
            raise RgwError(500, "NoOwner", "ListBuckets did not name the owner")
        with self._lock:
            self._uid = uid
        return uid

    def list_buckets(self) -> list[tuple[str, datetime | None]]:
        resp = self._boto(lambda: self.s3().list_buckets())
        return [(str(b["Name"]), parse_time(b.get("CreationDate")))
                for b in resp.get("Buckets", [])]

    def delete_bucket(self, name: str) -> None:
        self._boto(lambda: self.s3().delete_bucket(Bucket=name))

    def list_objects(self, name: str, prefix: str, token: str, max_keys: int) -> ObjectPage:
        kwargs: dict[str, Any] = {"Bucket": name, "MaxKeys": max_keys}
        if prefix:
            kwargs["Prefix"] = prefix
        if token:
            kwargs["ContinuationToken"] = token
        resp = self._boto(lambda: self.s3().list_objects_v2(**kwargs))
        objects = []
        for item in resp.get("Contents", []):
            modified = item.get("LastModified")
            objects.append(ObjectEntry(
                key=str(item.get("Key", "")), size_bytes=int(item.get("Size") or 0),
                etag=str(item.get("ETag") or "").strip('"'),
                last_modified=modified.isoformat().replace("+00:00", "Z")
                if isinstance(modified, datetime) else str(modified or ""),
                storage_class=str(item.get("StorageClass") or "")))
        return ObjectPage(objects=objects,
                          next_continuation_token=str(resp.get("NextContinuationToken") or ""),
                          is_truncated=bool(resp.get("IsTruncated")), prefix=prefix)

    def verify_user(self, name: str, access_key: str, secret_key: str) -> str:
        """Prove that the new keys can list ``name`` (RGW may cache users for a moment).

        Returns ``""`` on success, else what RGW answered the last time (status and code)."""
        creds = Credentials(access_key, secret_key)
        answer = ""
        for attempt in range(VERIFY_ATTEMPTS):
            resp = self.signed("GET", f"/{name}", {"list-type": "2", "max-keys": "1"},
                               creds=creds)
            if resp.status_code == 200:
                return ""
            code = re.search(rb"<Code>([^<]{1,64})</Code>", resp.content or b"")
            answer = f"{resp.status_code} {code.group(1).decode() if code else ''}".strip()
            log.info("the new keys of bucket %s were refused (%s), attempt %d", name, answer,
                     attempt + 1)
            if resp.status_code not in (401, 403):
                break
            time.sleep(0.1 * (attempt + 1))
        return answer

    # -- Admin Ops -----------------------------------------------------------------------------

    def create_user(self, uid: str, display: str) -> tuple[str, str]:
        """Create ``uid`` with RGW-generated S3 keys; returns ``(access_key, secret_key)``.

        ``exclusive=true`` matters: without it RGW turns a create of an existing user with the
        same display name into a modify that adds a key, so two creators would both "win"."""
        body = self.admin("PUT", "user", {
            "uid": uid, "display-name": display, "key-type": "s3", "generate-key": "true",
            "max-buckets": "-1", "exclusive": "true"})
        keys = [k for k in (body or {}).get("keys", []) if k.get("user") == uid]
        if not keys:
            raise RgwError(500, "NoKeys", "RGW created the user without S3 keys")
        return str(keys[0]["access_key"]), str(keys[0]["secret_key"])

    def user_exists(self, uid: str) -> bool:
        try:
            self.admin("GET", "user", {"uid": uid})
        except RgwError as exc:
            if exc.status == 404 and exc.code == "NoSuchUser":
                return False
            raise
        return True

    def delete_user(self, uid: str) -> bool:
        """Remove ``uid`` (it owns no buckets); ``False`` when it did not exist."""
        try:
            self.admin("DELETE", "user", {"uid": uid, "purge-data": "false"})
        except RgwError as exc:
            if exc.status == 404 and exc.code == "NoSuchUser":
                return False
            raise
        return True

    def stats(self, name: str) -> dict[str, Any] | None:
        """Admin Ops bucket stats, ``None`` when RGW has no such bucket."""
        try:
            body = self.admin("GET", "bucket", {"bucket": name, "stats": "true"})
        except RgwError as exc:
            if exc.status == 404 and exc.code == "NoSuchBucket":
                return None
            raise
        return body if isinstance(body, dict) else None

    def all_stats(self) -> dict[str, dict[str, Any]]:
        body = self.admin("GET", "bucket", {"stats": "true"})
        if not isinstance(body, list):
            return {}
        return {str(s.get("bucket")): s for s in body if isinstance(s, dict)}

    def purge_bucket(self, name: str) -> bool:
        """Delete the bucket with all its objects and versions; ``False`` if it was gone."""
        try:
            self.admin("DELETE", "bucket", {"bucket": name, "purge-objects": "true"},
                       timeout=self.config.purge_timeout_s)
        except RgwError as exc:
            if exc.status == 404 and exc.code == "NoSuchBucket":
                return False
            raise
        return True

