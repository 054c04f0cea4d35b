"""An agent call decided before a delete must not bring the workload back after it.

A reconcile cycle plans, then acts: a delete committed in between (by any replica) makes the
planned apply stale. The dispatcher's post-commit applies wait behind a bounded semaphore (a
VM's apply can take minutes): a delete that lands while one waits makes it stale too. Both
re-read the workload just before the call and drop it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from handlers.reconcile.bookkeeping import CycleReport
from handlers.reconcile.planner.workload import REAPPLY, Action
from handlers.reconcile.registration import loops_of
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    container_spec,
    make_settings,
    serving_fleet,
)
from tests.fixtures.waiting import wait_for


async def placed(scheduler: Any, fleet: Any, stub: Any, workload_id: str,
                 spec: Any = None) -> Any:
    """Apply ``workload_id`` and wait until its agent holds it; returns that simulated node."""
    resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
        workload_id=workload_id, spec=spec if spec is not None else container_spec()))
    assert resp.success, resp
    await wait_for(lambda: scheduler.cluster.statuses.get(workload_id) is not None)
    node = fleet.node(scheduler.cluster.statuses.get(workload_id).value.node_id)
    await wait_for(lambda: workload_id in node.workload_ids(), message="applied")
    return node


async def test_a_reapply_planned_before_a_delete_is_not_sent(
    etcd_server, redis_server, key_root, stream_key
):
    s = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r1")
    async with serving_fleet(s) as (a, fleet, stub):
        await wait_for(lambda: a.leader.is_leader, timeout=15, message="leader")
        sim = await placed(a, fleet, stub, "w-del")
        node_id = sim.node_id
        # the delete as another replica would run it: committed, then its agent call; the
        # finalisation has not happened yet (the status stays Deleting)
        a.dispatcher.delete = lambda *args, **kw: None  # type: ignore[method-assign]
        assert (await a.workloads.delete("w-del")).ok
        await a.agents.delete(node_id, sim.endpoint, "w-del")
        await wait_for(lambda: a.cluster.statuses.get("w-del").value.status  # type: ignore[union-attr]
                       == "Deleting", message="Deleting in the projection")
        # a REAPPLY the running cycle planned before the delete now acts
        loop = loops_of(a).reconcile
        sent = await loop._apply(Action(REAPPLY, "w-del", node_id), loop.node_views(),
                                 CycleReport(), a.clock.now())
        assert not sent
        assert "w-del" not in sim.workload_ids()
        assert a.cluster.statuses.get("w-del").value.status == "Deleting"  # type: ignore[union-attr]


async def test_a_queued_apply_is_dropped_once_the_workload_is_deleted(
    etcd_server, redis_server, key_root, stream_key
):
    s = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r1")
    async with serving_fleet(s) as (a, fleet, stub):
        sim = await placed(a, fleet, stub, "w-q")
        status = a.cluster.statuses.get("w-q").value  # type: ignore[union-attr]
        spec = a.cluster.specs.get("w-q").value  # type: ignore[union-attr]
        assert (await a.workloads.delete("w-q")).ok
        await wait_for(lambda: a.cluster.specs.get("w-q") is None, message="finalised")
        assert "w-q" not in sim.workload_ids()
        # the post-commit apply that waited behind the dispatcher's semaphore runs now
        await a.dispatcher._apply(spec, dict(status.metadata), status.node_id, "Running")
        assert "w-q" not in sim.workload_ids()


async def test_a_queued_apply_superseded_by_a_newer_spec_is_dropped(
    etcd_server, redis_server, key_root, stream_key
):
    s = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r1")
    async with serving_fleet(s) as (a, fleet, stub):
        sim = await placed(a, fleet, stub, "w-s")
        node_id = sim.node_id
        old = a.cluster.specs.get("w-s").value  # type: ignore[union-attr]
        newer = container_spec(image="nginx:1.27")
        resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(workload_id="w-s",
                                                                spec=newer))
        assert resp.success, resp
        await wait_for(lambda: a.cluster.specs.get("w-s").value.revision_id  # type: ignore[union-attr]
                       != old.revision_id, message="the newer spec in the projection")
        await wait_for(lambda: sim.workload_revision("w-s")
                       == a.cluster.specs.get("w-s").value.revision_id,  # type: ignore[union-attr]
                       message="the newer spec applied")
        # the older spec's apply, still queued, must not roll the agent back
        await a.dispatcher._apply(old, {}, node_id, "Running")
        assert sim.workload_revision("w-s") != old.revision_id


async def test_a_delete_the_agent_refuses_is_not_finalised(
    etcd_server, redis_server, key_root, stream_key
):
    """success=false from the agent means it still runs the workload: the state stays
    Deleting (an orphan otherwise), and the reconcile loop finishes the delete later."""
    s = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r1",
                      reconcile_interval_s=3600.0)
    async with serving_fleet(s) as (a, fleet, stub):
        await wait_for(lambda: a.leader.is_leader, timeout=15, message="leader")
        sim = await placed(a, fleet, stub, "w-r")
        sim.behaviour = dataclasses.replace(sim.behaviour, refuse_deletes=True)
        assert (await a.workloads.delete("w-r")).ok
        await wait_for(lambda: not a.dispatcher._tasks, message="the delete call ran")
        assert "w-r" in sim.workload_ids()
        assert a.cluster.specs.get("w-r") is not None
        assert a.cluster.statuses.get("w-r").value.status == "Deleting"  # type: ignore[union-attr]
        sim.behaviour = dataclasses.replace(sim.behaviour, refuse_deletes=False)
        await loops_of(a).reconcile.run_once()
        await wait_for(lambda: a.cluster.specs.get("w-r") is None, message="finalised")
        assert "w-r" not in sim.workload_ids()


async def test_a_heartbeat_from_before_an_update_does_not_finish_it(
    etcd_server, redis_server, key_root, stream_key
):
    """A heartbeat built while the old revision ran, delivered after the update committed,
    must not turn Updating into Running: the new revision has not started."""
    s = make_settings(etcd_server, redis_server, key_root, stream_key, instance_id="r1",
                      reconcile_interval_s=3600.0)
    async with serving_fleet(s, 1, heartbeat_interval_s=900) as (a, fleet, stub):
        node = await placed(a, fleet, stub, "w-u")
        await wait_for(lambda: node.workload_state("w-u") == "Running", message="running")
        await a.nodes.heartbeat(node.heartbeat_request())
        await wait_for(lambda: a.cluster.statuses.get("w-u").value.status  # type: ignore[union-attr]
                       == "Running", message="first heartbeat")
        old = node.heartbeat_request()  # built while the first revision runs ...
        for ws in old.workload_statuses:
            ws.last_transition.seconds -= 60  # ... which started a minute before
        node.behaviour = dataclasses.replace(node.behaviour, apply_latency_s=600)
        resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w-u", spec=container_spec(image="nginx:2")))
        assert resp.success, resp
        await wait_for(lambda: a.cluster.statuses.get("w-u").value.status  # type: ignore[union-attr]
                       == "Updating", message="updating")
        await a.nodes.heartbeat(old)  # delivered late
        await wait_for(lambda: not a.dispatcher._tasks, message="the update's apply ran")
        assert a.cluster.statuses.get("w-u").value.status == "Updating"  # type: ignore[union-attr]
