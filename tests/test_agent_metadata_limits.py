"""Agent-reported status metadata is the agent's word: it must not change a workload's
placement inputs (a key naming a ``host_path`` or ``bind_mount`` makes a workload node-local,
so drain and failover would skip it), and an agent reporting new keys every listing must not
grow a status record toward etcd's request limit.
"""

from __future__ import annotations

import json
from typing import Any

from eventsource.records import encode
from handlers.workloads.metadata import METADATA_MAX_BYTES, VALUE_BYTES, agent_metadata
from handlers.workloads.records import RECORD_MAX_BYTES
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    container_spec,
    leading_fleet,
    make_settings,
)
from tests.fixtures.waiting import wait_for


async def test_agent_metadata_cannot_pin_a_movable_workload_to_its_node(
        etcd_server, redis_server, key_root, stream_key, monkeypatch):
    import ops.sim.node as sim
    original = sim.SimNode._status

    def with_mount(w: Any) -> Any:
        status = original(w)
        if w.actual == sim._RUNNING:
            status.metadata["container.mount0.host_path"] = "/srv/data"
        return status

    monkeypatch.setattr(sim.SimNode, "_status", staticmethod(with_mount))
    s = make_settings(etcd_server, redis_server, key_root, stream_key, reconcile_interval_s=0.3,
                      drift_detect_interval_s=0.0)
    async with leading_fleet(s, 2) as (sched, _fleet, stub):
        assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="c", spec=container_spec()))).success

        def running() -> bool:
            item = sched.cluster.statuses.get("c")
            return item is not None and item.value.status == "Running"

        def cycles() -> float:
            return sched.metrics.registry.get_sample_value(
                "persys_scheduler_reconcile_cycles_total") or 0.0

        await wait_for(running, timeout=15, message="running")
        seen = cycles()
        # a few cycles that saw the agent's report (and merged it)
        await wait_for(lambda: cycles() >= seen + 3, timeout=10, message="three cycles")
        node_id = sched.cluster.statuses.get("c").value.node_id
        resp = await stub.DrainNode(pb.DrainNodeRequest(node_id=node_id, reason="review"))
        assert resp.accepted
        assert resp.relocated_workloads == 1, (
            "an ephemeral container (no volumes, no persys.* metadata) was not moved off the "
            "drained node: the agent's own metadata made it node-local")
async def test_agent_metadata_cannot_grow_a_status_record_past_the_record_limit(
        etcd_server, redis_server, key_root, stream_key, monkeypatch):
    import ops.sim.node as sim
    calls = {"n": 0}
    original_list = sim.SimNode.ListWorkloads

    async def rotating(self: Any, request: Any, context: Any) -> Any:
        calls["n"] += 1
        answer = await original_list(self, request, context)
        out = sim.agent_pb2.ListWorkloadsResponse()
        out.CopyFrom(answer)
        for w in out.workloads:
            if w.actual_state == sim._RUNNING:
                for i in range(32):  # 32 keys per report, new names every listing
                    w.metadata[f"container.note.{calls['n']:05d}.{i:02d}"] = "\U0001F600" * 1024
        return out

    monkeypatch.setattr(sim.SimNode, "ListWorkloads", rotating)
    s = make_settings(etcd_server, redis_server, key_root, stream_key, reconcile_interval_s=0.3,
                      drift_detect_interval_s=0.0)
    async with leading_fleet(s, 1) as (sched, _fleet, stub):
        assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w", spec=container_spec()))).success

        def size() -> int:
            item = sched.cluster.statuses.get("w")
            return len(encode(item.value)) if item is not None else 0

        def cycles() -> float:
            return sched.metrics.registry.get_sample_value(
                "persys_scheduler_reconcile_cycles_total") or 0.0

        seen = cycles()
        await wait_for(lambda: cycles() >= seen + 10, timeout=30, message="ten cycles")
        assert size() <= RECORD_MAX_BYTES, (
            f"one agent grew workload w's status record to {size():,} bytes "
            f"(limit {RECORD_MAX_BYTES:,}; metadata keys: "
            f"{len(sched.cluster.statuses.get('w').value.metadata)})")
        # new keys stop at the metadata budget; what remains is the record's own fields
        assert size() <= METADATA_MAX_BYTES + 16 * 1024, f"{size():,} bytes"


def test_values_are_bounded_as_stored_not_as_characters() -> None:
    kept = agent_metadata({"container.stderr": "\U0001F600" * 1024, "plain": "x" * 5000})
    assert len(json.dumps(kept["container.stderr"])) - 2 <= VALUE_BYTES
    assert kept["container.stderr"]  # cut, not dropped
    assert kept["plain"] == "x" * VALUE_BYTES
    # placement inputs, in any case
    assert agent_metadata({"Container.Volume.Host_Path": "/srv", "BIND_MOUNT": "/x"}) == {}
