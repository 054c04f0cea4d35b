"""A private CoreDNS with the etcd plugin, for the per-replica DNS records test and dev use.

CoreDNS is not packaged by Debian or PyPI; it is built once from the Go module proxy
(``ops/coredns.py --build`` or ``.ci/run``) into ``.cache/bin/coredns``. The Corefile serves only
the scheduler's zone from the given etcd, binds loopback, and forwards nothing anywhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COREDNS_VERSION = "v1.12.2"
CACHE_BIN = ROOT / ".cache" / "bin"


def find_coredns_binary() -> str | None:
    explicit = os.environ.get("PERSYS_COREDNS_BIN")
    if explicit:
        return explicit
    cached = CACHE_BIN / "coredns"
    if cached.exists():
        return str(cached)
    return shutil.which("coredns")


def build_coredns(timeout: float = 1800.0) -> str:
    """``go install`` CoreDNS into .cache/bin; returns the binary path."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    CACHE_BIN.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOBIN": str(CACHE_BIN), "GOFLAGS": "-mod=mod"}
    subprocess.run([go, "install", f"github.com/coredns/coredns@{COREDNS_VERSION}"],
                   check=True, env=env, timeout=timeout)
    return str(CACHE_BIN / "coredns")


def _free_udp_tcp_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


class CoreDnsProcess:
    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, work_dir: Path, *, zone: str, etcd_url: str, path: str = "/skydns",
              timeout: float = 15.0) -> CoreDnsProcess:
        work_dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_udp_tcp_port()
        corefile = work_dir / "Corefile"
        corefile.write_text(
            f"{zone}:{self.port} {{\n    bind 127.0.0.1\n    etcd {{\n        path {path}\n"
            f"        endpoint {etcd_url}\n    }}\n    errors\n}}\n")
        log = (work_dir / "coredns.log").open("ab")
        self.proc = subprocess.Popen([self.binary, "-conf", str(corefile)], cwd=work_dir,
                                     stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coredns exited: {(work_dir / 'coredns.log').read_text()}")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.2)
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("coredns did not start listening")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


if __name__ == "__main__":
    if "--build" in sys.argv:
        print(build_coredns())
    else:
        print(find_coredns_binary() or "not built: python -m ops.coredns --build")
