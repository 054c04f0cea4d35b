"""The README's run command: ``persys-scheduler dev`` brings up everything and stops it all."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import container_spec, control_stub
from tests.fixtures.waiting import wait_for, wait_for_sync

ROOT = Path(__file__).resolve().parent.parent


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=False).stdout
    return [int(p) for p in out.split()]


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.timeout(180)
async def test_dev_stack_runs_20_nodes_and_stops_everything(tmp_path):
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once; the test then only reads a line
        [sys.executable, "-m", "ops.cli", "dev", "--nodes", "20", "--grpc-port", "0",
         "--data-dir", str(tmp_path / "dev")],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "LOG_LEVEL": "warning"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("persys-scheduler dev: ready grpc="), (line, proc.poll())
        address = line.split("grpc=")[1].split()[0]
        children = _children(proc.pid)
        assert len(children) >= 2  # etcd and redis
        async with control_stub(address) as stub:
            async def twenty_ready():
                nodes = (await stub.ListNodes(pb.ListNodesRequest())).nodes
                return len([n for n in nodes if n.status == "Ready"]) == 20

            await wait_for(twenty_ready, timeout=30, message="20 Ready nodes")
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="dev-web", spec=container_spec()))
            assert resp.success, resp.error_message

            async def running():
                w = await stub.GetWorkload(pb.GetWorkloadRequest(workload_id="dev-web"))
                return w.workload.status == "Running"

            await wait_for(running, timeout=30, message="dev-web Running")

            async def events():
                r = await stub.ListEvents(pb.ListEventsRequest(limit=1000))
                return {"NodeJoined", "WorkloadScheduled"} <= {e.type for e in r.events}

            await wait_for(events, timeout=30, message="NodeJoined and WorkloadScheduled")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        for child in children:
            await wait_for(lambda c=child: _dead(c), timeout=10,
                           message=f"process {child} outlived the dev stack")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start_dev(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "dev", *args], cwd=ROOT, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LOG_LEVEL": "warning", **(env or {})})


def _ready_line(proc: subprocess.Popen[str]) -> dict[str, str]:
    """The addresses of the ready line (``grpc``, ``metrics``, ``etcd``, ``redis``)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("persys-scheduler dev: ready "):
        proc.kill()
        raise AssertionError(f"no ready line: {line!r}; exit {proc.wait()}; "
                             f"{proc.communicate()[1]}")
    return dict(word.split("=", 1) for word in line.split()[3:])


def _interrupt(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, err
    return err


def _stores_answer(addresses: dict[str, str]) -> None:
    with urllib.request.urlopen(f"http://{addresses['etcd']}/health", timeout=5) as resp:
        assert json.loads(resp.read())["health"] == "true"
    host, port = addresses["redis"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(64).startswith(b"+PONG")


@pytest.mark.timeout(180)
async def test_a_named_data_dir_is_used_again_with_the_same_addresses(tmp_path):
    # the etcd member in the directory advertises the peer URL of its first run: the second
    # run used to pick new ports, and the member check refused its own etcd
    data_dir = tmp_path / "dev"
    first = _start_dev("--nodes", "1", "--grpc-port", "0", "--data-dir", str(data_dir))
    try:
        addresses = _ready_line(first)
        # the ready line names etcd and Redis, for replay and confirm-empty-state
        assert set(addresses) == {"grpc", "metrics", "etcd", "redis"}
        _stores_answer(addresses)
        async with control_stub(addresses["grpc"]) as stub:
            resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="kept", spec=container_spec()))
            assert resp.success, resp.error_message
        _interrupt(first)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    second = _start_dev("--nodes", "1", "--grpc-port", "0", "--data-dir", str(data_dir))
    try:
        again = _ready_line(second)
        assert (again["etcd"], again["redis"]) == (addresses["etcd"], addresses["redis"])
        async with control_stub(again["grpc"]) as stub:
            kept = await stub.GetWorkload(pb.GetWorkloadRequest(workload_id="kept"))
            assert kept.workload.workload_id == "kept"
        assert "Traceback" not in _interrupt(second)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()


@pytest.mark.timeout(60)
def test_a_server_that_does_not_start_is_reported_without_a_traceback(tmp_path):
    proc = _start_dev("--nodes", "0", "--grpc-port", "0", "--data-dir", str(tmp_path / "dev"),
                      env={"PERSYS_ETCD_BIN": shutil.which("false") or "/bin/false"})
    err = proc.communicate(timeout=45)[1]
    assert proc.returncode == 1, err
    assert err.startswith("persys-scheduler dev: etcd ("), err
    assert "exited before it became healthy" in err
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_a_taken_grpc_port_suggests_picking_a_free_one(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _start_dev("--nodes", "0", "--grpc-port", str(port),
                          "--data-dir", str(tmp_path / "dev"))
        err = proc.communicate(timeout=45)[1]
    assert proc.returncode == 2, err
    assert (f"persys-scheduler dev: the gRPC server cannot listen on 127.0.0.1:{port}: port "
            f"{port} is in use by another process; pass --grpc-port 0 to pick a free port"
            in err)
    assert "Traceback" not in err


def _loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_ctrl_c_while_dev_imports_its_modules_ends_without_a_traceback():
    # a terminal's Ctrl-C reaches a process whose SIGINT is at its default; a test runner in
    # the background may have it ignored, which its children would inherit
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = _start_dev("--nodes", "0", "--grpc-port", "0")
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        # grpc's extension is loaded by the first of the command's own imports, a second or
        # so before it has anything running or a signal handler of its own
        wait_for_sync(lambda: _loaded(proc.pid, "cygrpc") or proc.poll() is not None,
                      timeout=30, interval=0.005, message="dev importing grpc")
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=30)[1]
        assert proc.returncode == 130, err
        assert err.endswith("persys-scheduler: interrupted\n"), err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
