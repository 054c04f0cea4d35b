"""Every ``persys`` command, run as an executable against the real dev stack.

JSON outputs are parsed and checked against what the gRPC API answers itself.
"""

from __future__ import annotations

import json

import grpc
import pytest
import yaml

from proto.persys.control.v1 import control_pb2 as pb
from tests.cli.stack import DevStack, persys, persys_json
from tests.fixtures.waiting import wait_for_sync

pytestmark = pytest.mark.timeout(300)

WEB = """\
workload_id: cli-web
desired_state: Running
spec:
  type: container
  resources: {cpu_millicores: 500, memory_mb: 256}
  container:
    image: nginx:1.27
    ports: [{host_port: 8080, container_port: 80}]
    env: {MODE: prod}
---
workload_id: cli-api
spec:
  type: container
  resources: {cpu_millicores: 250, memory_mb: 128}
  container: {image: nginx:1.27}
"""


def _get(stack: DevStack, workload_id: str) -> pb.GetWorkloadResponse:
    channel, stub = stack.stub()
    with channel:
        return stub.GetWorkload(pb.GetWorkloadRequest(workload_id=workload_id), timeout=10)


def _status(stack: DevStack, workload_id: str) -> str:
    return _get(stack, workload_id).workload.status


def test_nodes_and_node_match_list_nodes(stack: DevStack) -> None:
    shown = persys_json("nodes", server=stack.server)["nodes"]
    channel, stub = stack.stub()
    with channel:
        listed = stub.ListNodes(pb.ListNodesRequest(), timeout=10).nodes
    assert {n["node_id"]: n["status"] for n in shown} == {n.node_id: n.status for n in listed}
    for n, view in zip(sorted(shown, key=lambda n: n["node_id"]),
                       sorted(listed, key=lambda n: n.node_id), strict=True):
        assert n["total_cpu_cores"] == view.total_cpu_cores
        assert n["total_memory_mb"] == view.total_memory_mb  # a number, not a string
        assert n["grpc_endpoint"] == view.grpc_endpoint
    table = persys("nodes", server=stack.server)
    assert table.returncode == 0
    assert all(n.node_id in table.stdout for n in listed)
    wide = persys("nodes", "-o", "wide", server=stack.server).stdout
    assert "ENDPOINT" in wide
    assert listed[0].grpc_endpoint in wide
    one = persys_json("node", listed[0].node_id, server=stack.server)
    assert one["node"]["node_id"] == listed[0].node_id
    missing = persys("node", "no-such-node", server=stack.server)
    assert missing.returncode == 1
    assert "NOT_FOUND" in missing.stderr


def test_apply_shows_where_and_why_and_prints_an_appliable_spec(stack: DevStack) -> None:
    done = persys("apply", "-f", "-", stdin=WEB, server=stack.server)
    assert done.returncode == 0, done.stderr
    assert "workload cli-web applied" in done.stdout
    wait_for_sync(lambda: _status(stack, "cli-web") == "Running", timeout=30)
    got = _get(stack, "cli-web")
    described = persys_json("workload", "cli-web", server=stack.server)
    view = described["status"]["workload"]
    assert view["assigned_node_id"] == got.workload.assigned_node_id
    assert view["revision_id"] == got.workload.revision_id
    assert described["spec"]["container"]["image"] == "nginx:1.27"
    assert described["status"]["placement"]["assigned_node_id"] == got.workload.assigned_node_id
    assert {e["type"] for e in described["status"]["events"]} >= {"WorkloadScheduled"}
    listed = persys_json("workloads", server=stack.server)["workloads"]
    assert {"cli-web", "cli-api"} <= {w["workload_id"] for w in listed}
    by_node = persys_json("workloads", "--node", got.workload.assigned_node_id,
                          server=stack.server)["workloads"]
    assert all(w["assigned_node_id"] == got.workload.assigned_node_id for w in by_node)
    assert persys_json("workloads", "--type", "vm", server=stack.server)["workloads"] == []
    # the YAML form applies again unchanged (same revision), and edited (a new one)
    printed = persys("workload", "cli-web", "-o", "yaml", server=stack.server).stdout
    again = persys("apply", "-f", "-", stdin=printed, server=stack.server)
    assert again.returncode == 0, again.stderr
    assert _get(stack, "cli-web").workload.revision_id == got.workload.revision_id
    edited = yaml.safe_load(printed)
    edited["spec"]["container"]["image"] = "nginx:1.28"
    changed = persys("apply", "-f", "-", stdin=yaml.safe_dump(edited), server=stack.server)
    assert changed.returncode == 0, changed.stderr
    assert _get(stack, "cli-web").workload.revision_id != got.workload.revision_id
    human = persys("workload", "cli-web", server=stack.server).stdout
    assert "Placement:" in human
    assert got.workload.assigned_node_id in human


