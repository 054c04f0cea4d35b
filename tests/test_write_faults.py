"""Fault-injection review of the write paths (etcd paused or restarted mid-transaction, lost
commit answers, clients retrying after their deadline). Each test runs against a private etcd
(tests/fixtures/servers.py: current etcd with real fsync) that it pauses or restarts."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from eventsource.etcd import b64
from eventsource.records import WorkloadStatus, decode
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import container_spec, leading_fleet, make_settings
from tests.fixtures.waiting import wait_for

pytestmark = [pytest.mark.fault, pytest.mark.timeout(150)]


async def _etcd_state(sched, root: str) -> tuple[dict, dict, dict]:
    """(assignments by workload, allocations by node, status node by workload) read from etcd."""
    etcd = sched.etcd
    layout = sched.layout
    out = []
    for prefix in (layout.assignments_prefix, layout.allocations_prefix, layout.statuses_prefix):
        kvs, _ = await etcd.list_prefix(prefix)
        out.append({kv.key[len(prefix):]: json.loads(kv.value) for kv in kvs})
    return out[0], out[1], out[2]


async def test_applies_cut_by_an_etcd_pause_then_retried_place_each_workload_once(
        etcd_private, redis_server, key_root, stream_key) -> None:
    settings = make_settings(etcd_private, redis_server, key_root, stream_key,
                             etcd_timeout_s=1.0)
    async with leading_fleet(settings, 3) as (sched, fleet, stub):
        ids = [f"w{i}" for i in range(12)]

        async def apply(wid: str, timeout: float) -> object:
            try:
                return await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                    workload_id=wid, spec=container_spec(cpu_m=500, mem_mb=256)),
                    timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                return exc.code()

        # the first applies are in flight when etcd stops answering
        first = [asyncio.create_task(apply(w, 0.5)) for w in ids]
        await wait_for(lambda: sched.batcher._pump.inflight > 0, timeout=5, interval=0.001,
                       message="no placement in flight")
        await asyncio.to_thread(etcd_private.pause)
        try:
            # most end at their deadline (a batch may have committed before the pause)
            await asyncio.gather(*first)
        finally:
            await asyncio.to_thread(etcd_private.resume)

        # the client retries every apply after its deadline
        async def settled() -> bool:
            again = await asyncio.gather(*(apply(w, 10.0) for w in ids))
            return all(getattr(a, "success", False) for a in again)
        await wait_for(settled, timeout=40, interval=0.5, message="retries never succeeded")
        assignments, allocations, _ = await _etcd_state(sched, key_root)
        assert sorted(assignments) == sorted(ids)
        held: dict[str, list[str]] = {}
        for node_id, alloc in allocations.items():
            for wid in alloc.get("workloads", {}):
                held.setdefault(wid, []).append(node_id)
        assert all(len(held.get(w, [])) == 1 for w in ids), held
        for wid in ids:
            assert held[wid] == [assignments[wid]["nodeId"]], (wid, held[wid], assignments[wid])
        # every workload ends up running on exactly one agent
        def running() -> bool:
            where = {w: [n.node_id for n in fleet.nodes if n.workload_state(w) is not None]
                     for w in ids}
            return all(len(v) == 1 for v in where.values()) and where
        # well within the reconcile loop's re-apply guard (45 s): dispatched after the commit
        await wait_for(running, timeout=20, interval=0.5, message="not applied exactly once")


async def test_an_apply_whose_caller_gave_up_mid_commit_is_still_sent_to_the_agent(
        etcd_private, redis_server, key_root, stream_key) -> None:
    """The client's deadline ends while its placement is being committed (etcd slow: paused
    here), and the commit lands afterwards. ApplyWorkload's promise (docs/architecture.md,
    "Errors and answers") is that a committed placement is dispatched right after; the
    caller's cancellation must not take the dispatch with it. A retry of the same apply answers
    success ("no change") and sends nothing either, so without the fix the workload waits for the
    reconcile loop's re-apply guard (45 s by default)."""
    settings = make_settings(etcd_private, redis_server, key_root, stream_key,
                             etcd_timeout_s=3.0, reapply_guard_s=45.0)
    async with leading_fleet(settings, 1) as (sched, fleet, stub):
        await asyncio.to_thread(etcd_private.pause)
        try:
            call = asyncio.ensure_future(stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="w-late", spec=container_spec()), timeout=0.5))
            await wait_for(lambda: sched.batcher._pump.inflight > 0, timeout=5,
                           interval=0.005, message="no placement in flight")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            await asyncio.to_thread(etcd_private.resume)
        # the placement was committed after all
        await wait_for(lambda: sched.cluster.statuses.get("w-late") is not None, timeout=10,
                       message="the placement never landed")
        again = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w-late", spec=container_spec()), timeout=10)
        assert again.success, again
        await wait_for(lambda: any(n.workload_state("w-late") is not None
                                   for n in fleet.nodes),
                       timeout=15, message="a committed placement was never sent to its agent")


