"""What every private server process shares: spawn, signal by PID, reap, ports and logs.

Apart from the servers (``ops.devstack.etcd``, ``ops.devstack.redis``, and ``ops/openbao.py``,
``ops/rgw.py`` outside the package) because none of this knows which server it runs: the
:class:`ServerProcess` lifecycle (own session, SIGTERM then SIGKILL, SIGSTOP/SIGCONT), liveness
that counts zombies as dead, free and busy loopback ports, and the log tail that failure
messages carry.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

LOG_TAIL_BYTES = 4000
#: Starts on auto-picked ports are retried this often when another process took a port first.
PORT_RETRIES = 3
ADDR_IN_USE = re.compile(r"address already in use", re.IGNORECASE)


class ServerStartError(RuntimeError):
    """A server process did not become ready before its deadline (the message has its log tail)."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (kernel-picked)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_except(taken: int) -> int:
    """A free loopback port other than ``taken`` (a server's second port)."""
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


def _tail(*paths: Path, limit: int = LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of each non-empty log in ``paths``, headed by its path."""
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


def is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


class ServerProcess:
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

    def log_tail(self, limit: int = LOG_TAIL_BYTES) -> str:
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
