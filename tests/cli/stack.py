"""The real dev stack (``persys-scheduler dev``) in a subprocess, and the ``persys`` executable.

Why a subprocess for both: the CLI is tested as an operator runs it, against the stack the
README starts (etcd, Redis, the scheduler, a simulated fleet), and the stack can be stopped and
started again on the same ports and data (``--data-dir``) to test what a restart does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from proto.persys.control.v1 import control_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
PERSYS = Path(sys.executable).with_name("persys")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DevStack:
    data_dir: Path
    nodes: int = 4
    grpc_port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[str] | None = None
    addresses: dict[str, str] = field(default_factory=dict)

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "dev", "--nodes", str(self.nodes),
             "--grpc-port", str(self.grpc_port), "--data-dir", str(self.data_dir)],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "LOG_LEVEL": "warning", **self.env})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("persys-scheduler dev: ready grpc="), (line, self.proc.poll())
        self.addresses = dict(part.split("=", 1) for part in line.split()[3:])

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def stub(self) -> tuple[grpc.Channel, control_pb2_grpc.AgentControlStub]:
        channel = grpc.insecure_channel(self.server)
        return channel, control_pb2_grpc.AgentControlStub(channel)


def persys(*args: str, server: str | None = None, stdin: str | None = None,
           env: dict[str, str] | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the ``persys`` executable; the config file is kept out of the user's home."""
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    full_env.setdefault("PERSYS_CONFIG", os.devnull)
    if server is not None:
        full_env["PERSYS_SERVER"] = server
    return subprocess.run([str(PERSYS), *args], input=stdin, capture_output=True, text=True,
                          env=full_env, timeout=timeout, check=False)


async def persys_async(*args: str, env: dict[str, str] | None = None,
                       timeout: float = 60) -> tuple[int, str, str]:
    """``persys`` run without blocking the event loop (for a scheduler in the test's process)."""
    proc = await asyncio.create_subprocess_exec(
        str(PERSYS), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PERSYS_CONFIG": os.devnull, "NO_COLOR": "1", **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def persys_json(*args: str, server: str) -> Any:
    done = persys(*args, "-o", "json", server=server)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return json.loads(done.stdout)
