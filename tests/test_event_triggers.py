"""Every event type of the catalogue, emitted by its real trigger, read back through ListEvents.

Each test drives real triggers against an in-process scheduler (and a simulated fleet where
agents are needed) on the real etcd and Redis servers of the fixtures, then reads the events back
through the public ``ListEvents`` RPC, i.e. from the Redis stream the relay appended them to.
Every event read is checked against the details keys ``docs/events.md`` documents for its type
(parsed from the document's table, so the test and the document cannot drift apart silently):
no undocumented key, every documented key present (``a or b``: at least one; ``(when known)``:
optional).

Which test covers which type is in ``COVERAGE``; ``test_every_catalogued_type_is_covered`` keeps
it equal to ``CATALOGUE`` and to the document's table.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import grpc
import pytest

from eventsource.etcd import AsyncEtcd, Put
from eventsource.events import CATALOGUE, EVENT_TYPES, parse_rfc3339, parse_stream_id
from eventsource.keys import KeyLayout
from eventsource.stream.clients import writer_client
from handlers.app.server import Scheduler
from handlers.reconcile.planner.workload import REAPPLY
from handlers.settings.config import Settings
from ops.devstack.etcd import EtcdProcess
from ops.devstack.redis import RedisProcess
from ops.sim.config import NodeBehaviour
from proto.persys.control.v1 import control_pb2 as pb
from proto.persys.control.v1.control_pb2_grpc import AgentControlStub
from tests.fixtures.harness import container_spec, control_stub, make_settings, running_scheduler
from tests.fixtures.reconcile import QUIET, Stack, last_apply, stack
from tests.fixtures.waiting import wait_for

DOCS = Path(__file__).resolve().parents[1] / "docs" / "events.md"

#: which test below drives the real trigger of each type and asserts its details keys
COVERAGE: dict[str, str] = {
    "NodeJoined": "test_node_commands_and_liveness",
    "NodeTainted": "test_node_commands_and_liveness",
    "NodeUntainted": "test_node_commands_and_liveness",
    "NodeLabelSet": "test_node_commands_and_liveness",
    "NodeLabelDeleted": "test_node_commands_and_liveness",
    "NodeCapacityChanged": "test_node_commands_and_liveness",
    "NodeDraining": "test_node_commands_and_liveness",
    "Relocated": "test_node_commands_and_liveness",
    "NodeReady": "test_node_commands_and_liveness",
    "NodeLost": "test_node_commands_and_liveness",
    "Rescheduled": "test_lost_node_fails_over_and_is_collected",
    "RescheduleSkipped": "test_lost_node_fails_over_and_is_collected",
    "NodeLeft": "test_lost_node_fails_over_and_is_collected",
    "WorkloadScheduled": "test_workload_lifecycle_drift_and_retry_budget",
    "DriftDetected": "test_workload_lifecycle_drift_and_retry_budget",
    "WorkloadDeleted": "test_workload_lifecycle_drift_and_retry_budget",
    "RetryTriggered": "test_workload_lifecycle_drift_and_retry_budget",
    "WorkloadFailed": "test_workload_lifecycle_drift_and_retry_budget",
    "WorkloadPending": "test_an_unplaceable_apply_is_pending_with_its_refusals",
    "LeaderElected": "test_leadership_mode_changes_and_lost_stream_entries",
    "LeaderLost": "test_leadership_mode_changes_and_lost_stream_entries",
    "SchedulerModeChanged": "test_leadership_mode_changes_and_lost_stream_entries",
    "EventsGap": "test_leadership_mode_changes_and_lost_stream_entries",
}
# also: EventsGap with ``dropped`` (outbox overflow) in
# test_outbox_overflow_while_redis_is_down_is_marked_by_one_gap, and the documented keys of
# RetryTriggered for its other triggers (RetryWorkload, a failure after the grace window) in
# test_retry_triggered_carries_the_documented_keys_for_every_trigger, which FAILS at the time of
# writing: those events lack keys docs/events.md lists (see that test's assertion message)

#: a workload that must not move (persistence class node-local)
NODE_LOCAL = {"persys.storage.local": "true"}
#: heartbeats minutes apart: the state a test injects on an agent is not repaired by one
RARE_BEATS = {"node_lease_ttl_s": 3600, "heartbeat_interval_s": 600}

View = pb.SchedulerEventView


# -- the documented details keys ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Documented:
    """The details keys of one type in docs/events.md."""

    required: frozenset[str]
    optional: frozenset[str]
    #: ``a or b``: at least one of them
    one_of: tuple[frozenset[str], ...]

    @property
    def allowed(self) -> frozenset[str]:
        return self.required.union(self.optional, *self.one_of)


def _top_level_parts(cell: str) -> list[str]:
    """``a, b (`x`, `y`), c`` -> ``["a", "b (`x`, `y`)", "c"]``."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in cell:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _name(text: str) -> str:
    match = re.match(r"`?([a-z_]+)", text.strip())
    assert match is not None, f"docs/events.md: cannot read a details key from {text!r}"
    return match.group(1)


