"""A small async Vault (or OpenBao) client over ``hvac``: KV v2 for the bucket credentials, and
any other call (the PKI issue of the certificate manager) through ``run``.

Why it exists: per-bucket S3 keys are stored in Vault only (never in etcd, logs or events), and
``hvac`` is blocking. Every call here runs on this object's own bounded thread pool (``vault``
threads), under a semaphore of the same size so that waiting for a thread counts against the
call's deadline, with a timeout in ``requests`` (so the thread ends) and in asyncio.

Authentication (docs/compatibility.md, "Vault access"):

* ``PERSYS_VAULT_TOKEN``: used as given. It is looked up and, if renewable, renewed on the
  refresh schedule below; a failed lookup is logged and the token kept (the next real call
  reports the actual error).
* Otherwise AppRole login at ``PERSYS_VAULT_APPROLE_MOUNT``. The token is renewed on schedule
  (re-login when renewal fails or the renewed lease is too short), and a call refused with 403
  or 401 logs in again once and retries, since the token may have been revoked.
* Refresh schedule (``refresh_after``): a lease of 0 counts as 1 h; refresh at 80 % of the
  lease; when that is under 1 min, at lease - 10 s; floor 30 s, but never later than half the
  lease (the Go version's plain 30 s floor refreshed a 20 s token after it had expired).

Invariants: tokens, secret ids and secret values are never logged or put into exception
messages; errors are ``VaultError`` with a ``kind`` the bucket API maps to a gRPC status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import hvac  # type: ignore[import-untyped]
import requests
from hvac import exceptions as hvac_exc

from handlers.settings.buckets import VaultConfig

__all__ = ["VaultError", "VaultKV", "refresh_after"]

log = logging.getLogger("persys.vault")

T = TypeVar("T")
Kind = Literal["unavailable", "denied", "invalid", "conflict", "internal"]

_UNAVAILABLE = (hvac_exc.VaultDown, hvac_exc.InternalServerError, hvac_exc.BadGateway,
                hvac_exc.RateLimitExceeded, hvac_exc.VaultNotInitialized)


class VaultError(Exception):
    """A Vault call failed. ``kind``: unavailable, denied, invalid, conflict (a check-and-set
    write lost) or internal."""

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind: Kind = kind


def refresh_after(lease_s: float) -> float:
    """Seconds after which a token with a lease of ``lease_s`` seconds is refreshed."""
    lease = lease_s if lease_s > 0 else 3600.0
    after = lease * 0.8
    if after < 60.0:
        after = lease - 10.0
    return max(after, min(30.0, lease * 0.5))


async def _until_done(call: Future[Any]) -> None:
    """Wait until a call already running in its thread has ended, whatever its outcome; a
    call still queued is cancelled."""
    if call.cancel() or call.done():
        return
    with contextlib.suppress(Exception):  # its own error is answered elsewhere
        await asyncio.shield(asyncio.wrap_future(call))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _translate(exc: Exception, what: str) -> VaultError:
    if isinstance(exc, requests.exceptions.RequestException):
        return VaultError("unavailable", f"vault {what}: {type(exc).__name__}: "
                                         f"{_one_line(exc)}")
    if isinstance(exc, _UNAVAILABLE):
        return VaultError("unavailable", f"vault {what}: {_one_line(exc)}")
    if isinstance(exc, hvac_exc.Forbidden | hvac_exc.Unauthorized):
        return VaultError("denied", f"vault {what}: permission denied ({_one_line(exc)})")
    if isinstance(exc, hvac_exc.InvalidRequest):
        kind: Kind = "conflict" if "check-and-set" in str(exc) else "invalid"
        return VaultError(kind, f"vault {what}: {_one_line(exc)}")
    return VaultError("internal", f"vault {what}: {type(exc).__name__}: {_one_line(exc)}")


class VaultKV:
    """KV v2 read/write/delete with token or AppRole auth, off the event loop."""

    def __init__(self, config: VaultConfig, *, workers: int = 2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vault")
        self._slots = asyncio.Semaphore(workers)
        self._lock = threading.Lock()
        self._client: Any = None
        self._refresh_at = 0.0
        self._renewable = False
        self._closed = False

    # -- async API -----------------------------------------------------------------------------

    async def write(self, mount: str, path: str, data: Mapping[str, str], *,
                    cas: int | None = None) -> int:
        """Create or replace the secret at ``<mount>/data/<path>``; returns its new version.

        With ``cas`` the write happens only if the current version is ``cas`` (0: only if
        there is no secret yet); otherwise ``VaultError("conflict")``. That is atomic in Vault,
        which makes it a claim on a name across replicas."""
        payload = dict(data)

        def call(client: Any) -> int:
            resp = client.secrets.kv.v2.create_or_update_secret(
                path=path, secret=payload, cas=cas, mount_point=mount)
            return int(((resp or {}).get("data") or {}).get("version") or 0)

        version: int = await self._run(call, "write")
        return version

    async def read(self, mount: str, path: str) -> dict[str, str] | None:
        """The secret's data, or ``None`` when there is none (or its latest version is
        deleted)."""

        def call(client: Any) -> dict[str, str] | None:
            try:
                resp = client.secrets.kv.v2.read_secret_version(
                    path=path, mount_point=mount, raise_on_deleted_version=True)
            except hvac_exc.InvalidPath:
                return None
            data = resp.get("data", {}).get("data") or {}
            return {str(k): str(v) for k, v in data.items()}

        result: dict[str, str] | None = await self._run(call, "read")
        return result

    async def delete(self, mount: str, path: str) -> None:
        """Delete every version and the metadata; a missing secret is not an error."""

        def call(client: Any) -> None:
            try:
                client.secrets.kv.v2.delete_metadata_and_all_versions(path=path,
                                                                      mount_point=mount)
            except hvac_exc.InvalidPath:
                return

        await self._run(call, "delete")

    async def run(self, call: Callable[[Any], T], what: str) -> T:
        """Any other Vault call (``call(client)`` on a vault thread, authenticated, re-login
        once on 401/403), e.g. the PKI issue of ``handlers/cluster/certificates.py``."""
        return await self._run(call, what)

    async def close(self) -> None:
        """Stop accepting calls and wait for the running ones (each is bounded by timeouts)."""
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._executor.shutdown(wait=True, cancel_futures=True))
        client = self._client
        if client is not None:
            adapter = getattr(client, "adapter", None)
            if adapter is not None and hasattr(adapter, "close"):
                adapter.close()

    # -- plumbing ------------------------------------------------------------------------------

    async def _run(self, call: Callable[[Any], T], what: str) -> T:
        if self._closed:
            raise VaultError("unavailable", "vault client is closed")
        # login + call + one retry after re-login, each bounded by the requests timeout
        deadline = self.config.timeout_s * 2 + 5.0
        started: Future[T] | None = None
        try:
            async with asyncio.timeout(deadline):
                async with self._slots:
                    started = self._executor.submit(self._call, call, what)
                    return await asyncio.wrap_future(started)
        except TimeoutError as exc:
            if started is not None:
                await _until_done(started)
            raise VaultError("unavailable", f"vault {what}: no answer within {deadline:.0f}s"
                             ) from exc
        except asyncio.CancelledError:
            # the call goes on in its thread (a write takes effect): whoever undoes it next
            # must see it, so the cancellation waits for it (bounded by the requests timeout)
            if started is not None:
                await _until_done(started)
            raise

    def _call(self, call: Callable[[Any], T], what: str) -> T:
        """On a vault thread: authenticate if needed, call, re-login once on 401/403."""
        try:
            client = self._authenticated()
            try:
                return call(client)
            except (hvac_exc.Forbidden, hvac_exc.Unauthorized):
                if not self.config.uses_approle:
                    raise
                log.info("vault refused the AppRole token; logging in again")
                client = self._authenticated(force_login=True)
                return call(client)
        except VaultError:
            raise
        except (hvac_exc.VaultError, requests.exceptions.RequestException, ValueError,
                KeyError, TypeError) as exc:
            raise _translate(exc, what) from None

    def _authenticated(self, *, force_login: bool = False) -> Any:
        with self._lock:
            if self._client is None:
                self._client = hvac.Client(url=self.config.addr, timeout=self.config.timeout_s)
                if not self.config.uses_approle:
                    self._client.token = self.config.token
            now = self._clock()
            if self.config.uses_approle:
                if force_login or not self._client.token:
                    self._login(now)
                elif now >= self._refresh_at:
                    self._renew_or_login(now)
            elif now >= self._refresh_at:
                self._refresh_static(now)
            return self._client

    def _login(self, now: float) -> None:
        mount = self.config.approle_mount.removeprefix("auth/")
        try:
            resp = self._client.auth.approle.login(role_id=self.config.role_id,
                                                   secret_id=self.config.secret_id,
                                                   mount_point=mount, use_token=True)
        except (hvac_exc.VaultError, requests.exceptions.RequestException) as exc:
            self._client.token = None
            raise _translate(exc, "approle login") from None
        auth = resp.get("auth") or {}
        lease = float(auth.get("lease_duration") or 0)
        self._renewable = bool(auth.get("renewable"))
        self._refresh_at = now + refresh_after(lease)
        log.info("vault approle login ok lease_s=%.0f refresh_in_s=%.0f", lease,
                 self._refresh_at - now)

    def _renew_or_login(self, now: float) -> None:
        if self._renewable:
            try:
                resp = self._client.auth.token.renew_self()
                lease = float((resp.get("auth") or {}).get("lease_duration") or 0)
                if lease >= 60.0:
                    self._refresh_at = now + refresh_after(lease)
                    log.info("vault token renewed lease_s=%.0f", lease)
                    return
                log.info("vault token near its max TTL (lease_s=%.0f); logging in again", lease)
            except (hvac_exc.VaultError, requests.exceptions.RequestException) as exc:
                log.warning("vault token renewal failed (%s); logging in again",
                            _translate(exc, "renew"))
        self._login(now)

    def _refresh_static(self, now: float) -> None:
        try:
            data = self._client.auth.token.lookup_self().get("data") or {}
            ttl = float(data.get("ttl") or 0)
            if data.get("renewable") and ttl > 0:
                resp = self._client.auth.token.renew_self()
                ttl = float((resp.get("auth") or {}).get("lease_duration") or ttl)
                log.info("vault token renewed lease_s=%.0f", ttl)
            self._refresh_at = now + refresh_after(ttl)
        except (hvac_exc.VaultError, requests.exceptions.RequestException) as exc:
            # keep the token: the call that follows reports what is really wrong
            log.warning("vault token lookup/renewal failed: %s", _translate(exc, "lookup"))
            self._refresh_at = now + 30.0
