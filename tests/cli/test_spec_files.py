"""The spec files Go persysctl reads (scheduler and agent formats) parse and apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from proto.persys.control.v1 import control_pb2 as pb
from tests.cli.stack import DevStack, persys
from tests.fixtures.waiting import wait_for_sync

pytestmark = pytest.mark.timeout(300)

SPECS = Path(__file__).with_name("specs")


def _get(stack: DevStack, workload_id: str) -> pb.GetWorkloadResponse:
    channel, stub = stack.stub()
    with channel:
        return stub.GetWorkload(pb.GetWorkloadRequest(workload_id=workload_id), timeout=10)


@pytest.mark.parametrize(("name", "wtype"), [
    ("container-scheduler.json", "container"),
    ("container-agent.json", "container"),
    ("compose.json", "compose"),
    ("vm.json", "vm"),
])
def test_persysctl_spec_files_apply(stack: DevStack, name: str, wtype: str) -> None:
    workload_id = "ctl-" + name.split(".")[0]
    explained = persys("explain", "-f", str(SPECS / name), "--id", workload_id,
                       server=stack.server)
    assert explained.returncode == 0, explained.stderr
    assert "nodes fit" in explained.stdout
    done = persys("apply", "-f", str(SPECS / name), "--id", workload_id, server=stack.server)
    assert done.returncode == 0, done.stderr
    got = _get(stack, workload_id)
    assert got.workload.type == wtype
    assert got.workload.assigned_node_id
    wait_for_sync(lambda: _get(stack, workload_id).workload.status == "Running", timeout=60)


def test_agent_format_resources_and_restart_policy_are_kept(stack: DevStack) -> None:
    persys("apply", "-f", str(SPECS / "container-agent.json"), "--id", "ctl-agent-res",
           server=stack.server)
    spec = _get(stack, "ctl-agent-res").spec
    assert (spec.resources.cpu_millicores, spec.resources.memory_mb) == (500, 256)
    assert list(spec.container.command) == ["redis-server"]
    assert spec.container.restart_policy == "unless-stopped"


def test_scheduler_format_ports_and_volumes_are_kept(stack: DevStack) -> None:
    persys("apply", "-f", str(SPECS / "container-scheduler.json"), "--id", "ctl-ports",
           server=stack.server)
    spec = _get(stack, "ctl-ports").spec
    assert [(p.host_port, p.container_port) for p in spec.container.ports] == [(8081, 80)]
    assert [(v.host_path, v.read_only) for v in spec.container.volumes] == [("/srv/www", True)]


def test_a_persysctl_file_needs_an_id(stack: DevStack) -> None:
    done = persys("apply", "-f", str(SPECS / "compose.json"), server=stack.server)
    assert done.returncode == 2
    assert "--id" in done.stderr
