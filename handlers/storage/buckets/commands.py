"""The six bucket commands: CreateBucket (with its rollback), ListBuckets, GetBucket,
DeleteBucket, GetBucketAccess and ListBucketObjects (the rules: the package docstring).

Apart from its parts because this is where they meet: each command validates its input
(``validation``), calls RGW through ``calls.RgwCalls`` and Vault through
``credentials.BucketCredentials``, serialises creates and deletes of one name in this replica,
and owns the clean-ups that must finish even when the RPC is cancelled.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from handlers.settings.buckets import BucketsConfig
from handlers.storage.buckets.calls import RgwCalls
from handlers.storage.buckets.credentials import BucketCredentials, claim_in_progress
from handlers.storage.buckets.model import AccessInfo, BucketError, BucketInfo, ObjectPage
from handlers.storage.buckets.rgw import VERIFY_ATTEMPTS, stats_fields
from handlers.storage.buckets.validation import bucket_name, check_region, page_size, user_for
from handlers.vault.client import VaultError, VaultKV

log = logging.getLogger("persys.buckets")

#: the create flags of ``BucketCommands.create``'s rollback
MADE, MAYBE = "made", "maybe"


class BucketCommands:
    """CreateBucket, ListBuckets, GetBucket, DeleteBucket, GetBucketAccess, ListBucketObjects."""

    def __init__(self, config: BucketsConfig, *, vault: VaultKV | None = None) -> None:
        self.config = config
        self._s3 = RgwCalls(config)
        #: the blocking client ``_s3`` runs (its methods are looked up at each call)
        self._rgw = self._s3.client
        self._name_locks: dict[str, tuple[asyncio.Lock, int]] = {}
        #: clean-ups that run to their end even when their RPC is cancelled (``_keep``)
        self._background: set[asyncio.Task[Any]] = set()
        self._credentials = BucketCredentials(config, vault, keep=self._keep)

    @property
    def vault(self) -> VaultKV | None:
        return self._credentials.vault

    async def aclose(self) -> None:
        """Finish rollbacks in flight, then stop the executors (calls are bounded).

        Called after the gRPC server has stopped, so no new command arrives meanwhile."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._s3.aclose()
        if self.vault is not None:
            await self.vault.close()

    # -- plumbing ------------------------------------------------------------------------------

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

    def _keep(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _base_info(self, name: str, **fields: Any) -> BucketInfo:
        return BucketInfo(name=name, region=self.config.region, endpoint=self.config.endpoint,
                          **fields)

    # -- commands ------------------------------------------------------------------------------

    async def create(self, name: str, region: str = "",
                     versioning: bool = False) -> tuple[BucketInfo, AccessInfo]:
        bucket = bucket_name(name, "name")
        check_region(region, self.config.region)
        vault = self._credentials.require("CreateBucket")
        uid = user_for(bucket)
        vault_path = self.config.vault_path(bucket)
        leftover_hint = f"DeleteBucket {bucket!r} removes what an earlier attempt left"
        async with self._name_lock(bucket):
            if await self._s3.call("HEAD bucket", self._rgw.head_bucket, bucket):
                raise BucketError("ALREADY_EXISTS", f"bucket {bucket!r} already exists")
            # the claim: exactly one creator of this name, across replicas (see the package doc)
            claim = await self._credentials.claim(vault, bucket, leftover_hint)
            # MADE: this call made it; MAYBE: a call to make it ran, its outcome unknown
            made = {"secret": MADE, "user": "", "bucket": ""}
            try:
                made["user"] = MAYBE
                try:
                    access_key, secret_key = await self._s3.call(
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
                    await self._s3.call("create bucket", self._rgw.create_bucket, bucket)
                except BucketError as exc:
                    if exc.code == "ALREADY_EXISTS":
                        made["bucket"] = ""  # someone else's, since the HEAD above
                    raise
                made["bucket"] = MADE
                if versioning:
                    await self._s3.call("enable versioning", self._rgw.put_versioning, bucket,
                                        True)
                await self._s3.call("put bucket policy", self._rgw.put_policy, bucket, uid)
                refused = await self._s3.call("check the new keys", self._rgw.verify_user,
                                              bucket, access_key, secret_key,
                                              calls=VERIFY_ATTEMPTS)
                if refused:
                    raise BucketError(
                        "INTERNAL", f"the new keys of {uid!r} cannot list the bucket (RGW "
                                    f"answered {refused}); does this RGW honour bucket "
                                    "policies?")
                await self._credentials.store(vault, bucket, access, claim)
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

    async def _rollback(self, bucket: str, made: Mapping[str, str]) -> list[str]:
        """Undo a failed create: the bucket (only if this call made it), the user, and last the
        Vault claim, which keeps other creators out until the rest is gone (it stays when
        removing the rest failed)."""
        problems: list[str] = []
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
        if made.get("bucket"):
            steps.append(("bucket", lambda: self._remove_new_bucket(bucket, made["bucket"])))
        if made.get("user"):
            steps.append(("user", lambda: self._s3.call("delete user", self._rgw.delete_user,
                                                        user_for(bucket))))
        for what, step in steps:
            try:
                await step()
            except (BucketError, VaultError) as exc:
                log.warning("rollback of bucket %s: removing the %s failed: %s", bucket, what,
                            exc)
                problems.append(f"{what}: {exc}")
        if made.get("secret") and not problems:
            try:
                await self._credentials.release(bucket)
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
            stats = await self._s3.call("bucket stats", self._rgw.stats, bucket)
            if stats is None:
                return
            if str(stats.get("owner") or "") != await self._s3.call("who am I",
                                                                    self._rgw.whoami):
                return
        await self._s3.call("delete bucket", self._rgw.purge_bucket, bucket,
                            read_timeout=self.config.purge_timeout_s)

    async def _info(self, bucket: str) -> BucketInfo:
        stats, versioning = await asyncio.gather(
            self._s3.call("bucket stats", self._rgw.stats, bucket),
            self._s3.call("get versioning", self._rgw.get_versioning, bucket),
            return_exceptions=True)
        if isinstance(stats, BaseException):
            raise stats
        if stats is None or (isinstance(versioning, BucketError)
                             and versioning.code == "NOT_FOUND"):
            raise BucketError("NOT_FOUND", f"bucket {bucket!r} not found")
        if isinstance(versioning, BaseException):
            raise versioning
        return self._base_info(bucket, versioning=bool(versioning), **stats_fields(stats))

    async def get(self, bucket_id: str) -> BucketInfo:
        return await self._info(bucket_name(bucket_id, "bucket_id"))

    async def delete(self, bucket_id: str, *, force: bool = False) -> None:
        """Delete the bucket, then its user and Vault secret; see the package doc."""
        bucket = bucket_name(bucket_id, "bucket_id")
        self._credentials.require("DeleteBucket")
        async with self._name_lock(bucket):
            stats = await self._s3.call("bucket stats", self._rgw.stats, bucket)
            if stats is None:
                if await self._remove_leftovers(bucket):
                    return
                raise BucketError("NOT_FOUND", f"bucket {bucket!r} not found")
            owner = str(stats.get("owner") or "")
            me = await self._s3.call("who am I", self._rgw.whoami)
            if owner != me:
                # Admin Ops could delete anyone's bucket: only ever touch our own
                raise BucketError(
                    "FAILED_PRECONDITION",
                    f"bucket_id: bucket {bucket!r} belongs to RGW user {owner!r}, not to the "
                    "control-plane user; it was not created through this API")
            if force:
                await self._s3.call("purge bucket", self._rgw.purge_bucket, bucket,
                                    read_timeout=self.config.purge_timeout_s)
            else:
                try:
                    await self._s3.call("delete bucket", self._rgw.delete_bucket, bucket)
                except BucketError as exc:
                    if exc.rgw_code == "BucketNotEmpty":
                        raise BucketError(
                            "FAILED_PRECONDITION",
                            f"bucket_id: bucket {bucket!r} is not empty; delete its objects "
                            "or pass force=true", rgw_code=exc.rgw_code) from None
                    raise
            if await self._s3.call("bucket stats", self._rgw.stats, bucket) is not None:
                raise BucketError("INTERNAL",
                                  f"rgw still has bucket {bucket!r} after deleting it")
            log.info("bucket deleted bucket=%s force=%s", bucket, force)
            try:
                await self._s3.call("delete user", self._rgw.delete_user, user_for(bucket))
                await self._credentials.remove("DeleteBucket", bucket)
            except BucketError as exc:
                raise BucketError(
                    exc.code, f"bucket {bucket!r} was deleted, but removing its credentials "
                              f"failed ({exc}); call DeleteBucket again to finish") from None

    async def _remove_leftovers(self, bucket: str) -> bool:
        """After a crash or a failed cleanup: remove the user and secret of a gone bucket.

        A claim younger than ``CLAIM_LIVE_S`` is a create in progress on some replica (its
        bucket not made yet): removing its user would leave it with dead keys, so the delete
        is refused (ABORTED) until that create has ended."""
        secret = await self._credentials.read("DeleteBucket", bucket)
        if claim_in_progress(secret, time.time()):
            raise BucketError("ABORTED", f"bucket {bucket!r} is being created; retry the "
                                         "delete when that create has ended")
        removed = await self._s3.call("delete user", self._rgw.delete_user, user_for(bucket))
        if secret is not None:
            await self._credentials.remove("DeleteBucket", bucket)
        if removed or secret is not None:
            log.info("bucket %s was already gone; removed leftover user=%s secret=%s", bucket,
                     removed, secret is not None)
            return True
        return False

    async def access(self, bucket_id: str) -> AccessInfo:
        """Where the bucket's credentials are; the secret key is left empty (see package doc)."""
        bucket = bucket_name(bucket_id, "bucket_id")
        self._credentials.require("GetBucketAccess")
        if not await self._s3.call("HEAD bucket", self._rgw.head_bucket, bucket):
            raise BucketError("NOT_FOUND", f"bucket {bucket!r} not found")
        secret = await self._credentials.read("GetBucketAccess", bucket)
        return self._credentials.access_info(bucket, secret)

    async def list_objects(self, bucket_id: str, *, prefix: str = "",
                           continuation_token: str = "", max_keys: int = 0) -> ObjectPage:
        bucket = bucket_name(bucket_id, "bucket_id")
        keys = page_size(max_keys)
        try:
            return await self._s3.call("list objects", self._rgw.list_objects, bucket, prefix,
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
            self._s3.call("list buckets", self._rgw.list_buckets),
            self._s3.call("bucket stats", self._rgw.all_stats))

        async def one(name: str, created: datetime | None) -> BucketInfo | None:
            info = self._base_info(name, created_at=created, updated_at=created)
            if name in stats:
                fields = {k: v for k, v in stats_fields(stats[name]).items() if v is not None}
                info = replace(info, **fields)
            try:
                versioning = await self._s3.call("get versioning", self._rgw.get_versioning,
                                                 name)
            except BucketError as exc:
                if exc.code == "NOT_FOUND":  # deleted while listing
                    return None
                raise
            return replace(info, versioning=versioning)

        infos = await asyncio.gather(*(one(n, c) for n, c in names))
        return sorted((i for i in infos if i is not None), key=lambda i: i.name)
