"""The agent's ``WorkloadStatus.metadata`` reaches the workload's status record
(docs/compatibility.md, "Workload status metadata"): a VM's ``vm.primary_ip`` shows in its
status, and an agent-reported non-retryable ``failure_reason`` halts re-applies at once.

Real etcd and Redis, a simulated agent whose statuses are given metadata by the test.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from handlers.workloads.metadata import (
    AGENT_KEYS_MAX,
    METADATA_MAX_KEYS,
    VALUE_BYTES,
    agent_metadata,
    merge_metadata,
    metadata_news,
)
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    container_spec,
    leading_fleet,
    make_settings,
)
from tests.fixtures.waiting import wait_for

# -- what of a report is kept (pure) ----------------------------------------------------------

def test_a_report_is_bounded_and_keeps_out_the_schedulers_own_keys() -> None:
    raw = {f"k{i:03d}": "v" for i in range(100)}
    raw.update({"task_id": "apply-1", "task_status": "pending", "last_action": "x",
                "lastApplyRequestAt": "x", "persys.vm.password": "secret",
                "Persys.Scheduling.allow_move": "true", "x" * 200: "long key",
                "container.stderr": "e" * 5000})
    kept = agent_metadata(raw)
    assert len(kept) == AGENT_KEYS_MAX
    assert kept["container.stderr"] == "e" * VALUE_BYTES
    assert not {"task_id", "task_status", "last_action", "lastApplyRequestAt",
                "persys.vm.password", "Persys.Scheduling.allow_move"} & set(kept)
    assert all(len(k) <= 128 for k in kept)
    assert agent_metadata({"task_id": "apply-1"}) == {}


def test_news_is_only_what_a_merge_would_change() -> None:
    stored: dict[str, Any] = {"vm.primary_ip": "10.0.0.1", "n": 5}
    reported = {"vm.primary_ip": "10.0.0.1", "n": "5", "failure_reason": "INVALID_IMAGE"}
    assert metadata_news(reported, stored, failed=False) == {"n": "5"}
    news = metadata_news(reported, stored, failed=True)
    assert news == {"n": "5", "failure_reason": "INVALID_IMAGE"}
    assert merge_metadata(stored, news)
    assert metadata_news(reported, stored, failed=True) == {}
    assert not merge_metadata(stored, news)
    full = {f"k{i}": "v" for i in range(METADATA_MAX_KEYS)}
    assert metadata_news({"new": "v", "k1": "w"}, full, failed=False) == {"k1": "w"}
    assert not merge_metadata(full, {"new": "v"})
    assert len(full) == METADATA_MAX_KEYS


def test_failure_reason_follows_the_agents_reports() -> None:
    """Set by a report that says Failed, removed by one that does not (a leftover on a running
    workload must not halt it, nor a halt outlive the failure)."""
    stored: dict[str, Any] = {"failure_reason": "INVALID_IMAGE"}
    assert metadata_news({}, stored, failed=True) == {}
    assert metadata_news({"failure_reason": "INVALID_IMAGE"}, {}, failed=False) == {}
    news = metadata_news({"failure_reason": "INVALID_IMAGE"}, stored, failed=False)
    assert news == {"failure_reason": None}
    assert merge_metadata(stored, news)
    assert stored == {}
    assert not merge_metadata(stored, news)


# -- end to end ---------------------------------------------------------------------------------

async def _running(status: Callable[[], Awaitable[str]]) -> bool:
    return (await status()).startswith("Running")


async def _with_ip(status: Callable[[], Awaitable[str]]) -> str:
    text = await status()
    return text if "ip=" in text else ""


async def test_vm_primary_ip_reported_by_the_agent_shows_in_workload_status(
        etcd_server, redis_server, key_root, stream_key, monkeypatch):
    import ops.sim.node as sim
    original = sim.SimNode._status

    def with_ip(w: Any) -> Any:
        status = original(w)
        if w.type == sim.agent_pb2.WORKLOAD_TYPE_VM and w.actual == sim._RUNNING:
            status.metadata["vm.primary_ip"] = "10.1.2.3"
        return status

    monkeypatch.setattr(sim.SimNode, "_status", staticmethod(with_ip))
    s = make_settings(etcd_server, redis_server, key_root, stream_key, reconcile_interval_s=0.3)
    async with leading_fleet(s, 1) as (_sched, _fleet, stub):
        spec = pb.WorkloadSpec(type="vm", resources=pb.ResourceRequirements(
            cpu_millicores=1000, memory_mb=512), vm=pb.VMSpec(
            vcpus=1, memory_mb=512, os_image="ubuntu-24.04"))
        assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="vm-ip", spec=spec))).success

        async def status() -> str:
            return (await stub.GetWorkload(pb.GetWorkloadRequest(
                workload_id="vm-ip"))).workload.status

        await wait_for(lambda: _running(status), timeout=15)
        shown = await wait_for(lambda: _with_ip(status), timeout=5, message="ip shown")
        assert shown == "Running (ip=10.1.2.3)"
        # the status filter compares the status, not its rendering with the address
        listed = await stub.ListWorkloads(pb.ListWorkloadsRequest(status="running"))
        assert [w.workload_id for w in listed.workloads] == ["vm-ip"]
        assert listed.workloads[0].status == "Running (ip=10.1.2.3)"


async def test_an_agent_reported_invalid_image_halts_the_retries(
        etcd_server, redis_server, key_root, stream_key, monkeypatch):
    """The agent fails the workload and says why in its metadata (``failure_reason``
    INVALID_IMAGE; Go's ``shouldHaltReapply``, docs/compatibility.md, "Reconcile order"): the
    workload is marked Failed for good after the first failure, and never applied again,
    instead of spending its retry budget."""
    import ops.sim.node as sim
    original = sim.SimNode._status

    def invalid_image(w: Any) -> Any:
        status = original(w)
        if w.actual == sim._FAILED:
            status.metadata["failure_reason"] = "INVALID_IMAGE"
            status.metadata["container.stderr"] = "pull access denied for nosuch/image"
        return status

    monkeypatch.setattr(sim.SimNode, "_status", staticmethod(invalid_image))
    s = make_settings(etcd_server, redis_server, key_root, stream_key, reconcile_interval_s=0.3)
    behaviour = sim.NodeBehaviour(apply_latency_s=0.05, failure_rate=1.0)
    async with leading_fleet(s, 1, behaviour=behaviour) as (sched, fleet, stub):
        assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="bad-image", spec=container_spec(image="nosuch/image")))).success

        async def view() -> Any:
            return (await stub.GetWorkload(pb.GetWorkloadRequest(
                workload_id="bad-image"))).workload

        def halted() -> Any:
            item = sched.cluster.statuses.get("bad-image")
            meta = item.value.metadata if item is not None else {}
            return item if meta.get("last_action") == "TerminalFailureNoReapply" else None

        item = await wait_for(halted, timeout=15, message="halted as a terminal failure")
        meta = item.value.metadata
        assert meta.get("failure_reason") == "INVALID_IMAGE"
        shown = await view()
        assert shown.status == "Failed"
        assert "pull access denied" in shown.failure_reason
        # the budget was not what stopped it: at most the first failure was counted
        assert item.value.retry.attempts <= 1
        applies = fleet.counters.rpcs["ApplyWorkload"]

        def cycles() -> float:
            return sched.metrics.registry.get_sample_value(
                "persys_scheduler_reconcile_cycles_total") or 0.0

        seen = cycles()
        await wait_for(lambda: cycles() >= seen + 3, timeout=10, message="three more cycles")
        assert fleet.counters.rpcs["ApplyWorkload"] == applies, "applied again"
        assert (await view()).status == "Failed"


async def test_metadata_in_the_apply_answer_is_recorded_by_the_dispatcher(
        etcd_server, redis_server, key_root, stream_key, monkeypatch):
    """The status in the agent's ApplyWorkload answer carries metadata: what is new reaches the
    status record with no reconcile cycle (one ran on gaining leadership, the next in an hour);
    the apply task's own keys (task_id, task_status) are not stored."""
    import ops.sim.node as sim
    original = sim.SimNode._submitted

    def with_runtime(self: Any, w: Any) -> Any:
        answer = original(self, w)
        answer.status.metadata["container.id"] = f"c-{w.workload_id}"
        return answer

    monkeypatch.setattr(sim.SimNode, "_submitted", with_runtime)
    s = make_settings(etcd_server, redis_server, key_root, stream_key,
                      reconcile_interval_s=3600.0, drift_detect_interval_s=0.0)
    async with leading_fleet(s, 1) as (sched, _fleet, stub):
        assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w-meta", spec=container_spec()))).success

        def recorded() -> Any:
            item = sched.cluster.statuses.get("w-meta")
            return item is not None and item.value.metadata.get("container.id")

        assert await wait_for(recorded, timeout=10, message="answer recorded") == "c-w-meta"
        item = sched.cluster.statuses.get("w-meta")
        assert item is not None
        assert "task_id" not in item.value.metadata
        assert "task_status" not in item.value.metadata