def documented_keys() -> dict[str, Documented]:
    out: dict[str, Documented] = {}
    for line in DOCS.read_text().splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] == "type" or set(cells[0]) <= {"-"}:
            continue
        required: set[str] = set()
        optional: set[str] = set()
        one_of: list[frozenset[str]] = []
        if cells[2] not in ("—", "-", ""):
            for part in _top_level_parts(cells[2]):
                if " or " in part:
                    one_of.append(frozenset(_name(p) for p in part.split(" or ")))
                elif "when known" in part:
                    optional.add(_name(part))
                else:
                    required.add(_name(part))
        out[cells[0]] = Documented(frozenset(required), frozenset(optional), tuple(one_of))
    return out


DOC = documented_keys()


def doc_problems(view: View) -> list[str]:
    """How the view's details differ from docs/events.md ([] when they agree)."""
    doc = DOC[view.type]
    keys = set(view.details) - {"event_id", "trace_id"}
    problems: list[str] = []
    if keys - doc.allowed:
        problems.append(f"undocumented keys {sorted(keys - doc.allowed)}")
    if doc.required - keys:
        problems.append(f"documented keys missing {sorted(doc.required - keys)}")
    problems += [f"none of {sorted(g)}" for g in doc.one_of if not keys & g]
    return problems


def assert_documented(*views: View) -> None:
    """Each view is a real stream entry whose details carry exactly what the docs list."""
    assert views, "no event to check"
    for view in views:
        assert view.type in DOC, f"{view.type} is not in docs/events.md"
        assert view.details.get("event_id"), f"{view.type} {view.id}: no event_id (not relayed?)"
        problems = doc_problems(view)
        assert not problems, (
            f"{view.type} (reason {view.reason!r}) details {dict(view.details)}: "
            f"{'; '.join(problems)} (docs/events.md)")


# -- reading events back ------------------------------------------------------------------------


async def await_events(stub: AgentControlStub, event_type: str, *, n: int = 1,
                       where: Callable[[View], bool] | None = None, timeout: float = 15.0,
                       **filters: str) -> list[View]:
    """Wait until ListEvents returns at least ``n`` events of ``event_type`` matching ``where``
    (and the filters); return them in stream order. ListEvents passes EventsGap entries through
    every filter, so the type is checked here as well."""

    async def probe() -> list[View] | None:
        try:
            resp = await stub.ListEvents(pb.ListEventsRequest(limit=1000, type=event_type,
                                                              **filters))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:  # Redis coming back
                return None
            raise
        hits = [e for e in resp.events if e.type == event_type and (where is None or where(e))]
        return hits if len(hits) >= n else None

    found = await wait_for(probe, timeout=timeout, message=f"{n} x {event_type} {filters}")
    return found


def plain(view: View) -> dict[str, str]:
    """The details without the ``event_id`` every relayed view carries (and the ``trace_id``
    of a traced one)."""
    return {k: v for k, v in view.details.items() if k not in ("event_id", "trace_id")}


def after(view: View, key: str) -> datetime:
    """A time in the details, parsed (RFC3339)."""
    moment = parse_rfc3339(view.details[key])
    assert moment is not None, f"{view.type}: details[{key!r}] = {view.details[key]!r}"
    return moment


