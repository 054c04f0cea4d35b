"""How a replica starts and refuses to: settings, listeners, an unreachable etcd, signals.

The README promises that an invalid value stops the start with a message naming the variable;
these tests hold ``serve`` to it as an operator meets it (a subprocess, its exit status and
its stderr), with real etcd where the start gets that far.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from handlers.settings.config import load_settings
from handlers.settings.reader import ConfigError
from ops.cli import run_replica
from ops.devstack.etcd import EtcdProcess
from ops.devstack.etcdapi import etcd_revision
from ops.devstack.process import free_port

ROOT = Path(__file__).resolve().parent.parent


def serve(env: dict[str, str], *, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``persys-scheduler -insecure`` with ``env`` over a clean environment; until it exits."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SCHEDULER_", "ETCD_", "PERSYS_", "LOG_", "GRPC_", "METRICS_"))}
    return subprocess.run([sys.executable, "-m", "ops.cli", "-insecure"], cwd=ROOT,
                          env={**base, **env}, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_log_settings_take_the_go_names_and_refuse_anything_else() -> None:
    assert (load_settings({}).log_level, load_settings({}).log_format) == ("info", "json")
    assert load_settings({"LOG_LEVEL": "WARN", "LOG_FORMAT": "Text"}).log_level == "warning"
    assert load_settings({"LOG_LEVEL": "trace"}).log_level == "debug"
    assert load_settings({"LOG_LEVEL": "fatal"}).log_level == "critical"
    assert load_settings({"LOG_FORMAT": "text"}).log_format == "text"
    with pytest.raises(ConfigError, match="LOG_LEVEL: 'loud' is not one of"):
        load_settings({"LOG_LEVEL": "loud"})
    with pytest.raises(ConfigError, match="LOG_FORMAT: 'xml' is not"):
        load_settings({"LOG_FORMAT": "xml"})


@pytest.mark.parametrize(("name", "value"), [("LOG_LEVEL", "loud"), ("LOG_FORMAT", "xml")])
def test_serve_refuses_an_invalid_log_setting(name: str, value: str) -> None:
    # etcd is never asked: the settings are refused first
    done = serve({name: value, "ETCD_ENDPOINTS": "127.0.0.1:1"}, timeout=30)
    assert done.returncode == 2, done.stderr
    assert f"invalid configuration: {name}: {value!r}" in done.stderr
    assert "Traceback" not in done.stderr


def unreachable_etcd_env() -> dict[str, str]:
    return {"ETCD_ENDPOINTS": f"127.0.0.1:{free_port()}", "GRPC_PORT": str(free_port()),
            "METRICS_PORT": "0", "PERSYS_GRPC_ADDR": "127.0.0.1", "LOG_FORMAT": "text",
            "LOG_LEVEL": "info"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_stop_signal_ends_a_start_that_waits_for_etcd(signum: int) -> None:
    # etcd does not answer, so the start waits for the projections (60 s); it used to sit
    # that out, signals or not, and then end in a TimeoutError traceback
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SCHEDULER_", "ETCD_"))}
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "-insecure"], cwd=ROOT,
                            env={**base, **unreachable_etcd_env()}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # blocks until the replica found etcd unreachable
            seen.append(line)
            if "to=degraded" in line:
                break
        assert proc.poll() is None, "".join(seen)
        proc.send_signal(signum)
        rest = proc.communicate(timeout=15)[1]
        assert proc.returncode == 0, rest
        assert "Traceback" not in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_start_that_times_out_names_the_etcd_it_waited_for(
        capsys: pytest.CaptureFixture[str]) -> None:
    env = unreachable_etcd_env()
    settings = load_settings(env, insecure=True)
    status = await run_replica(settings, asyncio.Event(), ready_timeout=1.0)
    err = capsys.readouterr().err
    assert status == 1, err
    assert (f"persys-scheduler: not started: the cluster state did not load from etcd at "
            f"{env['ETCD_ENDPOINTS']} (ETCD_ENDPOINTS) within 1s: etcd unreachable") in err


@contextmanager
def port_taken(holder: str) -> Iterator[int]:
    """A loopback port something else listens on: a plain socket, or a grpc server (which,
    like every grpc server by default, sets SO_REUSEPORT)."""
    if holder == "socket":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            yield sock.getsockname()[1]
        return
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    try:
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        yield port
    finally:
        server.stop(None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("holder", ["socket", "grpc"])
def test_a_taken_grpc_port_stops_the_start_before_etcd_is_touched(
        holder: str, etcd_private: EtcdProcess) -> None:
    # the listeners are opened first: no election, no mode marker, nothing written to etcd;
    # with grpc's default SO_REUSEPORT a second scheduler on the port of a running one (a
    # grpc server) used to bind it as well and share its connections
    before = etcd_revision(etcd_private.url)
    with port_taken(holder) as port:
        done = serve({"ETCD_ENDPOINTS": etcd_private.endpoint, "GRPC_PORT": str(port),
                      "METRICS_PORT": "0", "PERSYS_GRPC_ADDR": "127.0.0.1"}, timeout=30)
    assert done.returncode == 2, done.stderr
    assert (f"persys-scheduler: invalid configuration: GRPC_PORT: the gRPC server cannot "
            f"listen on 127.0.0.1:{port}: port {port} is in use by another process"
            in done.stderr)
    assert "Traceback" not in done.stderr
    assert etcd_revision(etcd_private.url) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "value", "why"), [
    ("PERSYS_GRPC_ADDR", "999.1.1.1", "the gRPC server cannot listen on 999.1.1.1:{grpc}: "
                                      "'999.1.1.1' is not an address"),
    ("SCHEDULER_METRICS_ADDR", "nope.invalid", "the metrics endpoint cannot listen on "
                                               "nope.invalid:0: 'nope.invalid' is not an "
                                               "address"),
    ("METRICS_PORT", "{taken}", "the metrics endpoint cannot listen on 127.0.0.1:{taken}: "
                                "port {taken} is in use by another process"),
])
def test_an_address_that_cannot_be_listened_on_is_named(name: str, value: str,
                                                        why: str) -> None:
    # etcd does not answer, so a start that got as far as etcd would wait there for a minute
    env = unreachable_etcd_env()
    with port_taken("socket") as taken:
        env[name] = value.format(taken=taken)
        done = serve(env, timeout=30)
    assert done.returncode == 2, done.stderr
    expected = why.format(taken=taken, grpc=env["GRPC_PORT"])
    assert f"persys-scheduler: invalid configuration: {name}: {expected}" in done.stderr
    assert "Traceback" not in done.stderr