class AnswerDropper:
    """A TCP proxy in front of etcd's gateway that swallows the answer to the first request
    whose bytes hold ``marker`` (armed by ``arm``): the request reaches etcd and is applied,
    and the client never learns it (OutcomeUnknown)."""

    def __init__(self, upstream: str) -> None:
        self.host, port = upstream.rsplit(":", 1)
        self.port = int(port)
        self.marker: bytes | None = None
        self.dropped = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def arm(self, marker: bytes) -> None:
        self.marker = marker

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter
                     ) -> None:
        ureader, uwriter = await asyncio.open_connection(self.host, self.port)
        sent = bytearray()  # the client's bytes since the last answer
        swallowing = False

        async def up() -> None:
            while data := await creader.read(65536):
                sent.extend(data)
                uwriter.write(data)
                await uwriter.drain()
            uwriter.close()

        async def down() -> None:
            nonlocal swallowing
            while data := await ureader.read(65536):
                if not swallowing and self.marker is not None and self.marker in sent:
                    swallowing = True
                    self.marker = None
                    self.dropped += 1
                sent.clear()
                if swallowing:
                    continue
                cwriter.write(data)
                await cwriter.drain()
            cwriter.close()

        tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
        self._tasks.update(tasks)
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._tasks.difference_update(tasks)
            cwriter.close()
            uwriter.close()


@contextlib.asynccontextmanager
async def answer_dropping_fleet(etcd_private: Any, redis_server: Any, key_root: str,
                                stream_key: str) -> AsyncIterator[tuple[Any, Any, Any, Any]]:
    """A leading scheduler with one agent whose etcd traffic passes an ``AnswerDropper``
    (armed by the test), with a short etcd timeout and the re-apply guard at 45 s, so a
    change that reaches its agent sooner was sent on purpose."""
    proxy = AnswerDropper(etcd_private.endpoint)
    await proxy.start()
    try:
        settings = make_settings(etcd_private, redis_server, key_root, stream_key,
                                 etcd_endpoints=(proxy.endpoint,), etcd_timeout_s=1.0,
                                 reapply_guard_s=45.0)
        async with leading_fleet(settings, 1) as (sched, fleet, stub):
            yield proxy, sched, fleet, stub
    finally:
        await proxy.stop()


async def test_a_placement_whose_commit_answer_is_lost_is_resolved_not_guessed(
        etcd_private, redis_server, key_root, stream_key) -> None:
    """etcd applies the placement and its answer is lost (OutcomeUnknown). ApplyWorkload then
    answers success=false "state not stored: ..." for a workload that is stored and placed,
    and the agent apply that follows a placement is skipped (the workload waits for the
    re-apply guard, 45 s). The claim under test: an ambiguous outcome is resolved (read back)
    rather than guessed."""
    async with answer_dropping_fleet(etcd_private, redis_server, key_root, stream_key) as (
            proxy, sched, fleet, stub):
        proxy.arm(b64(sched.layout.spec("w-lost")).encode())
        resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w-lost", spec=container_spec()), timeout=20)
        assert proxy.dropped == 1
        stored = await sched.etcd.get(sched.layout.spec("w-lost"))
        assert stored is not None  # etcd applied it
        assert resp.success, (resp.failure_reason, resp.error_message)
        await wait_for(lambda: any(n.workload_state("w-lost") is not None
                                   for n in fleet.nodes),
                       timeout=15, message="the stored placement never reached its agent")


