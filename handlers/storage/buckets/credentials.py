"""The Vault side of the bucket API: the name claim that lets one creator win, and the
bucket credentials stored under ``<prefix>/<bucket>`` (KV v2).

Apart from the commands because RGW offers no atomic claim of a name: Vault's check-and-set
is the lock shared by every replica, and its rules (claim with ``cas=0``, finish with
``cas=<claim version>``, a lost answer read back by its nonce, a claim younger than
``CLAIM_LIVE_S`` treated as a create in progress) are one job, kept together. Vault's failures
become ``BucketError`` here too.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from handlers.settings.buckets import BucketsConfig
from handlers.storage.buckets.model import AccessInfo, BucketError
from handlers.vault.client import VaultError, VaultKV

log = logging.getLogger("persys.buckets")

#: a creating claim younger than this is a create in progress (a create's steps are bounded
#: by their call deadlines, minutes at most); an older one is a crashed attempt's leftover
CLAIM_LIVE_S = 600.0


def _number(text: str | None) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0


def claim_in_progress(secret: Mapping[str, str] | None, now: float) -> bool:
    """Whether ``secret`` is the claim of a create that may still be running (on any
    replica): a ``creating`` placeholder younger than ``CLAIM_LIVE_S``."""
    return secret is not None and secret.get("state") == "creating" and (
        now - _number(secret.get("since")) < CLAIM_LIVE_S)


class BucketCredentials:
    """Claims, stores, reads and removes bucket credentials in Vault (``vault``: None when
    Vault is not configured, and every call that needs it is FAILED_PRECONDITION)."""

    def __init__(self, config: BucketsConfig, vault: VaultKV | None, *,
                 keep: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]) -> None:
        self.config = config
        self.vault = vault
        #: runs a clean-up to its end even when the caller is cancelled (the API owns it)
        self._keep = keep

    def require(self, what: str) -> VaultKV:
        if self.vault is None:
            raise BucketError(
                "FAILED_PRECONDITION",
                f"{what} needs Vault for the bucket credentials: set PERSYS_VAULT_ADDR and "
                "PERSYS_VAULT_TOKEN (or PERSYS_VAULT_APPROLE_ROLE_ID/_SECRET_ID)")
        return self.vault

    async def call(self, what: str, body: Callable[[VaultKV], Any]) -> Any:
        vault = self.require(what)
        try:
            return await body(vault)
        except VaultError as exc:
            code = {"unavailable": "UNAVAILABLE", "denied": "FAILED_PRECONDITION"}.get(
                exc.kind, "INTERNAL")
            raise BucketError(code, str(exc)) from None

    def kv_path(self, bucket: str) -> str:
        return f"{self.config.kv_path}/{bucket}"

    async def read(self, what: str, bucket: str) -> dict[str, str] | None:
        """What Vault holds for ``bucket`` (credentials or a claim); None when nothing."""
        held: dict[str, str] | None = await self.call(what, lambda v: v.read(
            self.config.kv_mount, self.kv_path(bucket)))
        return held

    async def remove(self, what: str, bucket: str) -> None:
        await self.call(what, lambda v: v.delete(self.config.kv_mount, self.kv_path(bucket)))

    async def claim(self, vault: VaultKV, bucket: str, leftover_hint: str) -> int:
        """Claim the name (``cas=0``); returns the claim's version.

        The claim carries a nonce and its time: a write whose answer was lost is recognised
        as ours and removed (or the name would stay claimed by nobody), and DeleteBucket can
        tell a create in progress from a crashed one's leftover."""
        nonce = uuid.uuid4().hex
        body = {"state": "creating", "claim": nonce, "since": str(int(time.time()))}
        try:
            return await vault.write(self.config.kv_mount, self.kv_path(bucket), body, cas=0)
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
            held = await vault.read(self.config.kv_mount, self.kv_path(bucket))
            if held is not None and held.get("claim") == nonce:
                await vault.delete(self.config.kv_mount, self.kv_path(bucket))
        except VaultError as exc:
            log.warning("bucket %s: the claim write failed and could not be checked: %s",
                        bucket, exc)

    async def store(self, vault: VaultKV, bucket: str, access: AccessInfo, claim: int) -> None:
        """Replace the claim (version ``claim``) with the bucket's credentials."""
        try:
            await vault.write(self.config.kv_mount, self.kv_path(bucket), {
                "endpoint": access.endpoint, "region": access.region,
                "bucket": bucket, "access_key": access.access_key,
                "secret_key": access.secret_key, "s3_url": access.s3_url}, cas=claim)
        except VaultError as exc:
            raise BucketError("UNAVAILABLE", f"storing the bucket credentials: {exc}"
                              ) from None

    async def release(self, bucket: str) -> None:
        """A rollback's last step: remove the claim; ``VaultError`` is the caller's."""
        if self.vault is not None:
            await self.vault.delete(self.config.kv_mount, self.kv_path(bucket))

    def access_info(self, bucket: str, secret: Mapping[str, str] | None) -> AccessInfo:
        """GetBucketAccess's answer from what Vault holds; the secret key left empty."""
        path = self.config.vault_path(bucket)
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
