"""A reconcile action planned from an agent report about the old revision must not be written
after the workload was updated to a new revision (it halted the new one for good).

The window is real: a cycle lists every node first, plans, then executes actions (bounded
concurrency); at 5,000 nodes the gap between a node's ListWorkloads and an action's write is
seconds. The wrapper below only makes the update land inside that window deterministically.
"""

from __future__ import annotations

from typing import Any

import grpc

from handlers.reconcile.cycle import ReconcileLoop
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    container_spec,
    leading_fleet,
    make_settings,
)
from tests.fixtures.waiting import wait_for


async def test_a_report_about_the_old_revision_does_not_halt_the_new_one(
        etcd_server, redis_server, key_root, stream_key, monkeypatch):
    import ops.sim.node as sim
    original_status = sim.SimNode._status

    def invalid_image(w: Any) -> Any:
        status = original_status(w)
        if w.actual == sim._FAILED:
            status.metadata["failure_reason"] = "INVALID_IMAGE"
        return status

    monkeypatch.setattr(sim.SimNode, "_status", staticmethod(invalid_image))

    # the update's own apply meets a transient agent error once (the reconcile loop is what
    # guarantees the new revision reaches the agent)
    refuse_next = {"armed": False, "refused": 0}
    original_apply = sim.SimNode.ApplyWorkload

    async def flaky_apply(self: Any, request: Any, context: Any) -> Any:
        if refuse_next["armed"]:
            refuse_next["armed"] = False
            refuse_next["refused"] += 1
            await context.abort(grpc.StatusCode.INTERNAL, "docker daemon busy, try again")
        return await original_apply(self, request, context)

    monkeypatch.setattr(sim.SimNode, "ApplyWorkload", flaky_apply)

    s = make_settings(etcd_server, redis_server, key_root, stream_key, reconcile_interval_s=0.3,
                      drift_detect_interval_s=0.0)
    behaviour = sim.NodeBehaviour(apply_latency_s=0.05, failure_rate=1.0)
    async with leading_fleet(s, 1, behaviour=behaviour) as (sched, fleet, stub):
        original_mark = ReconcileLoop._mark_terminal
        injected = {"started": False, "done": False}

        async def update_then_mark(self: Any, action: Any, now: Any) -> bool:
            if not injected["started"] and dict(action.reported).get("failure_reason"):
                injected["started"] = True
                # the operator fixes the image while this cycle's actions run
                behaviour.failure_rate = 0.0
                refuse_next["armed"] = True
                answer = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                    workload_id="w", spec=container_spec(image="good/image:2")))
                assert answer.success
                await wait_for(lambda: refuse_next["refused"] == 1, timeout=10,
                               message="the update's apply reached the agent")
                injected["done"] = True
            return await original_mark(self, action, now)

        monkeypatch.setattr(ReconcileLoop, "_mark_terminal", update_then_mark)

        assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w", spec=container_spec(image="nosuch/image:1")))).success
        await wait_for(lambda: injected["done"], timeout=15, message="race injected")
        new_revision = sched.cluster.specs.get("w").value.revision_id
        node = fleet.nodes[0]

        def runs_new_revision() -> bool:
            return (node.workload_revision("w") == new_revision
                    and node.workload_state("w") == "Running")

        try:
            await wait_for(runs_new_revision, timeout=45,
                           message="the agent runs the updated revision")
        except AssertionError:
            st = sched.cluster.statuses.get("w").value
            raise AssertionError(
                f"new revision never applied: agent holds {node.workload_revision('w')} "
                f"({node.workload_state('w')}), spec {new_revision}; status={st.status} "
                f"failure_reason={st.metadata.get('failure_reason')} "
                f"last_action={st.metadata.get('last_action')}") from None
