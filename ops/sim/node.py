"""One simulated agent as the scheduler sees it: its ``AgentService`` server and its reports.

Apart from the runtime model (``ops.sim.runtime``) because this is the agent's outside: the
``grpc.aio`` server on its own port (kept across :meth:`SimNode.crash` /
:meth:`SimNode.restart`), the admission of every call (the wrong-node refusal, the leader term
an apply carries, who called), the gRPC methods that hand the requests to the runtime, and the
RegisterNode / Heartbeat messages the control loop (``ops.sim.control``) sends for the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import trace

from eventsource.tracing import NODE_ID, WORKLOAD_ID
from ops.sim.clock import DueHeap
from ops.sim.config import NodeBehaviour, SimTls
from ops.sim.counters import FleetCounters
from ops.sim.runtime import STATE_NAMES, TYPE_NAMES, SimRuntime
from proto.persys.agent.v1 import agent_pb2, agent_pb2_grpc
from proto.persys.control.v1 import control_pb2

NODE_ID_METADATA = "x-persys-node-id"
LEADER_TERM_METADATA = "x-persys-leader-term"
INSTANCE_ID_METADATA = "x-persys-instance-id"

#: Used when RegisterNode answers heartbeat_interval_seconds=0 (as the Go agent does).
DEFAULT_HEARTBEAT_INTERVAL_S = 10.0
REGISTER_BACKOFF_START_S = 1.0
AGENT_VERSION = "sim"
HOST = "127.0.0.1"

_MIB = 1024 * 1024
_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)

_PENDING = agent_pb2.ACTUAL_STATE_PENDING
_RUNNING = agent_pb2.ACTUAL_STATE_RUNNING
_FAILED = agent_pb2.ACTUAL_STATE_FAILED


async def _abort(context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
    """``context.abort`` with the NoReturn type grpc's untyped API cannot express."""
    await context.abort(code, details)
    raise AssertionError("grpc.aio context.abort() returned")


