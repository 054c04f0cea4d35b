"""Bucket API configuration: environment -> one frozen ``BucketsConfig`` (or none).

Why it is separate from ``handlers/settings/config.py``: the bucket API is optional and has its own
variables (docs/compatibility.md, "Buckets"), and its secrets (the RGW admin secret key, the
Vault token and AppRole secret_id) must never end up in ``Settings`` reprs, logs or errors.
``repr()`` of every dataclass here hides them.

Rules:

* ``PERSYS_RGW_ENDPOINT`` (fallback ``PERSYS_S3_ENDPOINT``) unset or empty -> no bucket API
  (``load_buckets_config`` returns ``None``; the servicer answers FAILED_PRECONDITION).
* An endpoint without both keys, an endpoint that is not an http(s) URL, a Vault path prefix
  that is not a KV v2 API path (``<mount>/data/<path>``), half an AppRole, or a Vault address
  without any way to authenticate is a ``ConfigError`` naming the variable: the process refuses
  to start rather than fail later on the first request (the Go version failed per request).
* ``PERSYS_VAULT_ADDR`` unset -> ``vault`` is ``None``: buckets can be listed and read, but
  create, delete and access need Vault (FAILED_PRECONDITION naming the variable).
* Vault auth: ``PERSYS_VAULT_TOKEN`` wins; otherwise AppRole login with
  ``PERSYS_VAULT_APPROLE_ROLE_ID``/``_SECRET_ID`` at ``PERSYS_VAULT_APPROLE_MOUNT``. The Go
  version's vault-manager gRPC (``PERSYS_VAULT_MANAGER_ADDR``, insecure and unauthenticated) is
  deliberately not implemented: give the scheduler its own AppRole (docs/compatibility.md,
  "Vault access").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from handlers.settings.reader import ConfigError

__all__ = ["BucketsConfig", "VaultConfig", "load_buckets_config", "load_vault_config"]

DEFAULT_REGION = "default"
DEFAULT_ADMIN_PATH = "admin"
DEFAULT_VAULT_PREFIX = "secret/data/persys/rgw/buckets"
DEFAULT_APPROLE_MOUNT = "auth/approle"


@dataclass(frozen=True, slots=True)
class VaultConfig:
    """Where and how to reach Vault (or OpenBao). Secrets are hidden from ``repr``."""

    addr: str
    token: str = field(default="", repr=False)
    approle_mount: str = DEFAULT_APPROLE_MOUNT
    role_id: str = ""
    secret_id: str = field(default="", repr=False)
    #: Seconds for each Vault HTTP call (the Go version used 15 s).
    timeout_s: float = 15.0

    @property
    def uses_approle(self) -> bool:
        return not self.token


@dataclass(frozen=True, slots=True)
class BucketsConfig:
    """RGW control-plane access plus the Vault KV v2 location of the per-bucket keys."""

    endpoint: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = DEFAULT_REGION
    admin_path: str = DEFAULT_ADMIN_PATH
    #: KV v2 API path prefix, ``<mount>/data/<path>``; a bucket's secret is at ``<prefix>/<b>``.
    vault_prefix: str = DEFAULT_VAULT_PREFIX
    vault: VaultConfig | None = None
    #: Seconds to connect to RGW, and to wait for an answer (the Go version used 30 s total).
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    #: Seconds for a forced delete (RGW purges every object before it answers).
    purge_timeout_s: float = 300.0
    #: Threads for blocking S3/Admin Ops calls, and for Vault calls.
    s3_workers: int = 4
    vault_workers: int = 2

    @property
    def kv_mount(self) -> str:
        """The KV v2 mount (``secret`` for ``secret/data/persys/...``)."""
        return self.vault_prefix.split("/data/", 1)[0]

    @property
    def kv_path(self) -> str:
        """The path under the mount (``persys/rgw/buckets``)."""
        return self.vault_prefix.split("/data/", 1)[1]

    def vault_path(self, bucket: str) -> str:
        """The full KV v2 API path of a bucket's secret, as reported in ``BucketAccess``."""
        return f"{self.vault_prefix}/{bucket}"


