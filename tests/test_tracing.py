"""Traces, end to end: a scheduler and its simulated agents exporting to a real Jaeger, read
back through Jaeger's own query API.

The Jaeger is the real one (v2, in-memory storage), built once from its Go module into
``.cache/bin/jaeger`` (``ops/jaeger.py``), started per test on loopback ports of its own.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry import trace as otel_trace

from eventsource.events import Event, entry_data
from eventsource.tracing import parent_of, trace_id_of
from handlers.reconcile.registration import loops_of
from handlers.settings.config import load_settings
from handlers.settings.reader import ConfigError
from ops.jaeger import JaegerProcess, build_jaeger, find_jaeger_binary
from ops.sim.config import SimTls
from proto.persys.control.v1 import control_pb2 as pb
from proto.persys.control.v1 import control_pb2_grpc
from tests.fixtures.certs import TestCA
from tests.fixtures.harness import (
    container_spec,
    leading_fleet,
    make_settings,
    running_fleet,
    running_scheduler,
)
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.slow

SERVER_SPAN = "persys.control.v1.AgentControl/ApplyWorkload"
AGENT_APPLY = "persys.agent.v1.AgentService/ApplyWorkload"
AGENT_LIST = "persys.agent.v1.AgentService/ListWorkloads"


@pytest.fixture
def jaeger(tmp_path) -> Iterator[JaegerProcess]:
    binary = find_jaeger_binary()
    if binary is None:
        # first run on a fresh machine: build it from the Go module proxy (minutes, once)
        try:
            binary = build_jaeger()
        except (OSError, subprocess.SubprocessError) as exc:
            pytest.fail(f"this test needs a real Jaeger and it could not be built: {exc}")
    proc = JaegerProcess(binary).start(tmp_path / "jaeger")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def quick_export(monkeypatch):
    """The SDK's batch processor exports every 100 ms instead of 5 s (a standard variable the
    scheduler leaves to the SDK)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")


# -- reading Jaeger's answers ------------------------------------------------------------------

def _tags(span: dict[str, Any]) -> dict[str, Any]:
    return {t["key"]: t["value"] for t in span.get("tags", [])}


def _service(found: dict[str, Any], span: dict[str, Any]) -> str:
    return str(found["processes"][span["processID"]]["serviceName"])


def _parent(span: dict[str, Any]) -> str | None:
    for ref in span.get("references", []):
        if ref["refType"] == "CHILD_OF":
            return str(ref["spanID"])
    return None


def _spans(found: dict[str, Any], name: str, service: str = "") -> list[dict[str, Any]]:
    return [s for s in found["spans"] if s["operationName"] == name
            and (not service or _service(found, s) == service)]


async def _query(jaeger: JaegerProcess, method: str, *args: Any) -> Any:
    """Jaeger's HTTP API, off the event loop (the scheduler under test runs on it)."""
    return await asyncio.to_thread(getattr(jaeger, method), *args)


async def _scheduled_event(stub: Any, workload_id: str) -> Any:
    async def find() -> Any:
        answer = await stub.ListEvents(pb.ListEventsRequest(type="WorkloadScheduled",
                                                            workload_id=workload_id))
        return answer.events[0] if answer.events else None

    return await wait_for(find, timeout=15, message="no WorkloadScheduled event")


# -- the end-to-end trace ----------------------------------------------------------------------