async def test_an_update_whose_commit_answer_is_lost_is_resolved_not_guessed(
        etcd_private, redis_server, key_root, stream_key) -> None:
    """As for a placement: a new spec that etcd stored without its answer reaching the
    scheduler is read back, answered success and sent to the agent; before, the client read
    "state not stored" (with an empty cause) and the agent kept the old spec until the
    re-apply guard."""
    async with answer_dropping_fleet(etcd_private, redis_server, key_root, stream_key) as (
            proxy, sched, fleet, stub):
        first = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w-up", spec=container_spec(image="nginx:1")), timeout=20)
        assert first.success, first
        node = fleet.nodes[0]
        await wait_for(lambda: node.workload_state("w-up") == "Running", timeout=15)
        old_revision = node.workload_revision("w-up")
        proxy.arm(b64(sched.layout.spec("w-up")).encode())
        resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w-up", spec=container_spec(image="nginx:2")), timeout=20)
        assert proxy.dropped == 1
        stored = await sched.etcd.get(sched.layout.spec("w-up"))
        assert stored is not None
        assert b"nginx:2" in stored.value  # etcd applied it
        assert resp.success, (resp.failure_reason, resp.error_message)
        await wait_for(lambda: node.workload_revision("w-up") not in (None, old_revision),
                       timeout=15, message="the stored update never reached its agent")


