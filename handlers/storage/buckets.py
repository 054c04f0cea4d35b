"""The bucket API: Ceph RGW buckets with per-bucket credentials held in Vault (persys-facts E15).

Why it exists: tenants get S3 buckets on the cluster's RADOS Gateway, each with its own RGW
user and keys that can reach that bucket and nothing else. RGW is the only inventory (no etcd
records, no events): a bucket exists when RGW says so.

How (and where it differs from the Go version, persys-facts I.18):

* S3 calls use boto3 (path-style, SigV4, the configured region). RGW Admin Ops calls use
  ``requests`` signed by botocore's ``S3SigV4Auth`` (plain ``SigV4Auth`` omits
  ``X-Amz-Content-SHA256`` and RGW refuses it) over a canonical query: sorted, RFC 3986
  encoded (space as ``%20``), bare keys as ``k=``. No hand-rolled signer.
* CreateBucket: validate -> HEAD -> claim the name in Vault -> create the RGW user
  ``persys-bkt-<bucket>`` with keys that RGW generates (so the secret is never in a URL or an
  RGW access log), ``max-buckets=-1`` (it cannot create buckets) and ``exclusive=true`` ->
  create the bucket (owned by the control-plane user) ->
  versioning if asked (errors surface) -> a bucket policy that grants the user's ARN
  ``s3:*`` on the bucket and its objects -> prove with the new keys that ListObjects works ->
  write ``{endpoint, region, bucket, access_key, secret_key, s3_url}`` to Vault KV v2 at
  ``<prefix>/<bucket>``. Any failure rolls back what was made (bucket, user, secret) and the
  error is answered, never swallowed; a Vault write failure answers UNAVAILABLE.
  Before any of that, the name is claimed in Vault: a placeholder ``{"state": "creating"}``
  written with check-and-set ``cas=0``, which Vault applies atomically; the final write uses
  ``cas=<claim version>``. RGW offers no atomic claim: a second PUT of the control-plane
  user's own bucket succeeds, and two concurrent user creates can both succeed even with
  ``exclusive=true`` (measured here: the first writer's keys end up refused). So a concurrent
  create of the same name, from this replica or another, gets ALREADY_EXISTS, as does a name
  with a leftover secret or user of a crashed attempt (DeleteBucket removes those). The claim
  carries a nonce and its time: a claim write whose answer was lost is read back and removed
  if it is ours, and DeleteBucket refuses (ABORTED) to remove the user of a name claimed less
  than ``CLAIM_LIVE_S`` ago (a create in progress on another replica).
* A create cancelled midway (the client's deadline, shutdown) still rolls back: an RGW call
  already running in its thread takes effect, so the cancellation waits for it to end before
  the rollback runs, and the rollback removes what the call may have made (a bucket only if
  RGW shows it owned by the control-plane user). The claim stays if the rollback could not
  remove the rest.
* GetBucket / ListBuckets fill ``owner``, ``object_count``, ``size_bytes`` and the creation and
  modification times from Admin Ops bucket stats, and ``versioning`` from GetBucketVersioning.
* DeleteBucket refuses a non-empty bucket (FAILED_PRECONDITION) unless ``force``, which makes
  RGW purge the objects (all versions) and the bucket in one Admin Ops call. A bucket owned by
  another RGW user is never deleted (Admin Ops could: FAILED_PRECONDITION). Success is
  answered only after RGW no longer has the bucket; then the user and the Vault secret are
  removed (a failure there is answered and a retry finishes the job: DeleteBucket of a missing
  bucket removes a leftover user or secret and succeeds, and NOT_FOUND only when there was none).
* GetBucketAccess does NOT return the secret key (decision): the secret is returned once, by
  CreateBucket, as the proto comment says; afterwards it is read from Vault at ``vault_path``
  by whoever Vault's policies allow. The Go version returned it on every call to anyone the
  mTLS CA trusts, agents included (persys-facts I.21). The answer has everything else
  (endpoint, region, bucket, access key, vault_path, s3_url), read from Vault.
* Regions: RGW serves one zonegroup; a request ``region`` other than the configured one is
  INVALID_ARGUMENT (the Go version signed with it and reported it, without effect).

Operations notes: give the beast frontend ``tcp_nodelay=1`` (``rgw frontends = beast
endpoint=... tcp_nodelay=1``); without it every boto3 call on a kept-alive connection waits
~40 ms for a delayed ACK (measured: GetBucketVersioning 45 ms -> 4 ms). The bucket policy names
``arn:aws:iam:::user/<uid>``, i.e. users without an RGW tenant. The vault-manager route of the
Go version is not implemented (see handlers/settings/buckets.py).

Invariants: blocking clients run only on this object's ``s3`` thread pool (and VaultKV's
``vault`` pool), behind a semaphore of the pool's size, each call with a client timeout and an
asyncio deadline; secrets (the control-plane secret key, generated secret keys) are never
logged, never put into error messages, never written anywhere but Vault and the CreateBucket
answer. Errors are ``BucketError`` carrying the gRPC status name.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
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

from handlers.settings.buckets import BucketsConfig, load_buckets_config
from handlers.vault.client import VaultError, VaultKV
from proto.persys.control.v1 import control_pb2

__all__ = [
    "AccessInfo",
    "BucketCommands",
    "BucketError",
    "BucketInfo",
    "ObjectEntry",
    "ObjectPage",
    "access_message",
    "bucket_name",
    "bucket_view",
    "build_buckets",
    "canonical_query",
    "object_message",
    "user_for",
]

log = logging.getLogger("persys.buckets")

T = TypeVar("T")

_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
USER_PREFIX = "persys-bkt-"
PHASE_AVAILABLE = "Available"
DEFAULT_MAX_KEYS = 100
MAX_KEYS_CAP = 1000
#: How often CreateBucket tries the new keys before it gives up (RGW caches users briefly).
_VERIFY_ATTEMPTS = 5


class BucketError(Exception):
    """``code`` is the gRPC status name the servicer answers with; ``rgw_code`` is RGW's
    error code when RGW refused (``BucketNotEmpty``, ``UserAlreadyExists``, ...)."""

    def __init__(self, code: str, message: str, *, rgw_code: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.rgw_code = rgw_code


class RgwError(Exception):
    """RGW answered with an error (``status`` 0: no answer at all)."""

    def __init__(self, status: int, code: str, message: str = "") -> None:
        super().__init__(f"{status} {code}{': ' + message if message else ''}")
        self.status = status
        self.code = code


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


# -- pure helpers --------------------------------------------------------------------------------


def bucket_name(raw: str, field: str) -> str:
    """The canonical bucket name (trimmed, lower-cased) or INVALID_ARGUMENT naming ``field``."""
    name = raw.strip().lower()
    if not name:
        raise BucketError("INVALID_ARGUMENT", f"{field}: required")
    if not _NAME.match(name):
        raise BucketError(
            "INVALID_ARGUMENT",
            f"{field}: {raw.strip()[:80]!r} is not a bucket name (3-63 characters: lower-case "
            "letters, digits, '.' and '-', starting and ending with a letter or digit)")
    if ".." in name or re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name):
        raise BucketError("INVALID_ARGUMENT",
                          f"{field}: {name!r} has '..' or looks like an IP address")
    return name


def user_for(bucket: str) -> str:
    """The RGW user that owns a bucket's credentials."""
    return f"{USER_PREFIX}{bucket}"


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