async def test_one_apply_is_one_trace_through_commit_agent_and_event(
        etcd_server, redis_server, key_root, stream_key, jaeger, quick_export):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             trace_endpoint=jaeger.traces_url, reconcile_interval_s=30.0)
    async with leading_fleet(settings, 1, otlp_endpoint=jaeger.otlp_endpoint) as (
            scheduler, fleet, stub):
        assert scheduler.tracing.enabled
        node_id = fleet.nodes[0].node_id
        answer = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="traced-1", spec=container_spec(), desired_state="Running"))
        assert answer.success, answer.error_message
        await wait_for(lambda: fleet.nodes[0].callers, timeout=10, message="no agent apply")

        event = await _scheduled_event(stub, "traced-1")
        trace_id = event.details["trace_id"]
        assert len(trace_id) == 32

        def complete(found: dict[str, Any] | None) -> bool:
            if found is None:
                return False
            names = {(s["operationName"], _service(found, s)) for s in found["spans"]}
            return {(SERVER_SPAN, "persys-scheduler"), ("placement.decide", "persys-scheduler"),
                    ("placement.commit", "persys-scheduler"), ("etcd.txn", "persys-scheduler"),
                    (AGENT_APPLY, "persys-scheduler"), (AGENT_APPLY, "persys-agent-sim"),
                    ("relay.append", "persys-scheduler")} <= names

        async def whole_trace() -> dict[str, Any] | None:
            found = await _query(jaeger, "trace", trace_id)
            return found if complete(found) else None

        found = await wait_for(whole_trace, timeout=20, interval=0.2,
                               message="the trace never held every span")

    assert {s["traceID"] for s in found["spans"]} == {trace_id}
    [server] = _spans(found, SERVER_SPAN, "persys-scheduler")
    assert _parent(server) is None  # the client sent no context: the trace starts here
    tags = _tags(server)
    assert tags["span.kind"] == "server"
    assert tags["scheduler.workload_id"] == "traced-1"
    assert tags["scheduler.workload_type"] == "container"
    assert tags["scheduler.workload_desired_state"] == "Running"

    [decide] = _spans(found, "placement.decide")
    assert _parent(decide) == server["spanID"]
    assert _tags(decide)["scheduler.node_id"] == node_id

    [commit] = _spans(found, "placement.commit")
    assert _parent(commit) == server["spanID"]
    commit_tags = _tags(commit)
    assert commit_tags["scheduler.commit_outcome"] == "committed"
    # the waits for a batch and for a group commit, and the transaction, inside the commit
    assert commit_tags["scheduler.batch_wait_ms"] >= 0
    assert commit_tags["scheduler.group_wait_ms"] >= 0
    assert commit_tags["scheduler.batch_size"] == 1
    [txn] = _spans(found, "etcd.txn")
    assert _parent(txn) == commit["spanID"]
    assert _tags(txn)["scheduler.group_size"] >= 1
    assert commit["startTime"] <= txn["startTime"]
    assert txn["startTime"] + txn["duration"] <= commit["startTime"] + commit["duration"]

    [client] = _spans(found, AGENT_APPLY, "persys-scheduler")
    assert _tags(client)["span.kind"] == "client"
    assert _parent(client) == server["spanID"]
    assert _tags(client)["scheduler.node_id"] == node_id
    assert _tags(client)["scheduler.workload_id"] == "traced-1"
    # the agent's side, under the client span: the traceparent went in the call's metadata
    [agent] = _spans(found, AGENT_APPLY, "persys-agent-sim")
    assert _tags(agent)["span.kind"] == "server"
    assert _parent(agent) == client["spanID"]
    assert _tags(agent)["scheduler.node_id"] == node_id

    # the relay's append of the event, under the commit that wrote it
    appends = _spans(found, "relay.append")
    assert any(_tags(a)["scheduler.event_type"] == "WorkloadScheduled"
               and _tags(a)["scheduler.stream_id"] == event.id
               and _parent(a) == commit["spanID"] for a in appends)


