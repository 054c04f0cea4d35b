"""A delete is finalised only on evidence that the agent no longer holds the workload
(docs/compatibility.md, "Not-found deletes": the Go scheduler took any error text containing
"not found" for "the workload is gone", and removed the state of workloads its agents still ran).

Evidence is: ``success=true``, a gRPC ``NOT_FOUND``, or the agent not holding it any more
(``GetWorkloadStatus`` answering ``NOT_FOUND``, or, for Go agents that answer a missing
workload with a plain error, ``ListWorkloads`` not listing it). Real etcd and Redis, one
simulated agent whose DeleteWorkload the tests replace.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    container_spec,
    leading_fleet,
    make_settings,
)
from tests.fixtures.waiting import wait_for


def sample(sched: Any, name: str, **labels: str) -> float:
    return float(sched.metrics.registry.get_sample_value(name, labels) or 0.0)


async def _plain_error(self: Any, request: Any, context: Any) -> Any:
    """GetWorkloadStatus as a Go agent answers a workload it does not hold: a plain error."""
    await self._admit("GetWorkloadStatus", context)
    await context.abort(grpc.StatusCode.UNKNOWN, f"workload {request.id} not found")


@pytest.mark.parametrize("status_answer", ["status", "plain-error"])
async def test_a_refused_delete_whose_message_mentions_not_found_is_not_finalised(
        etcd_server, redis_server, key_root, stream_key, monkeypatch, status_answer):
    """``status_answer``: the agent's GetWorkloadStatus answers the workload's status, or (an
    agent in trouble) a plain error; either way its ListWorkloads still lists the workload."""
    import ops.sim.node as sim

    async def refuse(self: Any, request: Any, context: Any) -> Any:
        await self._admit("DeleteWorkload", context)
        return sim.agent_pb2.DeleteWorkloadResponse(
            success=False, message="Error response from daemon: network persys-net not found")

    monkeypatch.setattr(sim.SimNode, "DeleteWorkload", refuse)
    if status_answer == "plain-error":
        monkeypatch.setattr(sim.SimNode, "GetWorkloadStatus", _plain_error)
    s = make_settings(etcd_server, redis_server, key_root, stream_key, reconcile_interval_s=0.5)
    async with leading_fleet(s, 1) as (sched, fleet, stub):
        node = await running_then_deleted(fleet, stub, "w-orphan")
        # the dispatcher's delete was answered, then two reconcile cycles tried again (by
        # then the dispatcher's decision is long made)
        await wait_for(lambda: sample(sched, "persys_scheduler_agent_rpcs_total",
                                      method="DeleteWorkload", code="OK"))
        await wait_for(lambda: sample(
            sched, "persys_scheduler_reconciliation_results_total", action="Delete",
            success="false") >= 2, timeout=15, message="two refused reconcile deletes")
        assert node.workload_state("w-orphan") == "Running"
        assert sched.cluster.specs.get("w-orphan") is not None, \
            "finalised although the agent still runs it"
        status = sched.cluster.statuses.get("w-orphan")
        assert status is not None
        assert status.value.status == "Deleting"


@pytest.mark.parametrize("agent", ["grpc-not-found", "status-not-found", "not-listed"])
async def test_a_delete_of_a_workload_the_agent_does_not_hold_is_finalised(
        etcd_server, redis_server, key_root, stream_key, monkeypatch, agent):
    """The agent no longer holds the workload and says so: with a NOT_FOUND status, or with
    ``success=false`` "not found" confirmed by GetWorkloadStatus (NOT_FOUND) or, for a Go agent
    whose GetWorkloadStatus answers a plain error, by its ListWorkloads. The dispatcher
    finalises at once: the reconcile loop runs once, at leadership, before the workload
    exists."""
    import ops.sim.node as sim

    async def gone(self: Any, request: Any, context: Any) -> Any:
        await self._admit("DeleteWorkload", context)
        self._workloads.pop(request.id, None)
        self._changed()
        if agent == "grpc-not-found":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"workload {request.id} not found")
        return sim.agent_pb2.DeleteWorkloadResponse(
            success=False, message=f"workload {request.id} not found")

    monkeypatch.setattr(sim.SimNode, "DeleteWorkload", gone)
    if agent == "not-listed":
        monkeypatch.setattr(sim.SimNode, "GetWorkloadStatus", _plain_error)
    s = make_settings(etcd_server, redis_server, key_root, stream_key,
                      reconcile_interval_s=3600.0, drift_detect_interval_s=0.0)
    async with leading_fleet(s, 1) as (sched, fleet, stub):
        await running_then_deleted(fleet, stub, "w-gone")
        await wait_for(lambda: sched.cluster.specs.get("w-gone") is None, timeout=10,
                       message="finalised")
        assert sched.cluster.statuses.get("w-gone") is None


async def running_then_deleted(fleet: Any, stub: Any, workload_id: str) -> Any:
    """Apply ``workload_id`` on the fleet's one node, wait until it runs, then ask for its
    delete (accepted); returns that simulated node."""
    assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
        workload_id=workload_id, spec=container_spec()))).success
    node = fleet.nodes[0]
    await wait_for(lambda: node.workload_state(workload_id) == "Running")
    assert (await stub.DeleteWorkload(pb.DeleteWorkloadRequest(
        workload_id=workload_id))).success
    return node