@pytest.mark.parametrize("fault", ["kill-restart", "pause-past-the-leader-ttl"])
async def test_an_etcd_outage_under_applies_and_deletes_leaves_consistent_state(
        fault, etcd_private, redis_server, key_root, stream_key) -> None:
    """etcd killed (SIGKILL) and restarted, or stopped past the leader's TTL, while applies and
    deletes are in flight; clients
    retry what failed. Afterwards: every kept workload has one assignment, the allocations
    equal the assignments (nothing counted twice or lost), no node is over its capacity,
    every kept workload runs on exactly one agent, deleted ones on none, and nothing in the
    commit layer, the batcher or the dispatcher stays stuck."""
    settings = make_settings(etcd_private, redis_server, key_root, stream_key,
                             etcd_timeout_s=1.0)
    async with leading_fleet(settings, 3) as (sched, fleet, stub):
        keep = [f"k{i}" for i in range(10)]
        gone = [f"d{i}" for i in range(6)]
        for wid in gone:
            assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id=wid, spec=container_spec(cpu_m=700, mem_mb=512)),
                timeout=10)).success

        async def apply(wid: str) -> bool:
            try:
                r = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                    workload_id=wid, spec=container_spec(cpu_m=700, mem_mb=512)), timeout=5)
                return r.success
            except grpc.aio.AioRpcError:
                return False

        async def delete(wid: str) -> bool:
            try:
                r = await stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id=wid),
                                              timeout=5)
                return r.success or "not found" in r.error_message
            except grpc.aio.AioRpcError:
                return False

        calls = [asyncio.create_task(apply(w)) for w in keep] + [
            asyncio.create_task(delete(w)) for w in gone]
        await wait_for(lambda: sched.batcher._pump.inflight > 0, timeout=5, interval=0.001)
        if fault == "kill-restart":
            await asyncio.to_thread(etcd_private.kill)
            await asyncio.gather(*calls)
            await asyncio.to_thread(etcd_private.restart)
        else:
            await asyncio.to_thread(etcd_private.pause)
            try:
                await asyncio.gather(*calls)
                # more work than the etcd threads while it is stopped, past the leader's TTL
                more = [asyncio.create_task(apply(w)) for w in keep * 3]
                await wait_for(lambda: not sched.leader.is_leader, timeout=15,
                               message="still leading with etcd stopped")
                await asyncio.gather(*more)
            finally:
                await asyncio.to_thread(etcd_private.resume)
            await wait_for(lambda: sched.leader.is_leader, timeout=30,
                           message="never led again")

        async def all_done() -> bool:
            results = await asyncio.gather(*(apply(w) for w in keep),
                                           *(delete(w) for w in gone))
            return all(results)

        await wait_for(all_done, timeout=60, interval=0.5, message="retries never succeeded")
        await wait_for(lambda: all(sched.cluster.specs.get(w) is None for w in gone),
                       timeout=30, message="deleted workloads not finalised")
        assignments, allocations, _ = await _etcd_state(sched, key_root)
        assert sorted(assignments) == sorted(keep)
        counted: dict[str, str] = {}
        for node_id, alloc in allocations.items():
            assert alloc["cpuMillicores"] == sum(v[0] for v in alloc["workloads"].values())
            assert alloc["cpuMillicores"] <= 8000
            for wid in alloc["workloads"]:
                assert wid not in counted, (wid, counted[wid], node_id)
                counted[wid] = node_id
        assert counted == {w: assignments[w]["nodeId"] for w in keep}

        def placed_once() -> bool:
            where = {w: [n.node_id for n in fleet.nodes if n.workload_state(w) is not None]
                     for w in keep + gone}
            return all(len(where[w]) == 1 for w in keep) and not any(where[w] for w in gone)

        await wait_for(placed_once, timeout=30, interval=0.5,
                       message="not running exactly once / deleted still running")
        await wait_for(lambda: not sched.dispatcher._tasks and not sched.batcher._pump.queue
                       and sched.batcher._pump.inflight == 0
                       and sched.committer._group._pump.inflight == 0,
                       timeout=30, message="work stuck after the outage")


async def test_an_agent_that_hangs_mid_apply_costs_a_timeout_and_nothing_else(
        etcd_private, redis_server, key_root, stream_key) -> None:
    """The agent stops answering (every RPC waits far past its deadline). ApplyWorkload still
    answers at once (commit first), the dispatch ends at its deadline and is recorded, no
    task of the dispatcher stays behind, and once the agent answers again the workload is
    applied exactly once, on its node."""
    from dataclasses import replace

    from ops.sim.config import NodeBehaviour

    settings = make_settings(etcd_private, redis_server, key_root, stream_key,
                             agent_apply_timeout_s=1.0, agent_rpc_timeout_s=1.0,
                             reapply_guard_s=2.0, reconcile_interval_s=1.0)
    async with leading_fleet(settings, 2) as (sched, fleet, stub):
        for node in fleet.nodes:
            node.behaviour = replace(NodeBehaviour(apply_latency_s=0.05), slow_answer_s=3600.0)
        resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="w-hang", spec=container_spec(cpu_m=500)), timeout=5)
        assert resp.success, resp
        # the answer follows the commit; this replica's projection may show it a moment later
        placed = await wait_for(lambda: sched.cluster.statuses.get("w-hang"), timeout=5)
        hung = fleet.node(placed.value.node_id)
        other = next(n for n in fleet.nodes if n is not hung)

        async def timeout_recorded() -> bool:
            # read from the status key's history in etcd: the reconcile loop's "no failover
            # target" count rewrites the status each cycle, and a watch batch holding both
            # writes never shows the first one in the projection
            key = sched.layout.status("w-hang")
            kv = await sched.etcd.get(key)
            while kv is not None and kv.mod_revision > placed.mod_revision:
                status = decode(WorkloadStatus, kv.value)
                if (status.node_id == hung.node_id
                        and status.metadata.get("last_action") == "ApplyFailed"
                        and "DEADLINE_EXCEEDED" in str(status.metadata.get(
                            "scheduler_last_error", ""))):
                    return True
                kv = await sched.etcd.get(key, revision=kv.mod_revision - 1)
            return False

        await wait_for(timeout_recorded, timeout=10, interval=0.2,
                       message="the timeout was not recorded")
        for node in fleet.nodes:
            node.behaviour = NodeBehaviour(apply_latency_s=0.05)
        await wait_for(lambda: hung.workload_state("w-hang") == "Running", timeout=30,
                       message="never applied after the agent recovered")
        assert other.workload_state("w-hang") is None
        await wait_for(lambda: not sched.dispatcher._tasks, timeout=10,
                       message="dispatcher tasks left behind")