def test_dry_run_says_where_and_stores_nothing(stack: DevStack) -> None:
    spec = "workload_id: cli-dry\nspec: {type: container, container: {image: busybox}}\n"
    done = persys("apply", "--dry-run", "-f", "-", stdin=spec, server=stack.server)
    assert done.returncode == 0, done.stderr
    assert "would go to node" in done.stdout
    assert "nothing stored" in done.stdout
    with pytest.raises(grpc.RpcError) as caught:
        _get(stack, "cli-dry")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_explain_counts_refusals_by_reason(stack: DevStack) -> None:
    huge = ("workload_id: cli-huge\nspec: {type: container, resources: {cpu_millicores: "
            "999000}, container: {image: busybox}}\n")
    done = persys("explain", "-f", "-", stdin=huge, server=stack.server)
    assert done.returncode == 0, done.stderr
    assert f"0/{stack.nodes} nodes fit: {stack.nodes} insufficient cpu" in done.stdout
    answer = json.loads(
        persys("explain", "-f", "-", "-o", "json", stdin=huge, server=stack.server).stdout)
    assert answer["nodes_fit"] == 0
    assert answer["chosen_node_id"] == ""
    assert answer["refusals"] == [{"reason": "insufficient cpu", "nodes": stack.nodes}]
    assert len(answer["refusal_sample"]) == stack.nodes
    dry = persys("apply", "--dry-run", "-f", "-", stdin=huge, server=stack.server)
    assert "fits nowhere: 0/" in dry.stdout
    stored = persys("apply", "-f", "-", stdin=huge, server=stack.server)
    assert stored.returncode == 0, stored.stderr
    assert stored.stdout.startswith("workload cli-huge pending: no suitable node: 0/")
    shown = persys_json("workload", "cli-huge", server=stack.server)["status"]["workload"]
    assert shown["status"] == "Pending"
    assert shown["reason"]["code"] == "Unschedulable"
    assert persys("delete", "cli-huge", server=stack.server).returncode == 0
    persys("apply", "-f", "-", stdin=WEB, server=stack.server)
    placed = persys_json("explain", "cli-api", server=stack.server)
    assert placed["assigned_node_id"] == _get(stack, "cli-api").workload.assigned_node_id
    assert placed["nodes_fit"] == stack.nodes
    parts = placed["candidates"][0]
    assert {"cpu_headroom", "memory_headroom", "spread", "tie_break"} <= set(parts)
    unknown = persys("explain", "no-such-workload", server=stack.server)
    assert unknown.returncode == 1
    assert "NOT_FOUND" in unknown.stderr


def test_stop_start_retry_delete(stack: DevStack) -> None:
    persys("apply", "-f", "-", stdin=WEB, server=stack.server)
    assert persys("stop", "cli-api", server=stack.server).returncode == 0
    assert _get(stack, "cli-api").workload.desired_state == "Stopped"
    assert persys("start", "cli-api", server=stack.server).returncode == 0
    assert _get(stack, "cli-api").workload.desired_state == "Running"
    assert persys("retry", "cli-api", server=stack.server).returncode == 0
    gone = persys("retry", "no-such-workload", server=stack.server)
    assert gone.returncode == 1
    done = persys("delete", "cli-api", server=stack.server)
    assert done.returncode == 0
    assert "cli-api deleted" in done.stdout

    def deleted() -> bool:
        try:
            return _get(stack, "cli-api").workload.desired_state == "Deleted"
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.NOT_FOUND

    wait_for_sync(deleted, timeout=30)


def test_node_controls(stack: DevStack) -> None:
    channel, stub = stack.stub()
    with channel:
        def node(node_id: str) -> pb.NodeView:
            return stub.GetNode(pb.GetNodeRequest(node_id=node_id), timeout=10).node

        persys("apply", "-f", "-", stdin=WEB, server=stack.server)
        target = _get(stack, "cli-web").workload.assigned_node_id
        assert persys("taint", target, "gpu=yes:NoSchedule", server=stack.server).returncode == 0
        assert [(t.key, t.value, t.effect) for t in node(target).taints] == [
            ("gpu", "yes", "NoSchedule")]
        assert persys("untaint", target, "gpu:NoSchedule", server=stack.server).returncode == 0
        assert list(node(target).taints) == []
        assert persys("label", target, "zone=a", "rack=7", server=stack.server).returncode == 0
        assert {"zone": "a", "rack": "7"}.items() <= dict(node(target).labels).items()
        assert persys("label", target, "zone-", server=stack.server).returncode == 0
        assert "zone" not in node(target).labels
        bad = persys("taint", target, "gpu=yes:Sometimes", server=stack.server)
        assert bad.returncode == 2
        assert "Effect" in bad.stderr
        drained = persys("drain", target, "--wait", server=stack.server)
        assert drained.returncode == 0, drained.stderr
        assert f"node {target} drained: " in drained.stdout
        assert node(target).status == "Draining"
        assert _get(stack, "cli-web").workload.assigned_node_id != target
        assert persys("undrain", target, server=stack.server).returncode == 0
        assert node(target).status == "Ready"