def grpc_address(sched: Scheduler) -> str:
    return f"127.0.0.1:{sched.grpc_port}"


def local_spec() -> pb.WorkloadSpec:
    spec = container_spec()
    spec.metadata.update(NODE_LOCAL)
    return spec


async def taint(stub: AgentControlStub, node_id: str) -> None:
    resp = await stub.TaintNode(pb.TaintNodeRequest(node_id=node_id, taint=pb.NodeTaint(
        key="hold", value="event-test", effect="NoSchedule")))
    assert resp.accepted, resp.message


async def untaint(stub: AgentControlStub, node_id: str) -> None:
    resp = await stub.UntaintNode(pb.UntaintNodeRequest(node_id=node_id, key="hold",
                                                        effect="NoSchedule"))
    assert resp.accepted, resp.message


def node_status(s: Stack, node_id: str) -> str | None:
    item = s.sched.cluster.nodes.get(node_id)
    return item.value.status if item is not None else None


# -- the catalogue, the document and this file agree --------------------------------------------


def test_every_catalogued_type_is_covered() -> None:
    assert set(DOC) == EVENT_TYPES, "docs/events.md and CATALOGUE list different types"
    assert set(COVERAGE) == set(CATALOGUE), "a catalogued type has no trigger test here"
    for name in set(COVERAGE.values()):
        assert callable(globals().get(name)), f"COVERAGE names a missing test {name}"


# -- node commands and liveness -----------------------------------------------------------------