def _parse_time(raw: object) -> datetime | None:
    if isinstance(raw, datetime):
        return raw
    if not isinstance(raw, str) or not raw:
        return None
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None


def _stats_fields(stats: Mapping[str, Any]) -> dict[str, Any]:
    usage = stats.get("usage") or {}
    main = usage.get("rgw.main") or {}
    return {
        "owner": str(stats.get("owner") or ""),
        "object_count": int(main.get("num_objects") or 0),
        "size_bytes": int(main.get("size") or 0),
        "created_at": _parse_time(stats.get("creation_time")),
        "updated_at": _parse_time(stats.get("mtime")),
    }


def _one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


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


# -- blocking RGW client (runs on the s3 threads only) ------------------------------------------


class _Rgw:
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
        return [(str(b["Name"]), _parse_time(b.get("CreationDate")))
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
        for attempt in range(_VERIFY_ATTEMPTS):
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


def _log_failure(future: Future[Any]) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("building the S3 client failed (retried on first use): %s", exc)


# -- the async commands ---------------------------------------------------------------------------


#: the create flags of ``BucketCommands.create``'s rollback
MADE, MAYBE = "made", "maybe"
#: a creating claim younger than this is a create in progress (a create's steps are bounded
#: by their call deadlines, minutes at most); an older one is a crashed attempt's leftover
CLAIM_LIVE_S = 600.0


def _number(text: str | None) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0


async def _until_done(call: Future[Any]) -> None:
    """Wait until a call that already runs in its thread has ended, whatever its outcome
    (bounded: every RGW call has a client timeout); a call still queued is cancelled."""
    if call.cancel() or call.done():
        return
    with contextlib.suppress(Exception):  # its own error was answered already
        await asyncio.shield(asyncio.wrap_future(call))


class BucketCommands:
    """CreateBucket, ListBuckets, GetBucket, DeleteBucket, GetBucketAccess, ListBucketObjects."""

    def __init__(self, config: BucketsConfig, *, vault: VaultKV | None = None) -> None:
        self.config = config
        self.vault = vault
        self._rgw = _Rgw(config)
        self._executor = ThreadPoolExecutor(max_workers=config.s3_workers,
                                            thread_name_prefix="s3")
        self._slots = asyncio.Semaphore(config.s3_workers)
        self._name_locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        # build the boto3 client (~0.3 s of model loading) now, on an s3 thread, instead of in
        # the first RPC; a failure here is logged and happens again, answered, on first use
        self._executor.submit(self._rgw.s3).add_done_callback(_log_failure)

    async def aclose(self) -> None:
        """Finish rollbacks in flight, then stop the executors (calls are bounded).

        Called after the gRPC server has stopped, so no new command arrives meanwhile."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._executor.shutdown(wait=True, cancel_futures=True))
        self._rgw.close()
        if self.vault is not None:
            await self.vault.close()

    # -- plumbing ------------------------------------------------------------------------------

    async def _call(self, what: str, fn: Callable[..., T], *args: Any,
                    read_timeout: float | None = None, calls: int = 1) -> T:
        """Run ``fn(*args)`` on an s3 thread; RGW failures become ``BucketError``."""
        if self._closed:
            raise BucketError("UNAVAILABLE", "the bucket API is shutting down")
        read = read_timeout if read_timeout is not None else self.config.read_timeout_s
        deadline = (self.config.connect_timeout_s + read) * calls + 5.0
        # the deadline starts with the call, not while it waits for a thread: a listing of
        # thousands of buckets queues its calls on the pool's few threads
        async with self._slots:
            started = self._executor.submit(fn, *args)
            try:
                async with asyncio.timeout(deadline):
                    return await asyncio.wrap_future(started)
            except TimeoutError:
                await _until_done(started)
                raise BucketError("UNAVAILABLE",
                                  f"rgw {what}: no answer within {deadline:.0f}s") from None
            except RgwError as exc:
                raise self._translate(exc, what) from None
            except asyncio.CancelledError:
                # RPC cancelled (client deadline, shutdown): the thread's call still takes
                # effect; a rollback that follows must see what it made
                await _until_done(started)
                raise

    def _translate(self, exc: RgwError, what: str) -> BucketError:
        code = exc.code
        if exc.status == 0 or exc.status >= 500:
            return BucketError("UNAVAILABLE", f"rgw {what}: {exc} ({self.config.endpoint})",
                               rgw_code=code)
        if exc.status in (401, 403):
            return BucketError(
                "FAILED_PRECONDITION",
                f"rgw {what}: RGW refused the control-plane user ({code}); check "
                "PERSYS_RGW_ACCESS_KEY/PERSYS_RGW_SECRET_KEY and that the user has the caps "
                "'users=*;buckets=*' and owns the bucket", rgw_code=code)
        if exc.status == 404:
            return BucketError("NOT_FOUND", f"rgw {what}: {code}", rgw_code=code)
        if code in ("BucketAlreadyExists", "UserAlreadyExists"):
            return BucketError("ALREADY_EXISTS", f"rgw {what}: {code}", rgw_code=code)
        if code == "InvalidBucketName":
            return BucketError("INVALID_ARGUMENT", f"name: RGW rejected it ({code})",
                               rgw_code=code)
        if code == "BucketNotEmpty":
            return BucketError("FAILED_PRECONDITION", f"rgw {what}: {code}", rgw_code=code)
        return BucketError("INTERNAL", f"rgw {what}: {exc}", rgw_code=code)

    async def _vault_call(self, what: str, body: Callable[[VaultKV], Any]) -> Any:
        vault = self._require_vault(what)
        try:
            return await body(vault)
        except VaultError as exc:
            code = {"unavailable": "UNAVAILABLE", "denied": "FAILED_PRECONDITION"}.get(
                exc.kind, "INTERNAL")
            raise BucketError(code, str(exc)) from None

    def _require_vault(self, what: str) -> VaultKV:
        if self.vault is None:
            raise BucketError(
                "FAILED_PRECONDITION",
                f"{what} needs Vault for the bucket credentials: set PERSYS_VAULT_ADDR and "
                "PERSYS_VAULT_TOKEN (or PERSYS_VAULT_APPROLE_ROLE_ID/_SECRET_ID)")
        return self.vault

    @contextlib.asynccontextmanager
    async def _name_lock(self, name: str) -> AsyncIterator[None]:
        """Serialise create/delete of one name in this replica (other replicas: see create)."""
        lock, users = self._name_locks.get(name, (asyncio.Lock(), 0))
        self._name_locks[name] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._name_locks[name]
            if users <= 1:
                del self._name_locks[name]
            else:
                self._name_locks[name] = (lock, users - 1)

    def _keep(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _base_info(self, name: str, **fields: Any) -> BucketInfo:
        return BucketInfo(name=name, region=self.config.region, endpoint=self.config.endpoint,
                          **fields)

    def _region(self, requested: str) -> None:
        wanted = requested.strip()
        if wanted and wanted != self.config.region:
            raise BucketError(
                "INVALID_ARGUMENT",
                f"region: this RGW serves region {self.config.region!r}, not {wanted!r}")

    # -- commands ------------------------------------------------------------------------------

    async def create(self, name: str, region: str = "",
                     versioning: bool = False) -> tuple[BucketInfo, AccessInfo]:
        bucket = bucket_name(name, "name")
        self._region(region)
        vault = self._require_vault("CreateBucket")
        uid = user_for(bucket)
        vault_path = self.config.vault_path(bucket)
        leftover_hint = f"DeleteBucket {bucket!r} removes what an earlier attempt left"
        async with self._name_lock(bucket):
            if await self._call("HEAD bucket", self._rgw.head_bucket, bucket):
                raise BucketError("ALREADY_EXISTS", f"bucket {bucket!r} already exists")
            # the claim: exactly one creator of this name, across replicas (see module doc)
            claim = await self._claim(vault, bucket, leftover_hint)
            # MADE: this call made it; MAYBE: a call to make it ran, its outcome unknown
            made = {"secret": MADE, "user": "", "bucket": ""}
            try:
                made["user"] = MAYBE
                try:
                    access_key, secret_key = await self._call(
                        "create user", self._rgw.create_user, uid, f"Persys bucket {bucket}")
                except BucketError as exc:
                    if exc.rgw_code == "UserAlreadyExists":
                        made["user"] = ""  # an earlier attempt's: not this call's to remove
                        raise BucketError("ALREADY_EXISTS",
                                          f"the RGW user {uid!r} exists: {leftover_hint}",
                                          rgw_code=exc.rgw_code) from None
                    raise
                made["user"] = MADE
                access = AccessInfo(
                    endpoint=self.config.endpoint, region=self.config.region, bucket=bucket,
                    access_key=access_key, secret_key=secret_key, vault_path=vault_path,
                    s3_url=f"s3://{bucket}")
                made["bucket"] = MAYBE
                try:
                    await self._call("create bucket", self._rgw.create_bucket, bucket)
                except BucketError as exc:
                    if exc.code == "ALREADY_EXISTS":
                        made["bucket"] = ""  # someone else's, since the HEAD above
                    raise
                made["bucket"] = MADE
                if versioning:
                    await self._call("enable versioning", self._rgw.put_versioning, bucket,
                                     True)
                await self._call("put bucket policy", self._rgw.put_policy, bucket, uid)
                refused = await self._call("check the new keys", self._rgw.verify_user,
                                           bucket, access_key, secret_key,
                                           calls=_VERIFY_ATTEMPTS)
                if refused:
                    raise BucketError(
                        "INTERNAL", f"the new keys of {uid!r} cannot list the bucket (RGW "
                                    f"answered {refused}); does this RGW honour bucket "
                                    "policies?")
                try:
                    await vault.write(self.config.kv_mount, self._kv_path(bucket), {
                        "endpoint": access.endpoint, "region": access.region,
                        "bucket": bucket, "access_key": access_key, "secret_key": secret_key,
                        "s3_url": access.s3_url}, cas=claim)
                except VaultError as exc:
                    raise BucketError("UNAVAILABLE", f"storing the bucket credentials: {exc}"
                                      ) from None
            except BaseException as exc:
                # the rollback runs to its end even if this RPC is cancelled meanwhile
                problems = await asyncio.shield(self._keep(self._rollback(bucket, made)))
                if isinstance(exc, BucketError):
                    note = "; rolled back" if not problems else (
                        f"; rollback incomplete ({'; '.join(problems)}): {leftover_hint}")
                    raise BucketError(exc.code, f"{exc}{note}", rgw_code=exc.rgw_code
                                      ) from None
                raise
        log.info("bucket created bucket=%s user=%s vault_path=%s versioning=%s", bucket, uid,
                 vault_path, versioning)
        try:
            info = await self._info(bucket)
        except BucketError as exc:
            # the bucket exists and works; only the view's statistics are missing
            log.warning("bucket %s created but its stats could not be read: %s", bucket, exc)
            info = self._base_info(bucket, versioning=versioning, last_error=str(exc))
        return info, access

    def _kv_path(self, bucket: str) -> str:
        return f"{self.config.kv_path}/{bucket}"

    async def _claim(self, vault: VaultKV, bucket: str, leftover_hint: str) -> int:
        """Claim the name (``cas=0``); returns the claim's version.

        The claim carries a nonce and its time: a write whose answer was lost is recognised
        as ours and removed (or the name would stay claimed by nobody), and DeleteBucket can
        tell a create in progress from a crashed one's leftover."""
        nonce = uuid.uuid4().hex
        body = {"state": "creating", "claim": nonce, "since": str(int(time.time()))}
        try:
            return await vault.write(self.config.kv_mount, self._kv_path(bucket), body, cas=0)
        except VaultError as exc:
            if exc.kind == "conflict":
                raise BucketError(
                    "ALREADY_EXISTS", f"bucket {bucket!r} is being created elsewhere, or "
                                      f"has credentials in Vault already: {leftover_hint}"
                ) from None
            failure = exc
        except asyncio.CancelledError:
            # cancelled (the client's deadline) while the write ran: it took effect in its
            # thread, and the claim would block the name for CLAIM_LIVE_S
            await asyncio.shield(self._keep(self._release_claim(vault, bucket, nonce)))
            raise
        # the answer was lost: the claim may be there, and it would be nobody's
        await self._release_claim(vault, bucket, nonce)
        raise BucketError("UNAVAILABLE", f"claiming the name in Vault: {failure}") from None

    async def _release_claim(self, vault: VaultKV, bucket: str, nonce: str) -> None:
        """Remove the claim with ``nonce`` if it is there (its write's answer never came)."""
        try:
            held = await vault.read(self.config.kv_mount, self._kv_path(bucket))
            if held is not None and held.get("claim") == nonce:
                await vault.delete(self.config.kv_mount, self._kv_path(bucket))
        except VaultError as exc:
            log.warning("bucket %s: the claim write failed and could not be checked: %s",
                        bucket, exc)

    async def _rollback(self, bucket: str, made: Mapping[str, str]) -> list[str]:
        """Undo a failed create: the bucket (only if this call made it), the user, and last the
        Vault claim, which keeps other creators out until the rest is gone (it stays when
        removing the rest failed)."""
        problems: list[str] = []
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
        if made.get("bucket"):
            steps.append(("bucket", lambda: self._remove_new_bucket(bucket, made["bucket"])))
        if made.get("user"):
            steps.append(("user", lambda: self._call("delete user", self._rgw.delete_user,
                                                     user_for(bucket))))
        for what, step in steps:
            try:
                await step()
            except (BucketError, VaultError) as exc:
                log.warning("rollback of bucket %s: removing the %s failed: %s", bucket, what,
                            exc)
                problems.append(f"{what}: {exc}")
        if made.get("secret") and self.vault is not None and not problems:
            try:
                await self.vault.delete(self.config.kv_mount, self._kv_path(bucket))
            except VaultError as exc:
                log.warning("rollback of bucket %s: removing the vault secret failed: %s",
                            bucket, exc)
                problems.append(f"vault secret: {exc}")
        log.warning("bucket %s creation rolled back%s", bucket,
                    f" with problems: {problems}" if problems else "")
        return problems

    async def _remove_new_bucket(self, bucket: str, made: str) -> None:
        """Purge the bucket this create made; one it may have made (the call's outcome is
        unknown) only if RGW shows it owned by the control-plane user (the name was free at
        the HEAD and is claimed since, so such a bucket is this call's)."""
        if made == MAYBE:
            stats = await self._call("bucket stats", self._rgw.stats, bucket)
            if stats is None:
                return
            if str(stats.get("owner") or "") != await self._call("who am I", self._rgw.whoami):
                return
        await self._call("delete bucket", self._rgw.purge_bucket, bucket,
                         read_timeout=self.config.purge_timeout_s)

    async def _info(self, bucket: str) -> BucketInfo:
        stats, versioning = await asyncio.gather(
            self._call("bucket stats", self._rgw.stats, bucket),
            self._call("get versioning", self._rgw.get_versioning, bucket),
            return_exceptions=True)
        if isinstance(stats, BaseException):
            raise stats
        if stats is None or (isinstance(versioning, BucketError)
                             and versioning.code == "NOT_FOUND"):
            raise BucketError("NOT_FOUND", f"bucket {bucket!r} not found")
        if isinstance(versioning, BaseException):
            raise versioning
        return self._base_info(bucket, versioning=bool(versioning), **_stats_fields(stats))

    async def get(self, bucket_id: str) -> BucketInfo:
        return await self._info(bucket_name(bucket_id, "bucket_id"))

    async def delete(self, bucket_id: str, *, force: bool = False) -> None:
        """Delete the bucket, then its user and Vault secret; see the module doc."""
        bucket = bucket_name(bucket_id, "bucket_id")
        self._require_vault("DeleteBucket")
        async with self._name_lock(bucket):
            stats = await self._call("bucket stats", self._rgw.stats, bucket)
            if stats is None:
                if await self._remove_leftovers(bucket):
                    return
                raise BucketError("NOT_FOUND", f"bucket {bucket!r} not found")
            owner = str(stats.get("owner") or "")
            me = await self._call("who am I", self._rgw.whoami)
            if owner != me:
                # Admin Ops could delete anyone's bucket: only ever touch our own
                raise BucketError(
                    "FAILED_PRECONDITION",
                    f"bucket_id: bucket {bucket!r} belongs to RGW user {owner!r}, not to the "
                    "control-plane user; it was not created through this API")
            if force:
                await self._call("purge bucket", self._rgw.purge_bucket, bucket,
                                 read_timeout=self.config.purge_timeout_s)
            else:
                try:
                    await self._call("delete bucket", self._rgw.delete_bucket, bucket)
                except BucketError as exc:
                    if exc.rgw_code == "BucketNotEmpty":
                        raise BucketError(
                            "FAILED_PRECONDITION",
                            f"bucket_id: bucket {bucket!r} is not empty; delete its objects "
                            "or pass force=true", rgw_code=exc.rgw_code) from None
                    raise
            if await self._call("bucket stats", self._rgw.stats, bucket) is not None:
                raise BucketError("INTERNAL",
                                  f"rgw still has bucket {bucket!r} after deleting it")
            log.info("bucket deleted bucket=%s force=%s", bucket, force)
            try:
                await self._call("delete user", self._rgw.delete_user, user_for(bucket))
                await self._vault_call("DeleteBucket", lambda v: v.delete(
                    self.config.kv_mount, self._kv_path(bucket)))
            except BucketError as exc:
                raise BucketError(
                    exc.code, f"bucket {bucket!r} was deleted, but removing its credentials "
                              f"failed ({exc}); call DeleteBucket again to finish") from None

    async def _remove_leftovers(self, bucket: str) -> bool:
        """After a crash or a failed cleanup: remove the user and secret of a gone bucket.

        A claim younger than ``CLAIM_LIVE_S`` is a create in progress on some replica (its
        bucket not made yet): removing its user would leave it with dead keys, so the delete
        is refused (ABORTED) until that create has ended."""
        secret = await self._vault_call("DeleteBucket", lambda v: v.read(
            self.config.kv_mount, self._kv_path(bucket)))
        if secret is not None and secret.get("state") == "creating" and (
                time.time() - _number(secret.get("since")) < CLAIM_LIVE_S):
            raise BucketError("ABORTED", f"bucket {bucket!r} is being created; retry the "
                                         "delete when that create has ended")
        removed = await self._call("delete user", self._rgw.delete_user, user_for(bucket))
        if secret is not None:
            await self._vault_call("DeleteBucket", lambda v: v.delete(
                self.config.kv_mount, self._kv_path(bucket)))
        if removed or secret is not None:
            log.info("bucket %s was already gone; removed leftover user=%s secret=%s", bucket,
                     removed, secret is not None)
            return True
        return False

    async def access(self, bucket_id: str) -> AccessInfo:
        """Where the bucket's credentials are; the secret key is left empty (see module doc)."""
        bucket = bucket_name(bucket_id, "bucket_id")
        self._require_vault("GetBucketAccess")
        if not await self._call("HEAD bucket", self._rgw.head_bucket, bucket):
            raise BucketError("NOT_FOUND", f"bucket {bucket!r} not found")
        path = self.config.vault_path(bucket)
        secret = await self._vault_call("GetBucketAccess", lambda v: v.read(
            self.config.kv_mount, self._kv_path(bucket)))
        if secret is None:
            raise BucketError("NOT_FOUND", f"no credentials for bucket {bucket!r} in Vault at "
                                           f"{path} (it was not created through this API)")
        if secret.get("state") == "creating":
            raise BucketError("UNAVAILABLE", f"bucket {bucket!r} is being created; retry")
        if not secret.get("access_key") or not secret.get("secret_key"):
            raise BucketError("INTERNAL", f"the credentials at {path} are incomplete")
        return AccessInfo(
            endpoint=secret.get("endpoint") or self.config.endpoint,
            region=secret.get("region") or self.config.region,
            bucket=secret.get("bucket") or bucket, access_key=secret["access_key"],
            secret_key="", vault_path=path,
            s3_url=secret.get("s3_url") or f"s3://{bucket}")

    async def list_objects(self, bucket_id: str, *, prefix: str = "",
                           continuation_token: str = "", max_keys: int = 0) -> ObjectPage:
        bucket = bucket_name(bucket_id, "bucket_id")
        if max_keys < 0:
            raise BucketError("INVALID_ARGUMENT", "max_keys: must not be negative")
        keys = min(max_keys or DEFAULT_MAX_KEYS, MAX_KEYS_CAP)
        try:
            return await self._call("list objects", self._rgw.list_objects, bucket, prefix,
                                    continuation_token, keys)
        except BucketError as exc:
            if exc.code == "NOT_FOUND":
                raise BucketError("NOT_FOUND", f"bucket {bucket!r} not found") from None
            if exc.rgw_code == "InvalidArgument":
                raise BucketError("INVALID_ARGUMENT",
                                  f"continuation_token: RGW rejected it ({exc})") from None
            raise

    async def list(self) -> builtins.list[BucketInfo]:
        """Every bucket of the control-plane user, sorted by name, with stats and versioning."""
        names, stats = await asyncio.gather(
            self._call("list buckets", self._rgw.list_buckets),
            self._call("bucket stats", self._rgw.all_stats))

        async def one(name: str, created: datetime | None) -> BucketInfo | None:
            info = self._base_info(name, created_at=created, updated_at=created)
            if name in stats:
                fields = {k: v for k, v in _stats_fields(stats[name]).items() if v is not None}
                info = replace(info, **fields)
            try:
                versioning = await self._call("get versioning", self._rgw.get_versioning, name)
            except BucketError as exc:
                if exc.code == "NOT_FOUND":  # deleted while listing
                    return None
                raise
            return replace(info, versioning=versioning)

        infos = await asyncio.gather(*(one(n, c) for n, c in names))
        return sorted((i for i in infos if i is not None), key=lambda i: i.name)


def build_buckets(env: Mapping[str, str]) -> BucketCommands | None:
    """The bucket API from the environment; ``None`` without ``PERSYS_RGW_ENDPOINT``.

    Raises:
        ConfigError: a half or invalid bucket configuration (naming the variable).
    """
    config = load_buckets_config(env)
    if config is None:
        return None
    vault = VaultKV(config.vault, workers=config.vault_workers) if config.vault else None
    log.info("bucket API on %s region=%s vault=%s", config.endpoint, config.region,
             config.vault.addr if config.vault else "not configured")
    return BucketCommands(config, vault=vault)
