"""A private Jaeger (v2, in-memory storage), the trace backend of the tracing tests and of
``persys-scheduler bench --trace-endpoint jaeger``.

Jaeger is not packaged by Debian or PyPI; it is built once from its Go module
(``github.com/jaegertracing/jaeger/cmd/jaeger``, ``JAEGER_VERSION``) into
``.cache/bin/jaeger`` by ``python -m ops.jaeger --build`` (``ops/test.sh`` does it when the
binary is missing). Its ``go.mod`` has a ``replace`` directive, which ``go install pkg@version``
refuses, so the module is fetched from the Go module proxy (``go mod download``) and built
inside its own directory, as its main module. Expect minutes on two cores.

The process binds loopback only: the OTLP/HTTP receiver (``traces_url``) and the query
service (``/api/services``, ``/api/traces/<id>``: the HTTP API the Jaeger UI itself uses) on
free ports, plus the query service's gRPC port; nothing else listens, nothing is persisted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ops.devstack.process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
JAEGER_MODULE = "github.com/jaegertracing/jaeger"
JAEGER_VERSION = "v1.75.0"
CACHE_BIN = ROOT / ".cache" / "bin"
HOST = "127.0.0.1"


def find_jaeger_binary() -> str | None:
    explicit = os.environ.get("PERSYS_JAEGER_BIN")
    if explicit:
        return explicit
    cached = CACHE_BIN / "jaeger"
    if cached.exists():
        return str(cached)
    return None


def _go() -> str:
    return shutil.which("go") or "/usr/local/go/bin/go"


def build_jaeger(timeout: float = 3600.0) -> str:
    """Fetch the Jaeger module from the Go module proxy and build ``cmd/jaeger`` into
    .cache/bin; returns the binary path."""
    go = _go()
    env = {**os.environ, "GOTOOLCHAIN": os.environ.get("GOTOOLCHAIN", "local")}
    fetched = subprocess.run([go, "mod", "download", "-json", f"{JAEGER_MODULE}@{JAEGER_VERSION}"],
                             check=True, env=env, timeout=timeout, capture_output=True)
    source = json.loads(fetched.stdout)["Dir"]
    CACHE_BIN.mkdir(parents=True, exist_ok=True)
    target = CACHE_BIN / "jaeger"
    partial = CACHE_BIN / "jaeger.partial"
    # the module cache is read-only; the build writes only its output and Go's build cache
    subprocess.run([go, "build", "-mod=readonly", "-o", str(partial), "./cmd/jaeger"],
                   check=True, cwd=source, env=env, timeout=timeout)
    partial.replace(target)
    return str(target)


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((HOST, 0))
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def config_yaml(*, otlp_port: int, query_port: int, query_grpc_port: int,
                health_port: int) -> str:
    """Jaeger v2's configuration: OTLP/HTTP in, memory storage, the query API out."""
    return f"""\
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    logs:
      level: warn
    metrics:
      level: none

extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: {HOST}:{health_port}
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
  jaeger_query:
    # its own spans would go to an OTLP gRPC collector on localhost:4317 (whoever listens)
    enable_tracing: false
    storage:
      traces: memstore
    http:
      endpoint: {HOST}:{query_port}
    grpc:
      endpoint: {HOST}:{query_grpc_port}

receivers:
  otlp:
    protocols:
      http:
        endpoint: {HOST}:{otlp_port}

processors:
  batch:
    timeout: 50ms

exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


class JaegerProcess(ServerProcess):
    """One Jaeger v2 process on loopback ports of its own (spawned, stopped and killed as the
    dev stack's servers are)."""

    _kind = "jaeger"

    def __init__(self, binary: str) -> None:
        super().__init__(binary, stop_timeout=10.0)
        self.otlp_port = 0
        self.query_port = 0

    def _log_paths(self) -> tuple[Path, ...]:
        return (self.data_dir / "jaeger.log",) if self.data_dir is not None else ()

    @property
    def otlp_endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT is set to (the Go form: host:port)."""
        return f"{HOST}:{self.otlp_port}"

    @property
    def traces_url(self) -> str:
        return f"http://{HOST}:{self.otlp_port}/v1/traces"

    @property
    def query_url(self) -> str:
        return f"http://{HOST}:{self.query_port}"

    def start(self, work_dir: Path, *, timeout: float = 30.0) -> JaegerProcess:
        work_dir.mkdir(parents=True, exist_ok=True)
        self.otlp_port, self.query_port, grpc_port, health_port = _free_ports(4)
        config = work_dir / "jaeger.yaml"
        config.write_text(config_yaml(otlp_port=self.otlp_port, query_port=self.query_port,
                                      query_grpc_port=grpc_port, health_port=health_port))
        self.data_dir = work_dir
        self._spawn([f"--config=file:{config}"], log_path=work_dir / "jaeger.log",
                    env=dict(os.environ))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._exited_early():
                raise RuntimeError(f"jaeger exited: {self.log_tail()}")
            if self._serving():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"jaeger did not start serving: {self.log_tail()}")

    def _serving(self) -> bool:
        try:
            self.services()
        except OSError:
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.2)
            return probe.connect_ex((HOST, self.otlp_port)) == 0

    # -- the query API (blocking: call it from a thread in async code) -------------------------

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(self.query_url + path, timeout=5) as answer:
            return json.loads(answer.read())

    def services(self) -> list[str]:
        """The service names Jaeger has spans of."""
        return list(self._get("/api/services").get("data") or [])

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """The trace (Jaeger's JSON: ``spans``, ``processes``), or None while it has none."""
        try:
            data = self._get(f"/api/traces/{trace_id}").get("data") or []
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return data[0] if data else None

    def traces(self, service: str, operation: str = "", limit: int = 100) -> list[Any]:
        query = f"/api/traces?service={service}&limit={limit}&lookback=1h"
        if operation:
            query += f"&operation={urllib.parse.quote(operation, safe='')}"
        return list(self._get(query).get("data") or [])


def main(argv: list[str]) -> int:
    if "--build" in argv:
        print(build_jaeger())
        return 0
    binary = find_jaeger_binary()
    if binary is None:
        print("not built: python -m ops.jaeger --build")
        return 1
    if "--serve" in argv:  # a Jaeger for a manual run; Ctrl-C stops it
        proc = JaegerProcess(binary).start(ROOT / ".cache" / "jaeger-run")
        print(f"OTEL_EXPORTER_OTLP_ENDPOINT={proc.otlp_endpoint}  UI/API: {proc.query_url}",
              flush=True)
        try:
            while proc.is_running():
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        finally:
            proc.stop()
        return 0
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
