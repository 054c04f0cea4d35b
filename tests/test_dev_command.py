"""The README's run command: ``persys-scheduler dev`` brings up everything and stops it all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import container_spec, control_stub
from tests.fixtures.waiting import wait_for

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
