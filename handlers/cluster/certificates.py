"""The scheduler's own mTLS certificate from Vault (or OpenBao) PKI: the Go version's certmanager.

With ``PERSYS_VAULT_ENABLED=true`` and TLS on, the certificate is issued at
``<PERSYS_VAULT_PKI_MOUNT>/issue/<PERSYS_VAULT_PKI_ROLE>`` with ``common_name`` =
``PERSYS_VAULT_SERVICE_NAME``, ``ttl`` = ``PERSYS_VAULT_CERT_TTL``, ``alt_names`` (the service
name, and ``<service>.<PERSYS_VAULT_SERVICE_DOMAIN>`` when set) and ``ip_sans``
(``SCHEDULER_ADVERTISE_IP`` and ``PERSYS_EXTERNAL_IP`` when set, and 127.0.0.1), and written
to ``PERSYS_TLS_CERT``, ``PERSYS_TLS_KEY`` and ``PERSYS_TLS_CA``. Nothing else needs to know:
the gRPC server reloads those files when they change (``handlers/cluster/tls.py``) and the agent
pool opens new channels with them (``handlers/agents/pool.py``).

* **When**: once before the server starts (retried every ``PERSYS_VAULT_RETRY_INTERVAL`` until
  it works; if usable files are already there the server starts with them and the retries go
  on in the background), then at 80 % of each certificate's lifetime (30 s floor, never after
  expiry: :func:`rotate_at`).
* **Forced**: an agent call that fails in the TLS handshake asks for a new certificate
  (``force_rotate``) and is retried once; concurrent requests share one issuance, and at most
  one forced issuance happens per ``min_force_interval`` so that an agent with a broken
  certificate of its own cannot make the scheduler hammer Vault.
* **Files**: each is written to a temporary file next to it and renamed into place, the three
  renames back to back on the event loop, so no reader on the loop ever sees a certificate with
  another one's key. The key file is created 0600.
* **Secrets**: the private key and the Vault token never reach logs, events, etcd or
  exception messages; logs carry the serial number and the expiry.

Authentication is ``handlers/vault/client.py``'s (token, or AppRole; vault-manager is not used).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from eventsource.metrics import Metrics
from eventsource.racing import race
from handlers.cluster.tls import unusable
from handlers.settings.buckets import DEFAULT_APPROLE_MOUNT, VaultConfig
from handlers.settings.config import Settings
from handlers.settings.reader import ConfigError, parse_duration
from handlers.vault.client import VaultError, VaultKV

__all__ = ["CertConfig", "CertManager", "IssuedCert", "build_cert_manager", "load_cert_config",
           "rotate_at"]

log = logging.getLogger("persys.certs")

T = TypeVar("T")

#: a certificate is never rotated sooner than this after it was issued (the Go floor)
MIN_ROTATE_S = 30.0
#: rotate at this fraction of the lifetime
ROTATE_FRACTION = 0.8


def rotate_at(issued_at: float, expires_at: float) -> float:
    """When to replace a certificate valid from ``issued_at`` to ``expires_at`` (epoch s).

    80 % of the lifetime, but not sooner than 30 s after issue; a lifetime under 30 s (a
    misconfigured TTL) is still replaced before it ends, at 90 % of it.
    """
    lifetime = max(0.0, expires_at - issued_at)
    due = issued_at + max(MIN_ROTATE_S, ROTATE_FRACTION * lifetime)
    return min(due, issued_at + 0.9 * lifetime)


@dataclass(frozen=True, slots=True)
class CertConfig:
    """What to ask Vault for and where to put it."""

    vault: VaultConfig
    mount: str = "pki"
    role: str = "persys-scheduler"
    service_name: str = "persys-scheduler"
    service_domain: str = ""
    ttl_s: float = 24 * 3600.0
    retry_interval_s: float = 60.0
    ip_sans: tuple[str, ...] = ("127.0.0.1",)
    cert_path: str = ""
    key_path: str = ""
    ca_path: str = ""

    @property
    def alt_names(self) -> tuple[str, ...]:
        names = [self.service_name]
        if self.service_domain:
            names.append(f"{self.service_name}.{self.service_domain.strip('.')}")
        return tuple(names)


def load_cert_config(env: Mapping[str, str], *, cert_path: str, key_path: str, ca_path: str,
                     advertise_ip: str = "") -> CertConfig:
    """``CertConfig`` from ``PERSYS_VAULT_*`` (Go names and defaults).

    The certificate's IP SANs are ``advertise_ip`` (``SCHEDULER_ADVERTISE_IP``),
    ``PERSYS_EXTERNAL_IP`` (the address agents dial when the scheduler sits behind NAT or a
    load balancer) and 127.0.0.1, each once.

    Raises:
        ConfigError: naming the variable (a missing token or AppRole id, a bad duration, a
            ``PERSYS_EXTERNAL_IP`` that is not an IP address).
    """
    def get(name: str, default: str = "") -> str:
        return env.get(name, "").strip() or default

    addr = get("PERSYS_VAULT_ADDR", "http://localhost:8200").rstrip("/")
    if not addr.startswith(("http://", "https://")):
        raise ConfigError(f"PERSYS_VAULT_ADDR: {addr!r} is not an http(s) URL")
    method = get("PERSYS_VAULT_AUTH_METHOD", "token").lower()
    token = get("PERSYS_VAULT_TOKEN")
    role_id = get("PERSYS_VAULT_APPROLE_ROLE_ID")
    secret_id = get("PERSYS_VAULT_APPROLE_SECRET_ID")
    if method == "token":
        if not token:
            raise ConfigError("PERSYS_VAULT_TOKEN: PERSYS_VAULT_ENABLED with the token auth "
                              "method needs a token (or PERSYS_VAULT_AUTH_METHOD=approle)")
        role_id = secret_id = ""
    elif method == "approle":
        if not role_id or not secret_id:
            missing = ("PERSYS_VAULT_APPROLE_ROLE_ID" if not role_id
                       else "PERSYS_VAULT_APPROLE_SECRET_ID")
            raise ConfigError(f"{missing}: AppRole login needs both the role and secret id")
        token = ""
    else:
        raise ConfigError(f"PERSYS_VAULT_AUTH_METHOD: {method!r} is not 'token' or 'approle'")
    ttl = parse_duration("PERSYS_VAULT_CERT_TTL", get("PERSYS_VAULT_CERT_TTL", "24h"))
    retry = parse_duration("PERSYS_VAULT_RETRY_INTERVAL", get("PERSYS_VAULT_RETRY_INTERVAL", "1m"))
    if ttl < 60:
        raise ConfigError(f"PERSYS_VAULT_CERT_TTL: {ttl:g}s is under the minimum of 1m")
    if retry < 1:
        raise ConfigError(f"PERSYS_VAULT_RETRY_INTERVAL: {retry:g}s is under the minimum of 1s")
    external = get("PERSYS_EXTERNAL_IP")
    if external:
        try:
            external = str(ipaddress.ip_address(external))
        except ValueError as exc:
            raise ConfigError(f"PERSYS_EXTERNAL_IP: {external!r} is not an IP address") from exc
    ips = tuple(dict.fromkeys(ip for ip in (advertise_ip, external, "127.0.0.1") if ip))
    vault = VaultConfig(addr=addr, token=token,
                        approle_mount=get("PERSYS_VAULT_APPROLE_MOUNT", DEFAULT_APPROLE_MOUNT),
                        role_id=role_id, secret_id=secret_id)
    return CertConfig(
        vault=vault,
        mount=get("PERSYS_VAULT_PKI_MOUNT", "pki").strip("/"),
        role=get("PERSYS_VAULT_PKI_ROLE", "persys-scheduler"),
        service_name=get("PERSYS_VAULT_SERVICE_NAME", "persys-scheduler"),
        service_domain=get("PERSYS_VAULT_SERVICE_DOMAIN"),
        ttl_s=ttl, retry_interval_s=retry, ip_sans=ips,
        cert_path=cert_path, key_path=key_path, ca_path=ca_path,
    )


@dataclass(frozen=True, slots=True)
class IssuedCert:
    """One issued certificate; ``key_pem`` is hidden from ``repr``."""

    cert_pem: str
    key_pem: str = field(repr=False)
    ca_pem: str
    serial: str
    issued_at: float
    expires_at: float

    @classmethod
    def from_vault(cls, data: Mapping[str, Any], *, issued_at: float) -> IssuedCert:
        """From the ``data`` of ``<mount>/issue/<role>``; ValueError names a missing field."""
        cert = str(data.get("certificate") or "")
        key = str(data.get("private_key") or "")
        if not cert or not key:
            raise ValueError("vault pki issue: the answer has no certificate or private_key")
        chain = data.get("ca_chain") or []
        ca = "\n".join(str(c).strip() for c in chain) if chain else str(
            data.get("issuing_ca") or "").strip()
        if not ca:
            raise ValueError("vault pki issue: the answer has no issuing_ca or ca_chain")
        expires = float(data.get("expiration") or 0)
        if expires <= issued_at:
            raise ValueError(f"vault pki issue: expiration {expires:.0f} is not in the future")
        return cls(cert_pem=cert.strip() + "\n", key_pem=key.strip() + "\n", ca_pem=ca + "\n",
                   serial=str(data.get("serial_number") or ""), issued_at=issued_at,
                   expires_at=expires)


class CertManager:
    """Issues, writes and rotates the scheduler's certificate; one owned task runs ``run``."""

    def __init__(self, config: CertConfig, vault: VaultKV, metrics: Metrics, *,
                 wall: Callable[[], float] = time.time,
                 min_force_interval: float = MIN_ROTATE_S) -> None:
        self.config = config
        self.vault = vault
        self.metrics = metrics
        self.min_force_interval = min_force_interval
        self.current: IssuedCert | None = None
        self._wall = wall
        self._wake = asyncio.Event()
        self._issuing: asyncio.Task[bool] | None = None
        self._last_forced = float("-inf")
        #: wall time of the last failed issuance (None after a success): retries wait for it
        self._failed_at: float | None = None

    # -- public ---------------------------------------------------------------------------------
    async def ensure(self, *, stop: asyncio.Event | None = None) -> bool:
        """Issue the first certificate before the server starts; False when ``stop`` was set.

        Retries every ``retry_interval_s`` while Vault fails; returns early (leaving the
        retries to ``run``) when usable files are already there, since a server with an older
        certificate is better than none. ``stop`` ends the wait at once, also during a Vault
        call (whose issue then goes on until ``aclose``).
        """
        while True:
            if stop is not None and stop.is_set():
                return False
            issued = await _unless(stop, self._issue_once("startup"))
            if stop is not None and stop.is_set():
                return False
            if issued:
                return True
            c = self.config
            problem = unusable(c.ca_path, c.cert_path, c.key_path)
            if problem is None:
                log.warning("vault pki: starting with the certificate files already present; "
                            "retrying every %.0fs", c.retry_interval_s)
                return True
            log.warning("vault pki: no usable certificate yet (%s); retrying in %.0fs", problem,
                        c.retry_interval_s)
            await _unless(stop, asyncio.sleep(c.retry_interval_s))

    async def run(self) -> None:
        """Rotate on schedule or when forced; retry a failed issuance after the interval."""
        while True:
            forced = await self._pause(self._next_wait())
            if not forced:
                await self._issue_once("scheduled" if self.current is not None else "retry")

    def _next_wait(self) -> float:
        now = self._wall()
        if self._failed_at is not None:
            return max(0.0, self._failed_at + self.config.retry_interval_s - now)
        current = self.current
        if current is None:
            return self.config.retry_interval_s
        return max(0.0, rotate_at(current.issued_at, current.expires_at) - now)

    async def force_rotate(self) -> bool:
        """A new certificate now, for a peer that refused ours; True when one was written.

        Concurrent callers share one issuance; within ``min_force_interval`` of the last forced
        one the answer is False at once (the certificate was just replaced, so the refusal has
        another cause).
        """
        if self._issuing is not None:
            return await asyncio.shield(self._issuing)
        now = time.monotonic()
        if now - self._last_forced < self.min_force_interval:
            return False
        self._last_forced = now
        return await self._issue_once("forced")

    async def aclose(self) -> None:
        """Cancel and await an issuance in flight (``run`` is cancelled by its owner), then
        close the Vault client this manager owns."""
        task = self._issuing
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        await self.vault.close()

    # -- plumbing -------------------------------------------------------------------------------
    async def _pause(self, seconds: float) -> bool:
        """Sleep ``seconds`` or until woken; True when woken."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
        except TimeoutError:
            return False
        return True

    async def _issue_once(self, why: str) -> bool:
        """Issue, or join the issuance in flight (a caller that gives up does not stop it)."""
        task = self._issuing
        if task is None:
            task = asyncio.get_running_loop().create_task(self._issue(why),
                                                          name="vault-pki-issue")
            self._issuing = task
            task.add_done_callback(self._issued)
        return await asyncio.shield(task)

    def _issued(self, task: asyncio.Task[bool]) -> None:
        if self._issuing is task:
            self._issuing = None

    async def _issue(self, why: str) -> bool:
        c = self.config
        params = {"ttl": f"{int(c.ttl_s)}s", "alt_names": ",".join(c.alt_names),
                  "ip_sans": ",".join(c.ip_sans)}

        def call(client: Any) -> dict[str, Any]:
            resp = client.secrets.pki.generate_certificate(
                name=c.role, common_name=c.service_name, extra_params=params,
                mount_point=c.mount)
            return dict((resp or {}).get("data") or {})

        started = self._wall()
        try:
            data: dict[str, Any] = await self.vault.run(call, "pki issue")
            issued = IssuedCert.from_vault(data, issued_at=started)
            await self._write(issued)
        except (VaultError, ValueError, OSError) as exc:
            self._failed_at = self._wall()
            self.metrics.cert_rotations.labels(why, "failed").inc()
            log.warning("vault pki: %s issue of %s/issue/%s failed: %s", why, c.mount, c.role, exc)
            return False
        self.current = issued
        self._failed_at = None
        self.metrics.cert_rotations.labels(why, "ok").inc()
        self._wake.set()  # the schedule changed
        log.info("vault pki: %s certificate issued serial=%s expires_at=%s rotate_in_s=%.0f",
                 why, issued.serial, time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                   time.gmtime(issued.expires_at)),
                 rotate_at(issued.issued_at, issued.expires_at) - self._wall())
        return True

    async def _write(self, issued: IssuedCert) -> None:
        c = self.config
        staging = asyncio.get_running_loop().run_in_executor(None, _stage, [
            (c.key_path, issued.key_pem, 0o600),
            (c.cert_path, issued.cert_pem, 0o644),
            (c.ca_path, issued.ca_pem, 0o644),
        ])
        try:
            staged = await asyncio.shield(staging)
        except asyncio.CancelledError:
            # the thread writes them anyway: no copy of the key may stay behind
            staging.add_done_callback(_discard)
            raise
        # back to back on the loop: nothing on it sees the new certificate with the old key
        # (the server's reload runs on a grpc thread; a pair it catches mid-rename fails its
        # check, the last good files stay, and the next handshake loads the new ones)
        for temp, final in staged:
            os.replace(temp, final)


def build_cert_manager(settings: Settings, env: Mapping[str, str],
                       metrics: Metrics) -> CertManager | None:
    """The Vault PKI certificate manager when ``PERSYS_VAULT_ENABLED`` and TLS is used.

    Raises:
        ConfigError: the Vault settings are incomplete or invalid (naming the variable).
    """
    if not settings.vault_enabled or (settings.insecure and not settings.agent_tls_enabled):
        return None
    config = load_cert_config(env, cert_path=settings.tls_cert, key_path=settings.tls_key,
                              ca_path=settings.tls_ca, advertise_ip=settings.advertise_ip)
    log.info("certificates from vault pki %s/issue/%s at %s for %s", config.mount, config.role,
             config.vault.addr, config.service_name)
    return CertManager(config, VaultKV(config.vault, workers=1), metrics)


async def _unless(stop: asyncio.Event | None, work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, or None as soon as ``stop`` is set (``work`` is then cancelled)."""
    if stop is None:
        return await work
    _, result = await race(work, stop)
    return result


def _discard(staging: asyncio.Future[list[tuple[str, str]]]) -> None:
    if staging.cancelled() or staging.exception() is not None:
        return
    for temp, _ in staging.result():
        with contextlib.suppress(OSError):
            os.unlink(temp)


def _stage(files: list[tuple[str, str, int]]) -> list[tuple[str, str]]:
    """Write each content to a temporary file in its target's directory (fsynced)."""
    staged: list[tuple[str, str]] = []
    try:
        for path, content, mode in files:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            staged.append((temp, path))
            with os.fdopen(fd, "w") as out:
                os.fchmod(out.fileno(), mode)
                out.write(content)
                out.flush()
                os.fsync(out.fileno())
    except BaseException:  # any failure, cancellation included: no key copy stays behind
        for temp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        raise
    return staged
