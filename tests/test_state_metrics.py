"""The Go version's metric families (docs/compatibility.md, "Metrics"), on real etcd and Redis.

``nodes_status``, ``workloads_status`` and ``workloads_desired_state`` are kept from the
projections (``projections/gauges.py``), on every replica; the reconcile and state-store
families are filled where cycles end and keys are written.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request

from eventsource.commit import Change, Committer
from eventsource.etcd import AsyncEtcd, Delete, Put
from eventsource.events import Event
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.records import Node, WorkloadSpec, WorkloadStatus, encode
from projections.cluster import ClusterProjection
from proto.persys.control.v1 import control_pb2 as pb
from tests.fixtures.harness import (
    container_spec,
    control_stub,
    make_settings,
    running_fleet,
    running_scheduler,
)
from tests.fixtures.metrics import counter_total
from tests.fixtures.waiting import wait_for


def _gauges(metrics: Metrics) -> dict[tuple[str, str], float]:
    """Every exported sample of the three state gauges, by (family, label value)."""
    out: dict[tuple[str, str], float] = {}
    for gauge in (metrics.nodes_status, metrics.workloads_status,
                  metrics.workloads_desired_state):
        for family in gauge.collect():
            for sample in family.samples:
                out[(family.name.removeprefix("persys_scheduler_"),
                     next(iter(sample.labels.values())))] = sample.value
    return out


def _expected(nodes: dict[str, float], statuses: dict[str, float],
              desired: dict[str, float]) -> dict[tuple[str, str], float]:
    """The Go pre-seeded labels at 0, plus the given counts."""
    out: dict[tuple[str, str], float] = {}
    for family, seeded, counts in (
            ("nodes_status", ("ready", "active", "notready", "unknown"), nodes),
            ("workloads_status", ("pending", "running", "stopped", "failed", "deleted",
                                  "updating", "unknown"), statuses),
            ("workloads_desired_state", ("running", "stopped", "deleted", "unknown"), desired)):
        out.update({(family, label): 0.0 for label in seeded})
        out.update({(family, label): value for label, value in counts.items()})
    return out


async def _put_workload(etcd: AsyncEtcd, layout: KeyLayout, workload_id: str, *,
                        status: str, desired: str) -> None:
    await etcd.txn([], [
        Put(layout.spec(workload_id), encode(WorkloadSpec(id=workload_id, type="container",
                                                          desired_state=desired))),
        Put(layout.status(workload_id), encode(WorkloadStatus(id=workload_id, status=status)))])


async def test_state_gauges_count_the_projections_by_go_label_through_changes_and_relists(
        etcd_server, key_root):
    etcd = AsyncEtcd([etcd_server.endpoint])
    layout = KeyLayout(key_root)
    metrics = Metrics()
    # before anything is listed: Go's pre-seeded labels, at 0
    assert _gauges(metrics) == _expected({}, {}, {})
    cluster = ClusterProjection(etcd, layout, metrics)
    for node_id, status in (("n1", "Ready"), ("n2", "NotReady"), ("n3", " Draining "),
                            ("n4", "")):
        await etcd.txn([], [Put(layout.node(node_id), encode(Node(node_id=node_id,
                                                                  status=status)))])
    await _put_workload(etcd, layout, "w1", status="Running", desired="Running")
    await _put_workload(etcd, layout, "w2", status="RetryPending", desired="Stopped")
    await _put_workload(etcd, layout, "w3", status="", desired="")
    task = asyncio.create_task(cluster.run())
    try:
        await cluster.wait_ready(timeout=10)
        assert _gauges(metrics) == _expected(
            {"ready": 1, "notready": 1, "draining": 1, "unknown": 1},
            {"running": 1, "retrypending": 1, "unknown": 1},
            {"running": 1, "stopped": 1, "unknown": 1})

        # watched changes: a label nothing has any more leaves (unless Go pre-seeded it)
        await etcd.txn([], [Put(layout.node("n3"), encode(Node(node_id="n3", status="Ready"))),
                            Delete(layout.node("n2"))])
        await _put_workload(etcd, layout, "w2", status="Running", desired="Running")
        await etcd.txn([], [Delete(layout.spec("w3")), Delete(layout.status("w3"))])
        await _put_workload(etcd, layout, "w4", status="Pending", desired="Deleted")
        revision = await etcd.current_revision()
        await cluster.wait_for(revision, timeout=10)
        assert _gauges(metrics) == _expected(
            {"ready": 2, "unknown": 1}, {"running": 2, "pending": 1},
            {"running": 2, "deleted": 1})
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # a re-list (after compaction, say) recounts from what it lists
    await etcd.txn([], [Put(layout.node("n5"), encode(Node(node_id="n5", status="Cordoned"))),
                        Delete(layout.node("n1"))])
    await _put_workload(etcd, layout, "w1", status="Failed", desired="Stopped")
    await cluster.relist()
    assert _gauges(metrics) == _expected(
        {"ready": 1, "unknown": 1, "cordoned": 1}, {"running": 1, "pending": 1, "failed": 1},
        {"running": 1, "deleted": 1, "stopped": 1})
    etcd.close()


def _state_writes(metrics: Metrics) -> dict[str, float]:
    return {sample.labels["category"]: sample.value
            for family in metrics.state_store_writes.collect() for sample in family.samples
            if sample.name.endswith("_total")}


async def test_state_store_writes_count_the_go_categories_of_committed_puts(
        etcd_server, key_root):
    """spec, status and assignment puts, once each when committed (Go counted saves, not
    deletes); events without an outbox (no Redis) are event_dropped, as Go counted them."""
    etcd = AsyncEtcd([etcd_server.endpoint])
    layout = KeyLayout(key_root)
    metrics = Metrics()
    with_outbox = Committer(etcd, layout, metrics, outbox_enabled=True)
    without = Committer(etcd, layout, metrics, outbox_enabled=False)
    placed = Event(type="WorkloadScheduled", workload_id="w1", node_id="n1")
    try:
        await with_outbox.commit(Change(kind="test", puts=[
            Put(layout.spec("w1"), b"{}", category="spec"),
            Put(layout.status("w1"), b"{}", category="status"),
            Put(layout.assignment("w1"), b"{}", category="assignment"),
            Put(layout.allocation("n1"), b"{}", category="allocation"),
            Put(layout.node("n1"), b"{}", category="node")], events=[placed]))
        assert _state_writes(metrics) == {"spec": 1, "status": 1, "assignment": 1}
        await with_outbox.commit(Change(kind="test", puts=[
            Put(layout.status("w1"), b"{}", category="status")], deletes=[
            Delete(layout.spec("w1"), category="spec")]))
        assert _state_writes(metrics) == {"spec": 1, "status": 2, "assignment": 1}
        # no Redis: the events of a change are recorded nowhere, with or without puts
        await without.commit(Change(kind="test", puts=[
            Put(layout.status("w1"), b"{}", category="status")], events=[placed, placed]))
        await without.commit(Change(kind="test", events=[placed]))
        assert _state_writes(metrics) == {"spec": 1, "status": 3, "assignment": 1,
                                          "event_dropped": 3}
    finally:
        await with_outbox.aclose()
        await without.aclose()
        etcd.close()


async def _scrape(port: int) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            return str(answer.read().decode())

    return await asyncio.to_thread(get)


GO_STATE_SAMPLES = ('persys_scheduler_workloads_desired_state{desired_state="running"} 1.0',
                    'persys_scheduler_nodes_status{status="ready"} 1.0',
                    'persys_scheduler_nodes_status{status="notready"} 0.0',
                    'persys_scheduler_workloads_status{status="running"} 1.0',
                    'persys_scheduler_workloads_status{status="pending"} 0.0')


async def test_go_metric_families_are_exported_by_the_leader_and_the_gauges_by_a_standby(
        etcd_server, redis_server, key_root, stream_key):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             reconcile_interval_s=0.2, instance_id="replica-a")
    async with running_scheduler(settings) as sched:
        address = f"127.0.0.1:{sched.grpc_port}"
        async with running_fleet(address, 1) as fleet, control_stub(address) as stub:
            await fleet.wait_registered()
            await wait_for(lambda: sched.leader.is_leader, timeout=15, message="leadership")
            assert (await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
                workload_id="w-m", spec=container_spec()))).success

            def running() -> bool:
                item = sched.cluster.statuses.get("w-m")
                return item is not None and item.value.status == "Running"

            await wait_for(running, timeout=10, message="w-m Running")
            cycles = counter_total(sched.metrics.reconcile_cycles)
            await wait_for(lambda: counter_total(sched.metrics.reconcile_cycles) >= cycles + 2,
                           timeout=10, message="two more reconcile cycles")
            await wait_for(lambda: counter_total(sched.metrics.events_relayed) > 0, timeout=10,
                           message="an event relayed")
            text = await _scrape(sched.http.port)
            missing = [n for n in (
                'persys_scheduler_reconciliation_cycles_total{result="success"}',
                "persys_scheduler_reconciliation_cycle_duration_seconds_count",
                'persys_scheduler_state_store_writes_total{category="spec"}',
                'persys_scheduler_state_store_writes_total{category="status"}',
                'persys_scheduler_state_store_writes_total{category="assignment"}',
                'persys_scheduler_state_store_writes_total{category="event"}',
                *GO_STATE_SAMPLES) if n not in text]
            assert not missing, missing

            # a standby runs no cycle, yet its gauges say what the leader's say
            async with running_scheduler(settings.with_overrides(instance_id="replica-b")
                                         ) as standby:
                assert not standby.leader.is_leader
                text = await _scrape(standby.http.port)
                missing = [n for n in GO_STATE_SAMPLES if n not in text]
                assert not missing, missing


async def test_projection_lag_is_reported_per_projection(
        etcd_server, redis_server, key_root, stream_key) -> None:
    """``projection_lag_revisions{projection}`` (one of the fixed names of docs/compatibility.md,
    "Metrics") follows etcd's revision at each mode probe: set for every projection, and 0 for
    a projection that keeps up."""
    from tests.fixtures.harness import make_settings, running_scheduler

    settings = make_settings(etcd_server, redis_server, key_root, stream_key)
    async with running_scheduler(settings) as sched:
        registry = sched.metrics.registry

        def lag(name: str) -> float | None:
            return registry.get_sample_value("persys_scheduler_projection_lag_revisions",
                                             {"projection": name})

        names = [p.name for p in sched.cluster.projections]
        await wait_for(lambda: all(lag(n) is not None for n in names), timeout=15,
                       message="projection lag never reported")
        await wait_for(lambda: lag("nodes") == 0, timeout=15, message="lag never back to 0")