def _timestamp(unix_ns: int) -> Timestamp:
    return Timestamp(seconds=unix_ns // 1_000_000_000, nanos=unix_ns % 1_000_000_000)


@dataclass(slots=True)
class ControlState:
    """A node's registration/heartbeat state. Owned and mutated by its fleet's control loop
    (:class:`~ops.sim.control.ControlLoop`); the node only voids it on crash and restart."""

    #: Index of the scheduler channel this node uses.
    slot: int = 0
    #: Bumped on crash and restart: scheduled or in-flight control actions of an older
    #: generation are dropped.
    gen: int = 0
    registered: bool = False
    #: Heartbeat interval in use (set at registration).
    interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    backoff_s: float = REGISTER_BACKOFF_START_S
    #: Loop time after which the node re-registers instead of heartbeating.
    lease_deadline: float = 0.0
    #: A heartbeat succeeded since the last registration (the next failure re-registers at once).
    heartbeat_ok: bool = False
    #: Spread the next heartbeat after the first registration (fleet start).
    first: bool = True


class SimNode(SimRuntime, agent_pb2_grpc.AgentServiceServicer):
    """One simulated agent: an ``AgentService`` server with in-memory workloads.

    Built by :class:`~ops.sim.fleet.Fleet`, which owns its timer, counters and control loop.
    """

    def __init__(
        self,
        node_id: str,
        behaviour: NodeBehaviour,
        *,
        clock: DueHeap,
        counters: FleetCounters,
        rng: random.Random,
        on_restart: Callable[[SimNode], None] | None = None,
        tls: SimTls | None = None,
        interceptors: Sequence[Any] = (),
    ) -> None:
        super().__init__(behaviour, clock=clock, rng=rng)
        self.node_id = node_id
        self._tls = tls
        #: the tracing interceptors of its server (``ops.sim.tracing``; none: untraced)
        self._interceptors = list(interceptors)
        self.control = ControlState()
        #: Port of the node's server; kept across crash()/restart(). 0 until started.
        self.port = 0
        self._counters = counters
        self._on_restart = on_restart
        self._server: Any = None
        self._max_term = 0
        #: calls by (method, x-persys-instance-id of the caller): who drives this node
        self.callers: Counter[tuple[str, str]] = Counter()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """The node's server is running."""
        return self._server is not None

    @property
    def endpoint(self) -> str:
        """``host:port`` the node advertises as its grpc_endpoint."""
        return f"{HOST}:{self.port}"

    async def start(self) -> int:
        """Bind (port 0 the first time, the same port afterwards) and start; return the port."""
        if self._server is not None:
            raise RuntimeError(f"{self.node_id} is already running")
        server = grpc.aio.server(options=_SERVER_OPTIONS,
                                 interceptors=self._interceptors or None)
        agent_pb2_grpc.add_AgentServiceServicer_to_server(self, server)  # type: ignore[no-untyped-call]
        try:
            address = f"{HOST}:{self.port}"
            port: int = (server.add_secure_port(address, self._tls.server_credentials())
                         if self._tls is not None else server.add_insecure_port(address))
            await server.start()
        except BaseException:
            await server.stop(None)
            raise
        self._server = server
        self.port = port
        return port

    async def crash(self) -> None:
        """Vanish: stop the server at once (grace 0) and stop heartbeating.

        Workloads stay in memory until :meth:`restart` decides their fate.
        """
        server, self._server = self._server, None
        self._void_pending_applies()
        self.control.gen += 1
        self.control.registered = False
        if server is not None:
            await server.stop(0)

    async def restart(self, *, keep_workloads: bool = False) -> None:
        """Come back on the same port and register again, like a restarted agent.

        Args:
            keep_workloads: keep the workloads held before the crash (pending applies resume);
                by default they are lost.
        """
        if self._server is not None:
            raise RuntimeError(f"{self.node_id} is running; crash() it first")
        self._come_back(keep_workloads=keep_workloads)
        await self.start()
        self.control.gen += 1
        self.control.registered = False
        self.control.backoff_s = REGISTER_BACKOFF_START_S
        if self._on_restart is not None:
            self._on_restart(self)

    async def close(self) -> None:
        """Stop the server (fleet shutdown)."""
        await self.crash()

    # -- control-plane messages --------------------------------------------------------------

    def register_request(self) -> control_pb2.RegisterNodeRequest:
        b = self.behaviour
        return control_pb2.RegisterNodeRequest(
            node_id=self.node_id,
            capabilities=control_pb2.NodeCapabilities(
                cpu_total_millicores=b.cpu_millicores,
                memory_total_mb=b.memory_mb,
                storage_pools=[
                    control_pb2.StoragePool(name="root", type="local", total_gb=b.disk_gb)
                ],
                supported_workload_types=b.workload_types,
                supported_storage_drivers=b.storage_drivers,
            ),
            labels={"os": "linux", "arch": "amd64", **b.labels},
            agent_version=AGENT_VERSION,
            grpc_endpoint=self.endpoint,
            timestamp=_timestamp(time.time_ns()),
        )

    def heartbeat_request(self) -> control_pb2.HeartbeatRequest:
        now_ns = time.time_ns()
        now_s = now_ns // 1_000_000_000
        report = self.behaviour.report_usage
        statuses: list[control_pb2.WorkloadStatus] = []
        usage: list[control_pb2.WorkloadUsageSnapshot] = []
        cpu_used = mem_used = 0
        for w in self._workloads.values():
            status = control_pb2.WorkloadStatus(
                workload_id=w.workload_id,
                state=STATE_NAMES.get(w.actual, "Unknown"),
                message=w.message,
                last_transition=Timestamp(seconds=w.updated_at),
            )
            if w.actual == _FAILED:
                status.failure_reason = control_pb2.RUNTIME_ERROR
            elif w.actual == _RUNNING:
                cpu_used += w.cpu_m
                mem_used += w.memory_mb
                if report:
                    snapshot = control_pb2.WorkloadUsageSnapshot(
                        workload_id=w.workload_id,
                        type=TYPE_NAMES.get(w.type, "container"),
                        cpu_percent=w.cpu_m / 10.0,
                        memory_bytes=w.memory_mb * _MIB,
                        collected_at=Timestamp(seconds=now_s),
                        source="sim",
                    )
                    status.usage.CopyFrom(snapshot)
                    usage.append(snapshot)
            statuses.append(status)
        return control_pb2.HeartbeatRequest(
            node_id=self.node_id,
            usage=control_pb2.NodeUsage(cpu_used_millicores=cpu_used, memory_used_mb=mem_used),
            workload_statuses=statuses,
            timestamp=_timestamp(now_ns),
            workload_usage=usage,
        )

    # -- AgentService ------------------------------------------------------------------------

    async def _admit(self, method: str, context: Any) -> int | None:
        """Count the call, refuse it if it names another node, return its leader term."""
        self._counters.rpcs[method] += 1
        if self._interceptors:
            span = trace.get_current_span()
            if span.is_recording():
                # named as a Go agent's otelgrpc names it (no leading slash)
                span.update_name(f"persys.agent.v1.AgentService/{method}")
                span.set_attribute(NODE_ID, self.node_id)
        term: int | None = None
        for key, value in context.invocation_metadata() or ():
            if key == INSTANCE_ID_METADATA:
                self.callers[(method, value)] += 1
            elif key == NODE_ID_METADATA:
                if value != self.node_id:
                    self._counters.wrong_node_refused += 1
                    await _abort(
                        context,
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"wrong node: this is {self.node_id}, the call is for {value}",
                    )
            elif key == LEADER_TERM_METADATA:
                with contextlib.suppress(ValueError):
                    term = int(value)
        delay = self.behaviour.slow_answer_s
        if delay > 0:
            await asyncio.sleep(delay)
        return term

    async def ApplyWorkload(
        self, request: agent_pb2.ApplyWorkloadRequest, context: Any
    ) -> agent_pb2.ApplyWorkloadResponse:
        term = await self._admit("ApplyWorkload", context)
        if self._interceptors:
            trace.get_current_span().set_attribute(WORKLOAD_ID, request.id)
        self._max_term = self._counters.record_apply(term, self._max_term)
        return self._apply(request)

    async def DeleteWorkload(
        self, request: agent_pb2.DeleteWorkloadRequest, context: Any
    ) -> agent_pb2.DeleteWorkloadResponse:
        await self._admit("DeleteWorkload", context)
        return self._delete(request)

    async def GetWorkloadStatus(
        self, request: agent_pb2.GetWorkloadStatusRequest, context: Any
    ) -> agent_pb2.GetWorkloadStatusResponse:
        await self._admit("GetWorkloadStatus", context)
        w = self._workloads.get(request.id)
        if w is None:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"workload {request.id} not found")
        status = self._status(w)
        if w.actual == _PENDING:
            status.metadata["task_id"] = w.task_id
            status.metadata["task_status"] = "pending"
        return agent_pb2.GetWorkloadStatusResponse(status=status)

    async def ListWorkloads(
        self, request: agent_pb2.ListWorkloadsRequest, context: Any
    ) -> agent_pb2.ListWorkloadsResponse:
        await self._admit("ListWorkloads", context)
        return self._list(request.type)

    async def HealthCheck(
        self, request: agent_pb2.HealthCheckRequest, context: Any
    ) -> agent_pb2.HealthCheckResponse:
        await self._admit("HealthCheck", context)
        cpu, mem = self.requested()
        return agent_pb2.HealthCheckResponse(
            healthy=True,
            version=AGENT_VERSION,
            runtime_status={"sim": "ok"},
            cpu_utilization=100.0 * cpu / self.behaviour.cpu_millicores,
            memory_utilization=100.0 * mem / self.behaviour.memory_mb,
        )

    async def ListActions(
        self, request: agent_pb2.ListActionsRequest, context: Any
    ) -> agent_pb2.ListActionsResponse:
        await self._admit("ListActions", context)
        return agent_pb2.ListActionsResponse()