async def test_node_commands_and_liveness(
        etcd_server: EtcdProcess, redis_server: RedisProcess, key_root: str,
        stream_key: str) -> None:
    """NodeJoined (RegisterNode), NodeTainted/NodeUntainted, NodeLabelSet/NodeLabelDeleted,
    NodeDraining + Relocated (DrainNode), NodeReady (UndrainNode; a heartbeat from a NotReady
    node), NodeLost (liveness lease expired; agent unreachable in a reconcile cycle)."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, node_lease_ttl_s=3,
                             **QUIET)
    async with stack(settings, 2) as s:
        stub = s.stub
        # a node that registers and then never heartbeats; too small to take any workload
        resp = await stub.RegisterNode(pb.RegisterNodeRequest(
            node_id="ghost", grpc_endpoint="127.0.0.1:1",
            capabilities=pb.NodeCapabilities(cpu_total_millicores=1, memory_total_mb=1,
                                             supported_workload_types=["container"])))
        assert resp.accepted, resp.reason
        # the live node declares another capacity
        resp = await stub.RegisterNode(pb.RegisterNodeRequest(
            node_id="ghost", grpc_endpoint="127.0.0.1:1",
            capabilities=pb.NodeCapabilities(cpu_total_millicores=2, memory_total_mb=3,
                                             supported_workload_types=["container"])))
        assert resp.accepted, resp.reason
        [capacity] = await await_events(stub, "NodeCapacityChanged", node_id="ghost")
        assert_documented(capacity)
        assert plain(capacity) == {"cpu_millicores": "2", "memory_mb": "3",
                                        "previous_cpu_millicores": "1",
                                        "previous_memory_mb": "1"}

        endpoints = {n.node_id: n.endpoint for n in s.fleet.nodes} | {"ghost": "127.0.0.1:1"}
        joined = await await_events(stub, "NodeJoined", n=3)
        assert_documented(*joined)
        assert {e.node_id: e.details["agent_endpoint"] for e in joined} == endpoints
        assert {(e.details["status"], e.details["scheduler_shard"]) for e in joined} == {
            ("Ready", settings.shard_key)}

        # one movable and one node-local workload on the same node x: the other node is tainted
        # while the node-local one is placed
        await s.apply(["mover"])
        await s.caught_up()
        x = s.status("mover").node_id
        other = next(n.node_id for n in s.fleet.nodes if n.node_id != x)
        await taint(stub, other)
        await s.caught_up()
        await s.apply(["pinned"], spec_of=local_spec)
        await s.caught_up()
        assert s.status("pinned").node_id == x
        await untaint(stub, other)
        [tainted] = await await_events(stub, "NodeTainted", node_id=other)
        assert_documented(tainted)
        assert plain(tainted) == {"source": "operator", "key": "hold", "value": "event-test",
                                  "effect": "NoSchedule"}
        [untainted] = await await_events(stub, "NodeUntainted", node_id=other)
        assert_documented(untainted)
        assert (untainted.details["key"], untainted.details["effect"]) == ("hold", "NoSchedule")

        resp = await stub.SetNodeLabel(pb.SetNodeLabelRequest(node_id=x, key="tier",
                                                              value="gold"))
        assert resp.accepted, resp.message
        resp = await stub.DeleteNodeLabel(pb.DeleteNodeLabelRequest(node_id=x, key="tier"))
        assert resp.accepted, resp.message
        [label_set] = await await_events(stub, "NodeLabelSet", node_id=x)
        assert_documented(label_set)
        assert (label_set.details["source"], label_set.details["key"],
                label_set.details["value"]) == ("operator", "tier", "gold")
        [label_deleted] = await await_events(stub, "NodeLabelDeleted", node_id=x)
        assert_documented(label_deleted)
        assert (label_deleted.details["source"], label_deleted.details["key"]) == (
            "operator", "tier")

        await s.caught_up()
        drained = await stub.DrainNode(pb.DrainNodeRequest(node_id=x, reason="maintenance"))
        assert drained.accepted, drained.message
        assert drained.relocated_workloads == 1
        [draining] = await await_events(stub, "NodeDraining", node_id=x)
        assert_documented(draining)
        assert draining.details["source"] == "operator"
        assert draining.reason == "maintenance"
        [relocated] = await await_events(stub, "Relocated", workload_id="mover")
        assert_documented(relocated)
        assert (relocated.node_id, relocated.details["previous_node"]) == (other, x)
        # the node-local workload stays (its RescheduleSkipped is asserted with the failover)
        [skipped] = await await_events(stub, "RescheduleSkipped", workload_id="pinned")
        assert_documented(skipped)
        assert skipped.details["persistence_class"] == "node-local"

        undrained = await stub.UndrainNode(pb.UndrainNodeRequest(node_id=x, reason="done"))
        assert undrained.accepted, undrained.message
        [ready] = await await_events(stub, "NodeReady", node_id=x)
        assert_documented(ready)
        assert (ready.details["source"], ready.reason) == ("operator", "done")

        # the ghost's liveness lease expires: the node monitor marks it NotReady
        await wait_for(lambda: node_status(s, "ghost") == "NotReady", timeout=20,
                       message="ghost NotReady after its lease expired")
        [lost] = await await_events(stub, "NodeLost", node_id="ghost")
        assert_documented(lost)
        assert (lost.details["status"], lost.details["source"]) == ("NotReady", "monitor")
        # it heartbeats again: Ready, with a heartbeat as the source
        beat = await stub.Heartbeat(pb.HeartbeatRequest(node_id="ghost"))
        assert beat.acknowledged
        [back] = await await_events(stub, "NodeReady", node_id="ghost")
        assert_documented(back)
        assert back.details["source"] == "heartbeat"

        # Ready and alive but unreachable: a reconcile cycle marks it NotReady (source reconciler)
        async def lost_by_reconcile() -> bool:
            if node_status(s, "ghost") != "Ready":
                await stub.Heartbeat(pb.HeartbeatRequest(node_id="ghost"))
            await s.caught_up()
            report = await s.loops.reconcile.run_once()
            return "ghost" in report.unreachable

        await wait_for(lost_by_reconcile, timeout=20, interval=0.1,
                       message="a reconcile cycle finds the ghost unreachable")
        by_reconciler = await await_events(stub, "NodeLost", node_id="ghost",
                                           where=lambda e: e.details["source"] == "reconciler")
        assert_documented(*by_reconciler)
        assert by_reconciler[0].details["status"] == "NotReady"


# -- failover and node GC -----------------------------------------------------------------------


async def test_lost_node_fails_over_and_is_collected(
        etcd_server: EtcdProcess, redis_server: RedisProcess, key_root: str,
        stream_key: str) -> None:
    """A crashed node: NodeLost, Rescheduled for its movable workloads, RescheduleSkipped for
    its node-local one, and NodeLeft once it was NotReady for SCHEDULER_NODE_GC_AFTER."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, node_lease_ttl_s=3,
                             node_gc_after_s=2.0, **QUIET)
    async with stack(settings, 3) as s:
        stub = s.stub
        await s.apply(["pinned"], spec_of=local_spec)
        await s.caught_up()
        victim_id = s.status("pinned").node_id
        others = sorted(n.node_id for n in s.fleet.nodes if n.node_id != victim_id)
        for node_id in others:
            await taint(stub, node_id)
        await s.caught_up()
        moving = ["m-1", "m-2"]
        await s.apply(moving)
        await s.caught_up()
        assert {s.status(w).node_id for w in moving} == {victim_id}
        for node_id in others:
            await untaint(stub, node_id)
        await s.caught_up()
        await s.running([*moving, "pinned"])

        await s.fleet.node(victim_id).crash()
        [lost] = await await_events(stub, "NodeLost", node_id=victim_id, timeout=20)
        assert_documented(lost)
        assert (lost.details["status"], lost.details["source"]) == ("NotReady", "monitor")
        rescheduled = await await_events(stub, "Rescheduled", n=len(moving))
        assert_documented(*rescheduled)
        assert sorted(e.workload_id for e in rescheduled) == moving
        assert {e.details["previous_node"] for e in rescheduled} == {victim_id}
        assert {e.node_id for e in rescheduled} <= set(others)
        [skipped] = await await_events(stub, "RescheduleSkipped", workload_id="pinned")
        assert_documented(skipped)
        assert (skipped.node_id, skipped.details["persistence_class"]) == (victim_id,
                                                                          "node-local")

        [left] = await await_events(stub, "NodeLeft", node_id=victim_id, timeout=20)
        assert_documented(left)
        assert left.details["status"] == "Removed"
        assert parse_stream_id(left.id) > parse_stream_id(lost.id)
        await s.caught_up()
        assert s.sched.cluster.nodes.get(victim_id) is None


