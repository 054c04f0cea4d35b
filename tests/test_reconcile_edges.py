"""Review of reconciliation, retry and node liveness: cases found wrong, on real etcd and Redis
with simulated agents (the cycles are driven with ``run_once`` and an injected ``now``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import grpc

from handlers.reconcile.planner.workload import COUNT_FAILURE, REAPPLY
from ops.sim.config import NodeBehaviour
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import make_settings
from tests.fixtures.reconcile import QUIET, last_apply, stack
from tests.fixtures.waiting import wait_for


def vm_spec() -> Any:
    return pb.WorkloadSpec(type="vm", resources=pb.ResourceRequirements(
        cpu_millicores=1000, memory_mb=512), vm=pb.VMSpec(vcpus=1, memory_mb=512,
                                                         os_image="alpine"))


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
    import ops.sim.node as sim

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

        # the agent answers again: the cycles' answered dials make the node Ready
        # (SCHEDULER_NODE_READY_AFTER_DIALS; its heartbeats alone do not): deleted, finalised
        overloaded["on"] = False

        async def ready_again() -> bool:
            await s.loops.reconcile.run_once()
            await s.caught_up()
            return s.sched.cluster.nodes.get(node.node_id).value.status == "Ready"  # type: ignore[union-attr]

        await wait_for(ready_again, timeout=20, message="Ready again")

        async def finalised() -> bool:
            await s.loops.reconcile.run_once()
            await s.caught_up()
            return s.sched.cluster.specs.get("w") is None

        await wait_for(finalised, timeout=20, message="deleted once the agent answers")
        assert node.workload_state("w") is None


async def test_a_stale_failed_listing_is_not_charged_to_the_reapply_in_flight(
        etcd_server, redis_server, key_root, stream_key, monkeypatch):
    """A Go agent's ListWorkloads omits the task-queue overlay (docs/compatibility.md,
    "Agent quirks"), so while an (asynchronous) apply of a failed workload is in flight its
    listing still says Failed. The first failure is counted and the workload re-applied; the
    cycles after that must not charge that stale Failed to the new apply (nor send yet another
    apply) before the apply could have shown its outcome: one slow apply (a VM boots for
    minutes) must not exhaust the retry budget and end the workload Failed. Go governed an
    observed Failed by the re-apply guard (docs/compatibility.md, "Reconcile order"), whose base
    is the VM apply timeout here ("VM re-apply guard" there)."""
    import ops.sim.node as sim

    original_status = sim.SimNode._status
    #: workload id -> its stored (state, updated_at) when the apply now in flight arrived
    settled_before_apply: dict[str, tuple[int, int]] = {}

    def listing_without_overlay(w: Any) -> Any:
        status = original_status(w)
        before = settled_before_apply.get(w.workload_id)
        if w.actual == sim._PENDING and before is not None:
            # the stored record, not the task in flight
            status.actual_state, status.updated_at = before
        return status

    original_apply = sim.SimNode._apply

    def remember(self: Any, request: Any) -> Any:
        w = self._workloads.get(request.id)
        if w is not None and w.actual != sim._PENDING:
            settled_before_apply[request.id] = (w.actual, w.updated_at)
        return original_apply(self, request)

    monkeypatch.setattr(sim.SimNode, "_status", staticmethod(listing_without_overlay))
    monkeypatch.setattr(sim.SimNode, "_apply", remember)
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_lease_ttl_s=3600, heartbeat_interval_s=600, **QUIET)
    behaviour = NodeBehaviour(apply_latency_s=0.02, failure_rate=1.0)
    async with stack(settings, 1, behaviour=behaviour, heartbeat_interval_s=900) as s:
        await s.apply(["slow"], spec_of=vm_spec)
        node = s.fleet.nodes[0]
        await wait_for(lambda: node.workload_state("slow") == "Failed", timeout=10)
        await s.caught_up()
        # from now on an apply succeeds, after 200 s: a VM's boot, well inside its 240 s apply
        # timeout (SCHEDULER_AGENT_VM_APPLY_TIMEOUT)
        behaviour.failure_rate = 0.0
        behaviour.apply_latency_s = 200.0
        base = last_apply(s.status("slow")) + timedelta(seconds=1)
        kinds: list[str] = []
        applies = s.fleet.counters.rpcs["ApplyWorkload"]
        for step in range(36):  # 5 s cycles for 180 s: the retry grace is 120 s
            report = await s.loops.reconcile.run_once(now=base + timedelta(seconds=5 * step))
            kinds.extend(report.actions)
            await s.caught_up()
        st = s.status("slow")
        sent = s.fleet.counters.rpcs["ApplyWorkload"] - applies
        seen = (f"{kinds.count(COUNT_FAILURE)} failures counted and {sent} applies sent for "
                f"one failure and one apply in flight; status={st.status} "
                f"attempts={st.retry.attempts} last_action={st.metadata.get('last_action')}")
        assert kinds.count(COUNT_FAILURE) == 1, seen
        assert kinds.count(REAPPLY) == 1, seen
        assert sent == 1, seen
        assert st.status != "Failed"
        assert not await s.events("WorkloadFailed", workload_id="slow")


async def test_drift_never_deletes_a_workload_created_while_the_agents_were_listed(
        etcd_server, redis_server, key_root, stream_key, monkeypatch):
    """Drift compares each agent's listing with the projections, waiting until they show etcd
    as of a revision. That revision was read *before* the listing: a workload another replica
    created (and applied) while this cycle listed its thousands of agents is listed by its
    agent but, with this replica's watch a little behind, unknown to the projections, so it
    was classified an orphan and deleted from its agent. What an agent lists was committed
    before it was listed: the revision to wait for is the one after the listing."""
    from eventsource.etcd import Put
    from eventsource.records import WorkloadSpec, WorkloadStatus, encode
    from handlers.reconcile import planning as loops_module
    from tests.fixtures.reconcile import agent_apply

    monkeypatch.setattr(loops_module, "DRIFT_FRESHNESS_WAIT_S", 0.3)
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             node_lease_ttl_s=3600, heartbeat_interval_s=600, **QUIET)
    async with stack(settings, 1, heartbeat_interval_s=900) as s:
        s.fleet.hold_control(True)
        await s.caught_up()
        node = s.fleet.nodes[0]
        cluster = s.sched.cluster
        held: list[Any] = []
        fold = cluster.apply
        agents = s.sched.agents
        listing = agents.list_workloads_raw
        layout = s.sched.layout

        async def created_meanwhile(*args: Any, **kwargs: Any) -> Any:
            # another replica creates and applies a workload while this cycle lists; this
            # replica's watch is a moment behind
            cluster.apply = held.append  # type: ignore[method-assign]
            spec = WorkloadSpec(id="fresh", type="container", image="new:1",
                                desired_state="Running", revision_id="rev-f")
            status = WorkloadStatus(id="fresh", node_id=node.node_id,
                                    assigned_node=node.node_id, status="Scheduled")
            await s.sched.etcd.txn([], [Put(layout.spec("fresh"), encode(spec)),
                                        Put(layout.status("fresh"), encode(status))])
            await agent_apply(node.endpoint, "fresh", "rev-f")
            return await listing(*args, **kwargs)

        monkeypatch.setattr(agents, "list_workloads_raw", created_meanwhile)
        try:
            report = await s.loops.reconcile.run_once(drift=True)
        finally:
            cluster.apply = fold  # type: ignore[method-assign]
            for batch in held:
                fold(batch)
        assert "fresh" in node.workload_ids(), (
            f"deleted from its agent as an orphan: {report.drifts}")
        assert not any(f.workload_id == "fresh" for f in report.drifts)