async def test_a_hung_redis_stalls_no_write_path(etcd_private, redis_private, key_root,
                                                 stream_key) -> None:
    """Redis stopped (SIGSTOP): registrations, heartbeats, applies, retries and deletes answer
    within their usual time; the events reach the stream once Redis answers again."""
    from tests.fixtures.harness import control_stub, running_fleet, running_scheduler

    settings = make_settings(etcd_private, redis_private, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        await wait_for(lambda: sched.leader.is_leader, timeout=15, message="no leader")
        await asyncio.to_thread(redis_private.pause)
        try:
            address = f"127.0.0.1:{sched.grpc_port}"
            async with running_fleet(address, 2) as fleet, control_stub(address) as stub:
                await asyncio.wait_for(fleet.wait_registered(), 10)
                for i in range(3):
                    r = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                        workload_id=f"r{i}", spec=container_spec()), timeout=3)
                    assert r.success, r
                await wait_for(lambda: sum(n.held for n in fleet.nodes) == 3, timeout=15)
                assert (await stub.RetryWorkload(pb.RetryWorkloadRequest(workload_id="r0"),
                                                 timeout=3)).accepted
                assert (await stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id="r1"),
                                                  timeout=3)).success
                await wait_for(lambda: sched.cluster.specs.get("r1") is None, timeout=15)
        finally:
            await asyncio.to_thread(redis_private.resume)
        # the outbox drains into the stream once Redis answers
        prefix = sched.layout.outbox_prefix
        async def drained() -> bool:
            kvs, _ = await sched.etcd.list_prefix(prefix)
            return not kvs
        await wait_for(drained, timeout=30, interval=0.2, message="outbox never drained")


async def test_a_hung_agent_does_not_hold_up_applies_to_healthy_nodes(
        etcd_private, redis_server, key_root, stream_key) -> None:
    from dataclasses import replace

    from ops.sim.config import NodeBehaviour

    settings = make_settings(etcd_private, redis_server, key_root, stream_key,
                             agent_apply_timeout_s=20.0)
    async with leading_fleet(settings, 2) as (sched, fleet, stub):
        hung, healthy = fleet.nodes
        hung.behaviour = replace(NodeBehaviour(apply_latency_s=0.05), slow_answer_s=3600.0)

        async def apply(wid: str) -> str:
            r = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id=wid, spec=container_spec(cpu_m=10, mem_mb=16)), timeout=10)
            assert r.success, r
            item = await wait_for(lambda: sched.cluster.statuses.get(wid), timeout=5)
            return str(item.value.node_id)

        i = 0
        on_hung = 0
        while on_hung < 70:  # more applies stuck on the hung agent than the dispatcher's slots
            if await apply(f"h{i}") == hung.node_id:
                on_hung += 1
            i += 1
        # the next placement on the healthy node is applied as quickly as ever
        while True:
            wid = f"h{i}"
            i += 1
            if await apply(wid) == healthy.node_id:
                break
        await wait_for(lambda: healthy.workload_state(wid) is not None, timeout=5,
                       message="an apply to a healthy node waited behind a hung agent")
