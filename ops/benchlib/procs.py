"""Process accounting from /proc, and the child processes the bench owns.

Why: RSS is a figure (``scheduler_rss_mib``), and the CPU seconds each process burned during a
measured phase say where the time went on a shared 2-core machine, without a profiler.

``Child`` is a subprocess started in its own session (a Ctrl-C at the terminal reaches the bench
only, which then stops its children in order), logging to a file, and stopped by its PID alone:
SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_TAIL_BYTES = 3000


def rss_mib(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB (``VmRSS``), or None when it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            parts = line.split()
            return int(parts[1]) / 1024.0  # kB
    return None


def peak_rss_mib(pid: int) -> float | None:
    """Peak resident set size of ``pid`` since it started, in MiB (``VmHWM``), or None."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0  # kB
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used (all its threads), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) S ppid ..." with comm possibly holding spaces: split after the last ')'.
    fields = stat.rpartition(")")[2].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (IndexError, ValueError):
        return None


class CpuMeter:
    """CPU seconds per named process between ``start()`` and ``stop()``."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self._pids = dict(pids)
        self._before: dict[str, float] = {}
        self._wall_start = 0.0
        self.used: dict[str, float] = {}
        self.wall_s = 0.0

    @property
    def names(self) -> list[str]:
        return list(self._pids)

    def start(self) -> None:
        self._wall_start = time.monotonic()
        self._before = {}
        for name, pid in self._pids.items():
            value = cpu_seconds(pid)
            if value is not None:
                self._before[name] = value

    def stop(self) -> None:
        self.wall_s = time.monotonic() - self._wall_start
        self.used = {}
        for name, before in self._before.items():
            after = cpu_seconds(self._pids[name])
            if after is not None:
                self.used[name] = after - before

    def total(self, prefix: str) -> tuple[float, list[str]]:
        """CPU seconds summed over the processes whose name starts with ``prefix``, and the
        names of those that could not be read at both ends (exited, or not ours to read)."""
        used = sum(v for name, v in self.used.items() if name.startswith(prefix))
        missing = [name for name in self._pids if name.startswith(prefix)
                   and name not in self.used]
        return used, missing

    def describe(self) -> str:
        """``"scheduler-0 12.1s (85%), etcd 3.0s (21%) ... over 14.2s"``, busiest first."""
        if not self.used:
            return "no process could be measured"
        wall = max(self.wall_s, 1e-9)
        parts = [
            f"{name} {used:.1f}s ({100 * used / wall:.0f}%)"
            for name, used in sorted(self.used.items(), key=lambda kv: -kv[1])
        ]
        return ", ".join(parts) + f" of CPU over {self.wall_s:.1f}s wall"


class Child:
    """A subprocess owned by the bench (own session, log file, stopped by PID)."""

    def __init__(self, name: str, argv: Sequence[str], *, env: Mapping[str, str], log: Path,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out, open(os.devnull, "rb") as devnull:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                list(argv),
                stdin=devnull,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def tail(self, limit: int = _TAIL_BYTES) -> str:
        """The end of the child's log, for failure messages."""
        try:
            with self.log.open("rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - limit))
                return fh.read().decode("utf-8", errors="replace")
        except OSError:
            return "(no log)"

    def terminate(self) -> None:
        """Send SIGTERM (no wait); see ``wait_or_kill``."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def wait_or_kill(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a terminated child to exit, then SIGKILL it."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait, SIGKILL; idempotent."""
        self.terminate()
        self.wait_or_kill(timeout)