def _first(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return value
    return ""


def load_vault_config(env: Mapping[str, str]) -> VaultConfig | None:
    """``VaultConfig`` from ``PERSYS_VAULT_*``, ``None`` without ``PERSYS_VAULT_ADDR``."""
    addr = _first(env, "PERSYS_VAULT_ADDR").rstrip("/")
    if not addr:
        return None
    if urlsplit(addr).scheme not in ("http", "https") or not urlsplit(addr).netloc:
        raise ConfigError(f"PERSYS_VAULT_ADDR: {addr!r} is not an http(s) URL")
    token = _first(env, "PERSYS_VAULT_TOKEN")
    role_id = _first(env, "PERSYS_VAULT_APPROLE_ROLE_ID")
    secret_id = _first(env, "PERSYS_VAULT_APPROLE_SECRET_ID")
    mount = _first(env, "PERSYS_VAULT_APPROLE_MOUNT").strip("/") or DEFAULT_APPROLE_MOUNT
    if not token:
        if not role_id and not secret_id:
            raise ConfigError(
                "PERSYS_VAULT_TOKEN: PERSYS_VAULT_ADDR is set but neither PERSYS_VAULT_TOKEN "
                "nor PERSYS_VAULT_APPROLE_ROLE_ID/PERSYS_VAULT_APPROLE_SECRET_ID is")
        if not role_id or not secret_id:
            missing = ("PERSYS_VAULT_APPROLE_ROLE_ID" if not role_id
                       else "PERSYS_VAULT_APPROLE_SECRET_ID")
            raise ConfigError(f"{missing}: AppRole login needs both the role and secret id")
    return VaultConfig(addr=addr, token=token, approle_mount=mount, role_id=role_id,
                       secret_id=secret_id)


def load_buckets_config(env: Mapping[str, str]) -> BucketsConfig | None:
    """``BucketsConfig`` from the environment, ``None`` when no RGW endpoint is configured.

    Raises:
        ConfigError: a half or invalid configuration, naming the variable.
    """
    endpoint = _first(env, "PERSYS_RGW_ENDPOINT", "PERSYS_S3_ENDPOINT").rstrip("/")
    if not endpoint:
        return None
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"PERSYS_RGW_ENDPOINT: {endpoint!r} is not an http(s) URL")
    if parts.path not in ("", "/") or parts.query:
        raise ConfigError(f"PERSYS_RGW_ENDPOINT: {endpoint!r} must not have a path or query")
    access_key = _first(env, "PERSYS_RGW_ACCESS_KEY", "PERSYS_S3_ACCESS_KEY")
    secret_key = _first(env, "PERSYS_RGW_SECRET_KEY", "PERSYS_S3_SECRET_KEY")
    if not access_key:
        raise ConfigError("PERSYS_RGW_ACCESS_KEY: required with PERSYS_RGW_ENDPOINT")
    if not secret_key:
        raise ConfigError("PERSYS_RGW_SECRET_KEY: required with PERSYS_RGW_ENDPOINT")
    region = _first(env, "PERSYS_RGW_REGION") or DEFAULT_REGION
    admin_path = _first(env, "PERSYS_RGW_ADMIN_PATH").strip("/") or DEFAULT_ADMIN_PATH
    prefix = _first(env, "PERSYS_RGW_VAULT_PATH_PREFIX").strip("/") or DEFAULT_VAULT_PREFIX
    mount, sep, rest = prefix.partition("/data/")
    if not sep or not mount or not rest:
        raise ConfigError(
            f"PERSYS_RGW_VAULT_PATH_PREFIX: {prefix!r} is not a KV v2 API path "
            "(<mount>/data/<path>, e.g. secret/data/persys/rgw/buckets)")
    return BucketsConfig(endpoint=endpoint, access_key=access_key, secret_key=secret_key,
                         region=region, admin_path=admin_path, vault_prefix=prefix,
                         vault=load_vault_config(env))