def test_summary_matches_get_cluster_summary(stack: DevStack) -> None:
    shown = persys_json("summary", server=stack.server)
    channel, stub = stack.stub()
    with channel:
        summary = stub.GetClusterSummary(pb.GetClusterSummaryRequest(), timeout=10)
    assert shown["total_nodes"] == summary.total_nodes == stack.nodes
    assert shown["ready_nodes"] == summary.ready_nodes


def test_events_list_filters_and_cursor(stack: DevStack) -> None:
    persys("apply", "-f", "-", stdin=WEB, server=stack.server)
    joined = persys_json("events", "--type", "NodeJoined", server=stack.server)["events"]
    assert len(joined) == stack.nodes
    assert {e["type"] for e in joined} == {"NodeJoined"}
    first = joined[0]
    after = persys_json("events", "--after", first["id"], "--type", "NodeJoined",
                        server=stack.server)["events"]
    assert [e["id"] for e in after] == [e["id"] for e in joined[1:]]
    node_id = first["node_id"]
    mine = persys_json("events", "--node", node_id, server=stack.server)["events"]
    assert mine
    assert all(e["node_id"] == node_id or e["type"] == "EventsGap" for e in mine)
    table = persys("events", "--workload", "cli-web", server=stack.server).stdout
    assert "WorkloadScheduled" in table


def test_disks(stack: DevStack) -> None:
    node_id = persys_json("nodes", server=stack.server)["nodes"][0]["node_id"]
    made = persys_json("disks", "create", "cli-disk", "--size-gb", "5", "--node", node_id,
                       server=stack.server)
    assert made["name"] == "cli-disk"
    assert made["size_gb"] == 5
    listed = persys_json("disks", "list", server=stack.server)["disks"]
    assert made["id"] in {d["id"] for d in listed}
    assert persys_json("disks", "get", made["id"], server=stack.server)["id"] == made["id"]
    assert persys("disks", "delete", made["id"], server=stack.server).returncode == 0
    assert persys("disks", "get", made["id"], server=stack.server).returncode == 1


def test_buckets_without_rgw_are_refused_with_the_reason(stack: DevStack) -> None:
    done = persys("buckets", "list", server=stack.server)
    assert done.returncode == 1
    assert "FAILED_PRECONDITION" in done.stderr
    assert "Traceback" not in done.stderr


def test_unreachable_server_exits_3_naming_it() -> None:
    done = persys("nodes", server="127.0.0.1:1")
    assert done.returncode == 3
    assert "cannot reach the scheduler at 127.0.0.1:1" in done.stderr
    assert "Traceback" not in done.stderr


def test_malformed_file_exits_2_naming_the_line(stack: DevStack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.yaml"
    bad.write_text("workload_id: x\nspec:\n  type: container\n  container: {image: [\n")
    done = persys("apply", "-f", str(bad), server=stack.server)
    assert done.returncode == 2
    assert f"{bad}:5" in done.stderr or f"{bad}:4" in done.stderr
    unknown = persys("apply", "-f", "-", stdin="workload_id: x\nspec: {colour: red}\n",
                     server=stack.server)
    assert unknown.returncode == 2
    assert "<stdin>:1" in unknown.stderr
    assert "colour" in unknown.stderr
    second = persys("apply", "-f", "-", stdin=WEB + "---\n- just a list\n", server=stack.server)
    assert second.returncode == 2
    assert "<stdin>:17" in second.stderr
    usage = persys("nodes", "--bogus", server=stack.server)
    assert usage.returncode == 2


def test_refused_apply_exits_1_with_the_reason(stack: DevStack) -> None:
    done = persys("apply", "-f", "-", stdin="workload_id: x y\nspec: {type: container, "
                  "container: {image: busybox}}\n", server=stack.server)
    assert done.returncode == 1
    assert "INVALID_SPEC" in done.stderr
    assert "workload_id" in done.stderr


def test_contexts_pick_the_server(stack: DevStack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {"PERSYS_CONFIG": str(tmp_path / "config.yaml")}
    assert persys("config", "set-context", "dev", "--server", stack.server, "--insecure",
                  env=env).returncode == 0
    assert persys("config", "set-context", "nowhere", "--server", "127.0.0.1:1",
                  env=env).returncode == 0
    assert persys("config", "use", "dev", env=env).returncode == 0
    env_without_server = {**env, "PERSYS_SERVER": ""}
    assert persys("summary", env=env_without_server).returncode == 0
    assert persys("--context", "nowhere", "summary", env=env_without_server).returncode == 3
    view = json.loads(persys("config", "view", "-o", "json", env=env).stdout)
    assert view["current-context"] == "dev"
    assert set(view["contexts"]) == {"dev", "nowhere"}
    assert persys("config", "use", "missing", env=env).returncode == 2


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_shell_completion(shell: str) -> None:
    done = persys("completion", shell)
    assert done.returncode == 0
    assert "_PERSYS_COMPLETE" in done.stdout