async def test_an_update_is_traced_through_the_group_commit_to_the_agent(
        etcd_server, redis_server, key_root, stream_key, jaeger, quick_export):
    """An update commits through the group commit (not the placement batcher): its commit
    span holds the group wait and the transaction, and the agent apply that follows the
    commit is in the update's trace."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             trace_endpoint=jaeger.traces_url, reconcile_interval_s=30.0)
    async with leading_fleet(settings, 1, otlp_endpoint=jaeger.otlp_endpoint) as (
            _scheduler, fleet, stub):
        first = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="traced-u", spec=container_spec(image="nginx:1")))
        assert first.success
        await wait_for(lambda: fleet.nodes[0].callers, timeout=10, message="no agent apply")
        second = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="traced-u", spec=container_spec(image="nginx:2")))
        assert second.success, second.error_message

        async def update_event() -> Any:
            answer = await stub.ListEvents(pb.ListEventsRequest(type="WorkloadScheduled",
                                                                workload_id="traced-u"))
            return answer.events[1] if len(answer.events) > 1 else None

        event = await wait_for(update_event, timeout=15, message="no second event")
        trace_id = event.details["trace_id"]

        async def whole() -> Any:
            found = await _query(jaeger, "trace", trace_id)
            if found is None or not _spans(found, AGENT_APPLY, "persys-agent-sim") \
                    or not _spans(found, AGENT_APPLY, "persys-scheduler") \
                    or not _spans(found, "relay.append"):
                return None
            return found

        found = await wait_for(whole, timeout=20, interval=0.2,
                               message="the update's trace never held the agent's apply")
    [server] = _spans(found, SERVER_SPAN)
    commits = [c for c in _spans(found, "etcd.commit") if _parent(c) == server["spanID"]]
    assert commits
    committed = [c for c in commits if _tags(c).get("scheduler.commit_outcome") == "committed"]
    [commit] = committed
    assert _tags(commit)["scheduler.group_wait_ms"] >= 0
    [txn] = [s for s in _spans(found, "etcd.txn") if _parent(s) == commit["spanID"]]
    assert _tags(txn)["scheduler.txn_request"] in ("single", "group")
    [client] = _spans(found, AGENT_APPLY, "persys-scheduler")
    assert _parent(client) == server["spanID"]
    [agent] = _spans(found, AGENT_APPLY, "persys-agent-sim")
    assert _parent(agent) == client["spanID"]
    assert any(_parent(a) == commit["spanID"] for a in _spans(found, "relay.append"))


async def test_traced_with_mtls_both_ways_and_a_refused_caller(
        etcd_server, redis_server, key_root, stream_key, jaeger, quick_export, tmp_path):
    """With mTLS (the certificate interceptor inside the tracing ones, TLS to the agents) an
    operator's apply is traced to the agent's side, and an agent certificate refused an
    operator RPC leaves a server span with its PERMISSION_DENIED."""
    ca = TestCA(tmp_path / "ca")
    scheduler_cert = ca.issue("persys-scheduler", names=("127.0.0.1", "localhost"))
    operator = ca.issue("persysctl")
    agent = ca.issue("compute-agent", names=("127.0.0.1", "sim-node-00001"))
    settings = make_settings(
        etcd_server, redis_server, key_root, stream_key, insecure=False,
        tls_ca=str(ca.cert_path), tls_cert=str(scheduler_cert.cert_path),
        tls_key=str(scheduler_cert.key_path), agent_tls_enabled=True,
        reconcile_interval_s=30.0, trace_endpoint=jaeger.traces_url)
    async with running_scheduler(settings) as scheduler:
        address = f"127.0.0.1:{scheduler.grpc_port}"
        tls = SimTls(ca=ca.cert, cert=agent.cert, key=agent.key)
        async with running_fleet(address, 1, tls=tls, otlp_endpoint=jaeger.otlp_endpoint) as fleet:
            await fleet.wait_registered()
            await wait_for(lambda: scheduler.leader.is_leader, timeout=15, message="no leader")
            channels = []
            try:
                stubs = []
                for who in (operator, agent):
                    creds = grpc.ssl_channel_credentials(ca.cert, who.key, who.cert)
                    channel = grpc.aio.secure_channel(address, creds)
                    channels.append(channel)
                    stubs.append(control_pb2_grpc.AgentControlStub(channel))
                as_operator, as_agent = stubs
                answer = await as_operator.ApplyWorkload(pb.ApplyWorkloadRequest(
                    workload_id="tls-1", spec=container_spec()))
                assert answer.success, answer.error_message
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await as_agent.ApplyWorkload(pb.ApplyWorkloadRequest(
                        workload_id="tls-2", spec=container_spec()))
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                event = await _scheduled_event(as_operator, "tls-1")
            finally:
                for channel in channels:
                    await channel.close()
            trace_id = event.details["trace_id"]

            async def whole() -> Any:
                found = await _query(jaeger, "trace", trace_id)
                # the two processes export on their own: wait for both sides
                both = found and _spans(found, AGENT_APPLY, "persys-agent-sim") and _spans(
                    found, AGENT_APPLY, "persys-scheduler")
                return found if both else None

            found = await wait_for(whole, timeout=20, interval=0.2)

            async def denied() -> Any:
                traces = await _query(jaeger, "traces", "persys-scheduler", SERVER_SPAN)
                return [s for t in traces for s in t["spans"]
                        if _tags(s).get("scheduler.workload_id") == "tls-2"]

            [refused_span] = await wait_for(denied, timeout=20, interval=0.2)
    [client] = _spans(found, AGENT_APPLY, "persys-scheduler")
    [agent_side] = _spans(found, AGENT_APPLY, "persys-agent-sim")
    assert _parent(agent_side) == client["spanID"]
    # (the span's status stays unset: for a server span a client's fault is no error, as the
    # OpenTelemetry conventions have it)
    assert _tags(refused_span)["rpc.grpc.status_code"] == \
        grpc.StatusCode.PERMISSION_DENIED.value[0]


async def test_a_callers_trace_context_is_continued(
        etcd_server, redis_server, key_root, stream_key, jaeger, quick_export):
    """A client that sends a W3C traceparent gets the scheduler's spans in its own trace."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             trace_endpoint=jaeger.traces_url, reconcile_interval_s=30.0)
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    caller_span = "00f067aa0ba902b7"
    async with leading_fleet(settings, 1) as (_scheduler, _fleet, stub):
        answer = await stub.ApplyWorkload(
            pb.ApplyWorkloadRequest(workload_id="traced-2", spec=container_spec()),
            metadata=(("traceparent", f"00-{caller_trace}-{caller_span}-01"),))
        assert answer.success
        event = await _scheduled_event(stub, "traced-2")
        assert event.details["trace_id"] == caller_trace

        async def server_span() -> Any:
            found = await _query(jaeger, "trace", caller_trace)
            return found and _spans(found, SERVER_SPAN)

        [server] = await wait_for(server_span, timeout=20, interval=0.2)
    assert _parent(server) == caller_span


