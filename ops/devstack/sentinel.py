"""A private Redis Sentinel: ``redis-server <conf> --sentinel`` from the same binary as Redis.

Why apart from ``ops.devstack.redis``: a Sentinel is started from a configuration file it
rewrites itself (it records the replicas, the other Sentinels and every failover there), so its
flags cannot be passed on the command line the way a Redis server's are; everything else (the
binary, the PING probe, the log files, signals by PID) is the Redis server's, which this class
inherits. Tests that fail a master over start a master, its replicas (``RedisProcess`` with
``--replicaof``) and three of these on free loopback ports.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ops.devstack.redis import RedisProcess


class SentinelProcess(RedisProcess):
    """A private ``redis-server --sentinel`` on 127.0.0.1 monitoring one master.

    ``down_after_ms`` and ``failover_timeout_ms`` are Sentinel's own settings of the same names
    (how long a master may be silent before it is subjectively down, and the bound of one
    failover); tests shorten them to fail over within seconds.
    """

    _kind = "redis-sentinel"

    def __init__(
        self,
        master_name: str,
        master_host: str,
        master_port: int,
        *,
        binary: str | None = None,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        parallel_syncs: int = 1,
        master_password: str = "",
        password: str = "",
        extra_lines: Sequence[str] = (),
        stop_timeout: float = 10.0,
    ) -> None:
        super().__init__(binary, stop_timeout=stop_timeout)
        self.master_name = master_name
        self.master_host = master_host
        self.master_port = master_port
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.parallel_syncs = parallel_syncs
        self.master_password = master_password
        #: ``requirepass`` of the Sentinel itself (clients: ``REDIS_SENTINEL_PASSWORD``)
        self.password = password
        self.extra_lines = tuple(extra_lines)
        self._written_port = 0

    @property
    def config_path(self) -> Path:
        assert self.data_dir is not None, "not started"
        return self.data_dir / "sentinel.conf"

    def _config(self) -> str:
        name = self.master_name
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            "daemonize no",
            "protected-mode no",
            f"dir {self.data_dir}",
            f"logfile {self.log_path}",
            f"sentinel monitor {name} {self.master_host} {self.master_port} {self.quorum}",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {name} {self.parallel_syncs}",
        ]
        if self.master_password:
            lines.append(f"sentinel auth-pass {name} {self.master_password}")
        if self.password:
            # its own password, and the one it gives the other Sentinels (the same)
            lines += [f"requirepass {self.password}", f"sentinel sentinel-pass {self.password}"]
        lines.extend(self.extra_lines)
        return "\n".join(lines) + "\n"

    def _args(self) -> list[str]:
        # written for each new port (a start retried on another port); a restart on the same
        # port keeps the file, with what the Sentinel wrote there (replicas, peers, failovers)
        if self._written_port != self.port:
            self.config_path.write_text(self._config())
            self._written_port = self.port
        return [str(self.config_path), "--sentinel"]

    def _pong(self) -> bool:
        if not self.password:
            return super()._pong()
        try:
            reply = self._command("AUTH", self.password)
        except (OSError, ValueError):
            return False
        # a fresh connection per command: AUTH answers +OK when the Sentinel is up
        return reply.startswith(b"+OK")

    def _server_pid(self) -> int | None:
        if self.password:
            return self.pid  # INFO needs AUTH on the same connection; the port check suffices
        return super()._server_pid()