# -- workloads: apply, drift, delete, retry budget ----------------------------------------------


async def test_workload_lifecycle_drift_and_retry_budget(
        etcd_server: EtcdProcess, redis_server: RedisProcess, key_root: str,
        stream_key: str) -> None:
    """WorkloadScheduled (create, reconcile re-apply, desired-state change), DriftDetected (a
    workload killed on its agent), WorkloadDeleted (DeleteWorkload), RetryTriggered and
    WorkloadFailed (an agent failing every apply until the retry budget is exhausted), and
    RetryTriggered again from RetryWorkload."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **RARE_BEATS,
                             **QUIET)
    behaviour = NodeBehaviour(apply_latency_s=0.02)
    async with stack(settings, 1, behaviour=behaviour, heartbeat_interval_s=900) as s:
        stub = s.stub
        node = s.fleet.nodes[0]
        await s.apply(["web"])
        [created] = await await_events(stub, "WorkloadScheduled", workload_id="web")
        assert_documented(created)
        await s.caught_up()
        spec = s.sched.cluster.specs.get("web")
        assert spec is not None
        revision = spec.value.revision_id
        assert (created.reason, created.node_id, created.details["revision_id"]) == (
            "Workload created", node.node_id, revision)

        # drift: the agent lost the workload; a drift cycle records it and re-applies
        await wait_for(lambda: node.workload_state("web") == "Running", timeout=10)
        assert node.kill_workloads(["web"]) == 1
        now = s.sched.clock.now() + timedelta(seconds=60)
        report = await s.loops.reconcile.run_once(now=now, drift=True)
        assert [(f.drift_type, f.workload_id) for f in report.drifts] == [
            ("missing_on_agent", "web")]
        [drift] = await await_events(stub, "DriftDetected", workload_id="web")
        assert_documented(drift)
        assert (drift.reason, drift.node_id) == ("missing_on_agent", node.node_id)
        assert (drift.details["action"], drift.details["resolved"],
                drift.details["last_error"]) == ("retry_and_reconcile", "true", "")
        [reapplied] = await await_events(stub, "WorkloadScheduled", workload_id="web",
                                         where=lambda e: e.reason == REAPPLY)
        assert_documented(reapplied)
        assert (reapplied.details["revision_id"], reapplied.details["desired_state"]) == (
            revision, "Running")

        # desired-state change (no spec)
        resp = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(workload_id="web",
                                                                desired_state="Stopped"))
        assert resp.success, resp.error_message
        [stopping] = await await_events(stub, "WorkloadScheduled", workload_id="web",
                                        where=lambda e: e.reason == "Desired state updated")
        assert_documented(stopping)
        assert plain(stopping) == {"desired_state": "Stopped"}

        # delete: the agent deletes it, then the state is removed
        resp = await stub.DeleteWorkload(pb.DeleteWorkloadRequest(workload_id="web"))
        assert resp.success, resp.error_message
        [deleted] = await await_events(stub, "WorkloadDeleted", workload_id="web")
        assert_documented(deleted)
        assert deleted.node_id == node.node_id
        assert node.workload_state("web") is None

        # the agent now fails every apply (the fleet shares this NodeBehaviour instance)
        behaviour.failure_rate = 1.0
        await s.apply(["bad"])
        await wait_for(lambda: node.workload_state("bad") == "Failed", timeout=10)
        await s.caught_up()
        # cycles far apart: every retry backoff has passed; the first failure opens the 2-minute
        # grace window, every later one counts against the budget of 5
        when = last_apply(s.status("bad")) + timedelta(seconds=1)
        for _ in range(20):
            await wait_for(lambda: node.workload_state("bad") == "Failed", timeout=10)
            report = await s.loops.reconcile.run_once(now=when)
            assert report.skipped == "", report
            await s.caught_up()
            if s.status("bad").status == "Failed" and s.status("bad").retry.attempts >= 5:
                break
            when += timedelta(seconds=300)
        else:
            raise AssertionError(f"retry budget never exhausted: {s.status('bad')}")
        [failed] = await await_events(stub, "WorkloadFailed", workload_id="bad")
        assert_documented(failed)
        assert (failed.node_id, failed.details["attempts"]) == (node.node_id, "5")
        budget = await await_events(stub, "RetryTriggered", workload_id="bad", n=4)
        assert [e.details["attempts"] for e in budget] == ["1", "2", "3", "4"]
        # the first failure, inside the grace window, carries every documented key
        assert_documented(budget[0])
        assert after(budget[0], "failure_grace_until") > after(budget[0], "next_retry_at")

        # an operator retries the Failed workload
        resp = await stub.RetryWorkload(pb.RetryWorkloadRequest(workload_id="bad"))
        assert resp.accepted
        [retried] = await await_events(stub, "RetryTriggered", workload_id="bad",
                                       where=lambda e: e.reason == "retry requested")
        assert retried.details["attempts"] == "0"
        assert retried.details.get("event_id")
        assert set(retried.details) - {"event_id"} <= DOC["RetryTriggered"].allowed


async def test_an_unplaceable_apply_is_pending_with_its_refusals(
        etcd_server: EtcdProcess, redis_server: RedisProcess, key_root: str,
        stream_key: str) -> None:
    """WorkloadPending: an ApplyWorkload that fits no node is stored Pending, once."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 1) as s:
        resp = await s.stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="huge", spec=container_spec(cpu_m=10_000_000)))
        assert not resp.success
        assert resp.error_message.startswith("stored as Pending")
        [pending] = await await_events(s.stub, "WorkloadPending", workload_id="huge")
        assert_documented(pending)
        assert pending.reason.startswith("no suitable node: 0/1 nodes fit: 1 insufficient cpu")
        assert pending.details["refusals"] == "insufficient cpu"