async def test_refused_apply_marks_the_server_span(
        etcd_server, redis_server, key_root, stream_key, jaeger, quick_export):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             trace_endpoint=jaeger.traces_url, reconcile_interval_s=30.0)
    async with leading_fleet(settings, 1) as (_scheduler, _fleet, stub):
        answer = await stub.ApplyWorkload(pb.ApplyWorkloadRequest(
            workload_id="too-big", spec=container_spec(cpu_m=10_000_000)))
        assert not answer.success

        async def refused() -> Any:
            found = await _query(jaeger, "traces", "persys-scheduler", SERVER_SPAN)
            spans = [s for t in found for s in t["spans"]
                     if _tags(s).get("scheduler.workload_id") == "too-big"
                     and s["operationName"] == SERVER_SPAN]
            return spans

        [server] = await wait_for(refused, timeout=20, interval=0.2)
    tags = _tags(server)
    assert tags["scheduler.failure_reason"] == "INSUFFICIENT_RESOURCES"
    assert tags["otel.status_code"] == "ERROR"


async def test_reconcile_cycle_is_a_root_span_with_sampled_nodes(
        etcd_server, redis_server, key_root, stream_key, jaeger, quick_export):
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             trace_endpoint=jaeger.traces_url, reconcile_interval_s=0.5,
                             trace_reconcile_nodes=1)
    async with leading_fleet(settings, 3, otlp_endpoint=jaeger.otlp_endpoint) as (
            _scheduler, fleet, _stub):

        async def cycles() -> list[Any]:
            found = await _query(jaeger, "traces", "persys-scheduler", "reconcile.cycle")
            whole = [t for t in found
                     if _spans(t, "reconcile.node") and _spans(t, AGENT_LIST, "persys-agent-sim")]
            return whole if len(whole) >= 3 else []

        traces = await wait_for(cycles, timeout=30, interval=0.3,
                                message="no traced reconcile cycles")
    seen: set[str] = set()
    for found in traces:
        [root] = _spans(found, "reconcile.cycle")
        assert _parent(root) is None
        # (the first cycles may run before every node's liveness key is seen)
        assert 1 <= _tags(root)["scheduler.nodes_listed"] <= 3
        phases = {s["operationName"] for s in found["spans"]
                  if _parent(s) == root["spanID"]}
        assert {"reconcile.prefetch", "reconcile.plan", "reconcile.act"} <= phases
        # one node of three per cycle (SCHEDULER_TRACE_RECONCILE_NODES=1): one listing traced
        [node] = _spans(found, "reconcile.node")
        assert _parent(node) == root["spanID"]
        [listing] = _spans(found, AGENT_LIST, "persys-scheduler")
        assert _parent(listing) == node["spanID"]
        [agent] = _spans(found, AGENT_LIST, "persys-agent-sim")
        assert _parent(agent) == listing["spanID"]
        seen.add(_tags(node)["scheduler.node_id"])
    # taken in turn: consecutive cycles trace different nodes
    assert len(seen) >= 2
    assert seen <= {n.node_id for n in fleet.nodes}


