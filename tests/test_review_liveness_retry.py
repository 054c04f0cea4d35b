"""Review of reconciliation, retry and node liveness: cases found wrong, on real etcd and Redis
with simulated agents (the cycles are driven with ``run_once`` and an injected ``now``)."""

from __future__ import annotations

from typing import Any

import grpc

from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import make_settings
from tests.fixtures.waiting import wait_for
from tests.test_reconcile import QUIET, stack


def sample(sched: Any, name: str, **labels: str) -> float:
    return float(sched.metrics.registry.get_sample_value(name, labels) or 0.0)


async def test_a_delete_is_not_finalised_while_the_node_is_alive_but_does_not_answer(
        etcd_server, redis_server, key_root, stream_key, monkeypatch):
    """docs/operations.md "Deleting workloads": the state is removed only on evidence that the
    agent no longer holds the workload, or when its node is gone (not alive *and* not
    answering). The dispatcher keeps ``Deleting`` when the node is alive but does not answer;
    the reconcile cycle must not then finalise it just because the same unanswered listing
    made it mark the node NotReady: the agent still runs the workload, and nothing would
    delete it there any more (drift is off, and its allocation is released)."""
    import ops.sim as sim

    # the agent becomes overloaded: its gRPC server answers nothing, its heartbeats still go
    # out (patched before the fleet starts: grpc binds the servicer's methods at start)
    overloaded = {"on": False}

    def answering(method: str) -> Any:
        original = getattr(sim.SimNode, method)

        async def call(self: Any, request: Any, context: Any) -> Any:
            if overloaded["on"]:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "overloaded")
            return await original(self, request, context)

        return call

    for method in ("ListWorkloads", "DeleteWorkload", "GetWorkloadStatus"):
        monkeypatch.setattr(sim.SimNode, method, answering(method))
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 1) as s:
        await s.apply(["w"])
        await s.running(["w"])
        node = s.fleet.nodes[0]
        overloaded["on"] = True
        assert (await s.stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id="w"))).success
        await wait_for(lambda: sample(s.sched, "persys_scheduler_agent_rpcs_total",
                                      method="DeleteWorkload", code="UNAVAILABLE") >= 1,
                       timeout=10, message="the dispatcher's delete was tried")
        await s.caught_up()
        assert s.status("w").status == "Deleting"
        assert s.sched.cluster.alive.get(node.node_id) is not None, "the node is alive"

        report = await s.loops.reconcile.run_once()
        assert report.unreachable == [node.node_id]
        await s.caught_up()
        assert node.workload_state("w") == "Running"
        assert s.sched.cluster.specs.get("w") is not None, (
            f"finalised while its alive node's agent still runs it: actions={report.actions}")

        # the agent answers again (and its heartbeat made the node Ready): deleted, finalised
        overloaded["on"] = False
        await wait_for(lambda: s.sched.cluster.nodes.get(node.node_id).value.status  # type: ignore[union-attr]
                       == "Ready", timeout=10, message="Ready again")

        async def finalised() -> bool:
            await s.loops.reconcile.run_once()
            await s.caught_up()
            return s.sched.cluster.specs.get("w") is None

        await wait_for(finalised, timeout=20, message="deleted once the agent answers")
        assert node.workload_state("w") is None