async def test_retry_triggered_carries_the_documented_keys_for_every_trigger(
        etcd_server: EtcdProcess, redis_server: RedisProcess, key_root: str,
        stream_key: str) -> None:
    """RetryTriggered carries ``attempts`` and ``next_retry_at`` from both triggers
    (RetryWorkload and the failure retry schedule), ``failure_grace_until`` while a grace window
    is open: check RetryWorkload's event and those of failures inside and after the window."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **RARE_BEATS,
                             **QUIET)
    behaviour = NodeBehaviour(apply_latency_s=0.02, failure_rate=1.0)
    async with stack(settings, 1, behaviour=behaviour, heartbeat_interval_s=900) as s:
        stub = s.stub
        node = s.fleet.nodes[0]
        await s.apply(["flaky"])
        await wait_for(lambda: node.workload_state("flaky") == "Failed", timeout=10)
        await s.caught_up()
        # count (inside the grace window), re-apply, count (after it)
        when = last_apply(s.status("flaky")) + timedelta(seconds=1)
        for step in range(3):
            await wait_for(lambda: node.workload_state("flaky") == "Failed", timeout=10)
            report = await s.loops.reconcile.run_once(now=when + timedelta(seconds=300 * step))
            assert report.skipped == "", report
            await s.caught_up()
        in_grace, after_grace = await await_events(stub, "RetryTriggered", workload_id="flaky",
                                                   n=2)
        resp = await stub.RetryWorkload(pb.RetryWorkloadRequest(workload_id="flaky"))
        assert resp.accepted
        [by_rpc] = await await_events(stub, "RetryTriggered", workload_id="flaky",
                                      where=lambda e: e.reason == "retry requested")
        assert_documented(in_grace)
        problems = {name: doc_problems(view) for name, view in (
            ("failure counted after the grace window", after_grace),
            ("RetryWorkload", by_rpc))}
        assert not any(problems.values()), (
            "RetryTriggered events differ from the details keys docs/events.md "
            f"lists for the type: {problems}; details seen: after grace "
            f"{dict(after_grace.details)}, RetryWorkload {dict(by_rpc.details)}")


# -- leadership, modes and a stream that lost its entries ---------------------------------------


async def test_leadership_mode_changes_and_lost_stream_entries(
        etcd_server: EtcdProcess, redis_server: RedisProcess, key_root: str,
        stream_key: str) -> None:
    """LeaderElected (leadership gained), LeaderLost (clean stop while leading),
    SchedulerModeChanged (normal -> recovery on a cluster whose state is gone; recovery ->
    normal once the operator confirms), EventsGap (the relay finds the stream lost entries)."""

    def settings_for(instance_id: str) -> Settings:
        return make_settings(etcd_server, redis_server, key_root, stream_key,
                             instance_id=instance_id)

    async with running_scheduler(settings_for("replica-a")) as a, \
            control_stub(grpc_address(a)) as stub:
        [elected_a] = await await_events(
            stub, "LeaderElected", where=lambda e: e.details["instance_id"] == "replica-a")
        assert_documented(elected_a)
        assert elected_a.details["term"] == str(a.leader.term)
        assert a.mode.mode == "normal"
    # replica-a stopped while leading: it recorded LeaderLost before resigning

    # the cluster was initialized once, and its state is gone (nodes, workloads, assignments)
    etcd = AsyncEtcd([etcd_server.endpoint])
    try:
        result = await etcd.txn([], [Put(KeyLayout(key_root).initialized,
                                         b"2026-01-01T00:00:00Z")])
        assert result.succeeded
    finally:
        etcd.close()

    async with running_scheduler(settings_for("replica-b")) as b, \
            control_stub(grpc_address(b)) as stub:
        [lost_a] = await await_events(
            stub, "LeaderLost", where=lambda e: e.details["instance_id"] == "replica-a")
        assert_documented(lost_a)
        assert (lost_a.details["election_key"], lost_a.details["term"]) == (
            elected_a.details["election_key"], elected_a.details["term"])
        [elected_b] = await await_events(
            stub, "LeaderElected", where=lambda e: e.details["instance_id"] == "replica-b")
        assert_documented(elected_b)
        assert int(elected_b.details["term"]) > int(elected_a.details["term"])

        def mode_change(old: str, new: str) -> Callable[[View], bool]:
            return lambda e: (e.details["from"], e.details["to"],
                              e.details["instance_id"]) == (old, new, "replica-b")

        [to_recovery] = await await_events(stub, "SchedulerModeChanged",
                                           where=mode_change("normal", "recovery"))
        assert_documented(to_recovery)
        assert b.mode.mode == "recovery"
        # the operator confirms that the empty state is real, with the command the reason names
        assert "persys-scheduler confirm-empty-state" in b.mode.reason
        confirm = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ops.cli", "confirm-empty-state",
            "--etcd", etcd_server.endpoint, "--root", key_root,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(confirm.communicate(), 60)
        assert confirm.returncode == 0, err.decode()
        assert b"confirmed" in out
        [to_normal] = await await_events(stub, "SchedulerModeChanged",
                                         where=mode_change("recovery", "normal"))
        assert_documented(to_normal)
        assert after(to_normal, "changed_at") >= after(to_recovery, "changed_at")
        assert b.mode.mode == "normal"
        newest = (await stub.ListEvents(pb.ListEventsRequest(limit=1))).events[-1].id

    # Redis lost the stream while no relay ran
    client = writer_client(redis_server.url)
    try:
        assert await client.delete(stream_key) == 1
    finally:
        await client.aclose()

    async with running_scheduler(settings_for("replica-c")) as c, \
            control_stub(grpc_address(c)) as stub:
        [gap] = await await_events(stub, "EventsGap")
        assert_documented(gap)
        assert gap.reason == "redis-lost-entries"
        assert gap.details["from"] == "0-1"
        assert parse_stream_id(gap.details["to"]) >= parse_stream_id(newest)
        assert "dropped" not in gap.details  # not known: Redis lost them
        # what follows the gap is relayed as usual
        [elected_c] = await await_events(
            stub, "LeaderElected", where=lambda e: e.details["instance_id"] == "replica-c")
        assert parse_stream_id(elected_c.id) > parse_stream_id(gap.id)


@pytest.mark.fault
async def test_outbox_overflow_while_redis_is_down_is_marked_by_one_gap(
        etcd_server: EtcdProcess, redis_private: RedisProcess, key_root: str,
        stream_key: str) -> None:
    """EventsGap with ``dropped``: Redis down, more events than SCHEDULER_EVENT_OUTBOX_MAX."""
    # no reconcile cycles: the node's endpoint is unreachable, and a cycle would add NodeLost
    settings = make_settings(etcd_server, redis_private, key_root, stream_key,
                             event_outbox_max=5, node_lease_ttl_s=3600, **QUIET)
    async with running_scheduler(settings) as sched, \
            control_stub(grpc_address(sched)) as stub:
        resp = await stub.RegisterNode(pb.RegisterNodeRequest(
            node_id="ov-node", grpc_endpoint="127.0.0.1:1",
            capabilities=pb.NodeCapabilities(cpu_total_millicores=1000, memory_total_mb=1024)))
        assert resp.accepted, resp.reason
        await await_events(stub, "NodeJoined", node_id="ov-node")
        await await_events(stub, "LeaderElected")

        await asyncio.to_thread(redis_private.kill)
        for i in range(15):
            resp = await stub.SetNodeLabel(pb.SetNodeLabelRequest(node_id="ov-node", key="seq",
                                                                  value=str(i)))
            assert resp.accepted, "state changes go on while Redis is down"

        def dropped() -> float:
            value = sched.metrics.registry.get_sample_value(
                "persys_scheduler_events_dropped_total")
            return value or 0.0

        await wait_for(lambda: dropped() >= 10, timeout=20, message="outbox overflow handled")
        await asyncio.to_thread(redis_private.restart)

        [gap] = await await_events(stub, "EventsGap", timeout=30)
        assert_documented(gap)
        assert gap.reason == "outbox-overflow"
        # exactly what was dropped is counted: 10 labels, plus any other event that was
        # still waiting in the outbox when Redis went away (the oldest go first)
        assert gap.details["dropped"] == str(int(dropped()))
        await await_events(stub, "NodeLabelSet", node_id="ov-node", timeout=30,
                           where=lambda e: e.details["value"] == "14")
        labels = await await_events(stub, "NodeLabelSet", node_id="ov-node")
        kept = len(labels)
        assert [e.details["value"] for e in labels] == [str(i) for i in range(15 - kept, 15)]
        assert 15 - kept <= int(dropped()) <= 15 - kept + 2
        assert_documented(*labels)
        assert parse_stream_id(gap.id) < parse_stream_id(labels[0].id)