async def test_export_off_sends_nothing(etcd_server, redis_server, key_root, stream_key,
                                        jaeger, quick_export, monkeypatch):
    """No endpoint: no provider, no interceptor, no trace id in events, and the collector
    hears nothing, even from a caller that sends a traceparent."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "JAEGER_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    settings = make_settings(etcd_server, redis_server, key_root, stream_key,
                             reconcile_interval_s=0.5)
    assert settings.trace_endpoint == ""
    async with leading_fleet(settings, 1) as (scheduler, _fleet, stub):
        assert not scheduler.tracing.enabled
        assert scheduler.tracer is None
        assert scheduler.committer.tracer is None
        assert scheduler.batcher.tracer is None
        assert scheduler.agents.interceptors is None
        assert scheduler.grpc.tracing == []
        answer = await stub.ApplyWorkload(
            pb.ApplyWorkloadRequest(workload_id="dark-1", spec=container_spec()),
            metadata=(("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),))
        assert answer.success
        event = await _scheduled_event(stub, "dark-1")
        assert "trace_id" not in event.details
        # a reconcile cycle ran too (untraced)
        reconcile = loops_of(scheduler).reconcile
        await wait_for(lambda: reconcile.last_report is not None, timeout=10)
    # the process-wide provider was never touched either
    assert type(otel_trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
    assert await _query(jaeger, "services") == []


# -- configuration and the event format ----------------------------------------------------------

def _env(**values: str) -> dict[str, str]:
    return {"PERSYS_TLS_CA": "/x", "PERSYS_TLS_CERT": "/x", "PERSYS_TLS_KEY": "/x", **values}


def test_endpoint_variables_follow_go():
    s = load_settings(_env())
    assert (s.trace_endpoint, s.trace_service_name) == ("", "persys-scheduler")
    assert s.trace_sampler == "parentbased_always_on"
    # host:port, plaintext by default (OTEL_EXPORTER_OTLP_INSECURE=true)
    assert load_settings(_env(JAEGER_ENDPOINT="jaeger:4318")).trace_endpoint == \
        "http://jaeger:4318/v1/traces"
    # OTEL_EXPORTER_OTLP_ENDPOINT takes precedence over JAEGER_ENDPOINT
    both = _env(JAEGER_ENDPOINT="jaeger:4318", OTEL_EXPORTER_OTLP_ENDPOINT="collector:4318")
    assert load_settings(both).trace_endpoint == "http://collector:4318/v1/traces"
    secure = _env(OTEL_EXPORTER_OTLP_ENDPOINT="collector:4318",
                  OTEL_EXPORTER_OTLP_INSECURE="false")
    assert load_settings(secure).trace_endpoint == "https://collector:4318/v1/traces"
    # a URL keeps its scheme; a path already ending in /v1/traces is kept as it is
    url = _env(OTEL_EXPORTER_OTLP_ENDPOINT="https://c.example:443/otlp/v1/traces")
    assert load_settings(url).trace_endpoint == "https://c.example:443/otlp/v1/traces"
    base = _env(OTEL_EXPORTER_OTLP_ENDPOINT="http://c:4318/otlp/")
    assert load_settings(base).trace_endpoint == "http://c:4318/otlp/v1/traces"
    # the signal's own variable is the traces URL itself, and comes first
    signal = _env(OTEL_EXPORTER_OTLP_ENDPOINT="c:4318",
                  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://t:9/traces")
    assert load_settings(signal).trace_endpoint == "http://t:9/traces"
    off = _env(OTEL_EXPORTER_OTLP_ENDPOINT="c:4318", OTEL_SDK_DISABLED="true")
    assert load_settings(off).trace_endpoint == ""
    named = load_settings(_env(OTEL_SERVICE_NAME="sched-a", OTEL_TRACES_SAMPLER="traceidratio",
                               OTEL_TRACES_SAMPLER_ARG="0.25",
                               SCHEDULER_TRACE_RECONCILE_NODES="3"))
    assert (named.trace_service_name, named.trace_sampler, named.trace_sampler_ratio,
            named.trace_reconcile_nodes) == ("sched-a", "traceidratio", 0.25, 3)


@pytest.mark.parametrize(("env", "variable"), [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://c:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"JAEGER_ENDPOINT": "http://:4318"}, "JAEGER_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_INSECURE": "maybe"}, "OTEL_EXPORTER_OTLP_INSECURE"),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
     "OTEL_TRACES_SAMPLER_ARG"),
    ({"SCHEDULER_TRACE_RECONCILE_NODES": "-1"}, "SCHEDULER_TRACE_RECONCILE_NODES"),
])
def test_invalid_tracing_values_name_their_variable(env, variable):
    with pytest.raises(ConfigError, match=variable):
        load_settings(_env(**env))


def test_outbox_record_carries_the_trace_and_the_entry_its_id():
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    event = Event(type="WorkloadScheduled", workload_id="w", details={"revision_id": "r"},
                  traceparent=parent)
    record = event.outbox_record(seq=0)
    assert b'"traceparent"' in record
    data = entry_data(record, revision=7, prev="0-0")
    assert '"traceparent"' not in data
    assert '"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736"' in data
    assert trace_id_of(parent) == "4bf92f3577b34da6a3ce929d0e0e4736"
    context = parent_of(parent)
    assert context is not None
    span_context = otel_trace.get_current_span(context).get_span_context()
    assert (f"{span_context.trace_id:032x}", f"{span_context.span_id:016x}") == (
        "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    untraced = Event(type="WorkloadScheduled", workload_id="w").outbox_record(seq=0)
    assert b"trace" not in untraced
    assert parent_of("garbage") is None



def test_sim_takes_the_go_agents_endpoint_variable(monkeypatch):
    import argparse

    from ops.sim.cli import add_sim_arguments
    from ops.sim.fleet import Fleet

    monkeypatch.setenv("PERSYS_OTLP_ENDPOINT", "collector:4318")
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    assert parser.parse_args(["--scheduler", "127.0.0.1:1"]).otlp_endpoint == "collector:4318"
    assert parser.parse_args(["--scheduler", "127.0.0.1:1", "--otlp-endpoint", ""]
                             ).otlp_endpoint == ""
    untraced = Fleet("127.0.0.1:1", count=1)
    assert untraced.tracing.provider is None
    with pytest.raises(ConfigError, match="--otlp-endpoint"):
        Fleet("127.0.0.1:1", count=1, otlp_endpoint="grpc://collector:4317")
