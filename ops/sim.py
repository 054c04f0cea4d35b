"""A simulated compute-agent fleet: thousands of fake nodes in one process.

Why this exists: the scheduler must be exercised (tests, ``persys-scheduler sim``, the
benchmark in ``docs/benchmark.md``) against fleets of 1,000-5,000 agents without running real
ones. Each simulated node behaves towards the scheduler like a Go compute-agent: it registers over
``persys.control.v1.AgentControl``, heartbeats with its usage and one status per local workload,
re-registers after a rejection or a failed heartbeat, and serves ``persys.agent.v1.AgentService``
on its own port with the agent's asynchronous apply (answer PENDING with a ``task_id`` at once,
RUNNING / FAILED / STOPPED after ``apply_latency_s``). The simulator is also the benchmark's
witness: it counts agent RPCs, refused wrong-node calls, applies carrying a stale leader term and
nodes holding more than their capacity.

Invariants:

* One ``grpc.aio`` server per simulated node, on 127.0.0.1 and a port the kernel picked (bind to
  port 0). A node keeps its port across ``crash()`` / ``restart()``; ``grpc.so_reuseport`` is off
  so two servers can never silently share a port.
* A node refuses an agent call only when ``x-persys-node-id`` is present and names another node
  (``PERMISSION_DENIED`` "wrong node", counted as ``wrong_node_refused``). Calls without the
  metadata are served: Go schedulers send none.
* ``double_applies`` follows docs/benchmark.md: an ApplyWorkload whose
  ``x-persys-leader-term`` is lower than the highest term any node of this fleet has already
  seen. The same check per node is reported as ``double_applies_node_scope``: with
  active-active shards every shard has its own leader key (its own create revision), so only
  the per-node figure is meaningful there.
* Time is driven by ONE heap of due times and ONE dispatcher task per fleet (:class:`DueHeap`):
  apply completions, registration retries and heartbeats. Control RPCs run on a fixed pool of
  worker tasks (``concurrency``, by default one per node: a real agent's heartbeat never waits
  for another agent's, so a smaller pool would stretch every heartbeat interval whenever the
  scheduler answers slowly; an idle worker costs about 1.2 KB). There is no task per workload.
  Cancellation is lazy: a timer entry carries the generation it was made for and is ignored when
  the node (crash, restart) or workload (re-apply, delete) moved on.
* Each node has at most one control action (register or heartbeat) scheduled, queued or in
  flight, so the work queue never holds more than one entry per node.
* A node's capacity use is what its PENDING and RUNNING workloads request in the agent spec:
  container ``resources.cpu_shares`` (millicores) and ``resources.memory_bytes``; vm
  ``vcpus * 1000`` and ``memory_mb``; compose requests nothing.
* Every task belongs to a :class:`Fleet` (or :class:`StatsServer`); ``stop()`` cancels and awaits
  them, stops every server and closes the scheduler channels.

Deliberate deviations from the Go agent, for a simulator: re-applying the revision a workload
already runs answers ``applied=True, skipped=True`` at once (the asynchronous Go agent queues a
task that skips later); DeleteWorkload removes the workload at once (Go answers "submitted" and
deletes later); ListWorkloads includes workloads whose apply is still PENDING (Go lists persisted
statuses only); GetWorkloadStatus of an unknown workload fails with ``NOT_FOUND`` "workload <id>
not found" (Go returns a plain error; the scheduler matches the text); a RUNNING or STOPPED
status carries no message (the Go scheduler appends every non-empty heartbeat message to the
workload's logs).

Measured cost (2-core machine, CPython 3.11.7, grpcio 1.85.1; a fake AgentControl and a
scheduler-like client, one channel per node, each in its own process):

* 1,000 nodes: servers up in 0.8 s, all registered after 1.4 s; +43 MiB RSS when idle, i.e.
  about 44 KiB per node, and one descriptor per node (its listening socket). With the client
  connected to every node and 20,000 workloads applied: +79 MiB and 2,009 descriptors.
* 5,000 nodes: servers up in 4.1 s, all registered after 8.7 s; +194 MiB when idle (about
  40 KiB per node). With the client connected to every node and 20,000 workloads: +320 MiB and
  10,009 descriptors, half of this machine's open-file limit (20,000). So 5,000 separate servers
  fit in one process and no multi-process mode is offered.
* A heartbeat costs about 0.7 ms of simulator CPU: 5,000 nodes every 10 s (500/s) keep 35% of a
  core busy; at the Go scheduler's 60 s interval, about 6%.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import random
import resource
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import parse_qs, urlsplit

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from proto.persys.agent.v1 import agent_pb2, agent_pb2_grpc
from proto.persys.control.v1 import control_pb2, control_pb2_grpc

__all__ = [
    "LEADER_TERM_METADATA",
    "NODE_ID_METADATA",
    "DueHeap",
    "Fleet",
    "FleetCounters",
    "NodeBehaviour",
    "SimNode",
    "SimTls",
    "StatsServer",
    "add_sim_arguments",
    "run_sim",
]

logger = logging.getLogger(__name__)

NODE_ID_METADATA = "x-persys-node-id"
LEADER_TERM_METADATA = "x-persys-leader-term"
INSTANCE_ID_METADATA = "x-persys-instance-id"

#: Used when RegisterNode answers heartbeat_interval_seconds=0 (as the Go agent does).
DEFAULT_HEARTBEAT_INTERVAL_S = 10.0
REGISTER_BACKOFF_START_S = 1.0
REGISTER_BACKOFF_MAX_S = 30.0
#: how often a held node checks whether its control loop may go on
HOLD_RECHECK_S = 0.5
#: The Go agent re-registers when no heartbeat answer refreshed its lease for this long.
AGENT_LEASE_S = 180.0
AGENT_VERSION = "sim"
HOST = "127.0.0.1"

_MIB = 1024 * 1024
_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


@dataclass(frozen=True)
class SimTls:
    """PEM bytes for mTLS both ways, as a Go agent has: the nodes' servers require a client
    certificate signed by ``ca``, and the fleet presents ``cert`` to the scheduler. One
    certificate serves every node (all of them listen on 127.0.0.1, which it must name)."""

    ca: bytes
    cert: bytes
    key: bytes

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

_PENDING = agent_pb2.ACTUAL_STATE_PENDING
_RUNNING = agent_pb2.ACTUAL_STATE_RUNNING
_STOPPED = agent_pb2.ACTUAL_STATE_STOPPED
_FAILED = agent_pb2.ACTUAL_STATE_FAILED
_DESIRED_RUNNING = agent_pb2.DESIRED_STATE_RUNNING
_DESIRED_STOPPED = agent_pb2.DESIRED_STATE_STOPPED
_HOLDS_CAPACITY = frozenset((_PENDING, _RUNNING))

#: Agent ActualState -> the heartbeat's normalised state string.
_STATE_NAMES: dict[agent_pb2.ActualState.ValueType, str] = {
    _PENDING: "Pending",
    _RUNNING: "Running",
    _STOPPED: "Stopped",
    _FAILED: "Failed",
}
_TYPE_NAMES: dict[agent_pb2.WorkloadType.ValueType, str] = {
    agent_pb2.WORKLOAD_TYPE_CONTAINER: "container",
    agent_pb2.WORKLOAD_TYPE_COMPOSE: "compose",
    agent_pb2.WORKLOAD_TYPE_VM: "vm",
    agent_pb2.WORKLOAD_TYPE_MICROVM: "vm",
}


# ----------------------------------------------------------------------------------------------
# Behaviour, counters and the fleet's single timer
# ----------------------------------------------------------------------------------------------


@dataclass
class NodeBehaviour:
    """How a simulated node behaves. Nodes share the instance they were given: changing a field
    changes every node holding it (use ``dataclasses.replace`` for one node)."""

    #: Delay between an accepted apply (PENDING) and its outcome (RUNNING/FAILED/STOPPED).
    apply_latency_s: float = 0.2
    #: Probability that an apply ends FAILED.
    failure_rate: float = 0.0
    #: Extra delay before answering every agent RPC.
    slow_answer_s: float = 0.0
    cpu_millicores: int = 8000
    memory_mb: int = 16384
    disk_gb: int = 100
    workload_types: list[str] = field(default_factory=lambda: ["container", "compose", "vm"])
    labels: dict[str, str] = field(default_factory=dict)
    storage_drivers: list[str] = field(default_factory=lambda: ["local"])
    #: Send per-workload usage snapshots in heartbeats (twice, as the Go agent does).
    report_usage: bool = True
    #: Types advertised whose runtime is missing: applies of them answer "runtime not
    #: available", as the Go agent does when the hypervisor or Docker is not running.
    missing_runtimes: list[str] = field(default_factory=list)
    #: Answer deletes with success=false (an agent that cannot remove a workload now).
    refuse_deletes: bool = False

    def __post_init__(self) -> None:
        if self.apply_latency_s < 0 or self.slow_answer_s < 0:
            raise ValueError("apply_latency_s and slow_answer_s must be >= 0")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be within [0, 1], got {self.failure_rate}")
        if self.cpu_millicores <= 0 or self.memory_mb <= 0:
            raise ValueError("cpu_millicores and memory_mb must be > 0")


@dataclass
class FleetCounters:
    """Fleet-wide counters, shared by every node of one fleet (single event loop: no locks)."""

    #: Agent RPCs received, by method (refused ones included).
    rpcs: Counter[str] = field(default_factory=Counter)
    #: Control-plane outcomes: register_ok/_rejected/_errors, heartbeats_ok, heartbeat_errors,
    #: and the errors by gRPC code (``register_errors_DEADLINE_EXCEEDED``, ...)
    control: Counter[str] = field(default_factory=Counter)
    #: ApplyWorkload calls that reached a node (passed the node-id check).
    applies: int = 0
    applies_by_term: Counter[int] = field(default_factory=Counter)
    double_applies: int = 0
    double_applies_node_scope: int = 0
    wrong_node_refused: int = 0
    max_term_seen: int = 0
    #: Unexpected exceptions in timer callbacks or control steps (bugs; logged).
    internal_errors: int = 0

    def record_apply(self, term: int | None, node_max_term: int) -> int:
        """Count one apply carrying ``term``; return the node's new highest term."""
        self.applies += 1
        if term is None:
            return node_max_term
        self.applies_by_term[term] += 1
        if term < self.max_term_seen:
            self.double_applies += 1
        else:
            self.max_term_seen = term
        if term < node_max_term:
            self.double_applies_node_scope += 1
            return node_max_term
        return term


class DueHeap:
    """The fleet's only timer: a heap of ``(due, seq, callback)`` run by one task.

    Callbacks are plain functions run on the loop; they must be quick (they flip a state or put
    an item on a queue). Entries are never removed early: a callback checks whether it still
    applies (generation numbers), which keeps scheduling O(log n) with no handle bookkeeping.
    """

    def __init__(self, counters: FleetCounters | None = None) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._counters = counters
        #: Largest delay seen between an entry's due time and its run: the simulator's own lag.
        self.max_lag_s = 0.0

    def __len__(self) -> int:
        return len(self._heap)

    def call_at(self, due: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at loop time ``due`` (or as soon as possible after it)."""
        if not self._heap or due < self._heap[0][0]:
            self._wake.set()
        heapq.heappush(self._heap, (due, next(self._seq), callback))

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` after ``delay`` seconds of loop time."""
        self.call_at(asyncio.get_running_loop().time() + delay, callback)

    def start(self) -> None:
        """Start the dispatcher task (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-due-heap")

    async def stop(self) -> None:
        """Stop the dispatcher; pending entries are dropped."""
        task, self._task = self._task, None
        if task is not None:
            await _cancel_and_wait([task])
        self._heap.clear()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        heap = self._heap
        while True:
            now = loop.time()
            while heap and heap[0][0] <= now:
                due, _, callback = heapq.heappop(heap)
                self.max_lag_s = max(self.max_lag_s, now - due)
                try:
                    callback()
                except Exception:
                    logger.exception("sim: timer callback %r failed", callback)
                    if self._counters is not None:
                        self._counters.internal_errors += 1
            self._wake.clear()
            if not heap:
                await self._wake.wait()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(heap[0][0] - now):
                    await self._wake.wait()


async def _cancel_and_wait(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait for them; log failures other than the cancellation itself.

    If the caller is cancelled meanwhile, ``gather`` raises ``CancelledError`` and it propagates.
    """
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for task, result in zip(tasks, results, strict=True):
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            logger.error("sim: task %s failed", task.get_name(), exc_info=result)


async def _abort(context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
    """``context.abort`` with the NoReturn type grpc's untyped API cannot express."""
    await context.abort(code, details)
    raise AssertionError("grpc.aio context.abort() returned")


def _timestamp(unix_ns: int) -> Timestamp:
    return Timestamp(seconds=unix_ns // 1_000_000_000, nanos=unix_ns % 1_000_000_000)


def _requested(spec: agent_pb2.WorkloadSpec) -> tuple[int, int]:
    """(cpu millicores, memory MiB) an agent spec asks for, as the scheduler encodes them."""
    kind = spec.WhichOneof("spec")
    if kind == "container":
        res = spec.container.resources
        return res.cpu_shares, -(-res.memory_bytes // _MIB)
    if kind == "vm":
        return spec.vm.vcpus * 1000, spec.vm.memory_mb
    return 0, 0


# ----------------------------------------------------------------------------------------------
# One simulated node
# ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Workload:
    workload_id: str
    type: agent_pb2.WorkloadType.ValueType
    revision_id: str
    desired: agent_pb2.DesiredState.ValueType
    actual: agent_pb2.ActualState.ValueType
    message: str
    cpu_m: int
    memory_mb: int
    created_at: int
    updated_at: int
    task_id: str
    #: Bumped by every apply that starts a new task; stale completions compare it.
    gen: int = 0


@dataclass(slots=True)
class ControlState:
    """A node's registration/heartbeat state. Owned and mutated by its :class:`Fleet` only."""

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


class SimNode(agent_pb2_grpc.AgentServiceServicer):
    """One simulated agent: an ``AgentService`` server with in-memory workloads.

    Built by :class:`Fleet`, which owns its timer, counters and control loop.
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
    ) -> None:
        self.node_id = node_id
        self._tls = tls
        self.behaviour = behaviour
        self.control = ControlState()
        #: Port of the node's server; kept across crash()/restart(). 0 until started.
        self.port = 0
        self._clock = clock
        self._counters = counters
        self._rng = rng
        self._on_restart = on_restart
        self._server: Any = None
        self._workloads: dict[str, _Workload] = {}
        #: The unfiltered ListWorkloads answer, rebuilt only after a change (``_changed``).
        #: Building 20 statuses costs the simulator ~130 us per call, which at 5,000 nodes
        #: took CPU the scheduler under test shares on this machine; a real agent's cost is
        #: on its own host.
        self._listing: agent_pb2.ListWorkloadsResponse | None = None
        #: Bumped on crash: pending apply completions of an older epoch are void.
        self._epoch = 0
        self._max_term = 0
        #: calls by (method, x-persys-instance-id of the caller): who drives this node
        self.callers: Counter[tuple[str, str]] = Counter()

    def _changed(self) -> None:
        """Every change to the held workloads or their states comes through here."""
        self._listing = None

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
        server = grpc.aio.server(options=_SERVER_OPTIONS)
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
        self._epoch += 1
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
        if keep_workloads:
            for w in self._workloads.values():
                if w.actual == _PENDING:
                    self._arm(w)
        else:
            self._workloads.clear()
            self._changed()
        await self.start()
        self.control.gen += 1
        self.control.registered = False
        self.control.backoff_s = REGISTER_BACKOFF_START_S
        if self._on_restart is not None:
            self._on_restart(self)

    async def close(self) -> None:
        """Stop the server (fleet shutdown)."""
        await self.crash()

    # -- inspection --------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Number of workloads the agent holds, whatever their state."""
        return len(self._workloads)

    def workload_ids(self) -> list[str]:
        return list(self._workloads)

    def workload_state(self, workload_id: str) -> str | None:
        """The workload's state ("Running", "Pending", ...), or None when it is not held."""
        w = self._workloads.get(workload_id)
        return None if w is None else _STATE_NAMES.get(w.actual, "Unknown")

    def workload_revision(self, workload_id: str) -> str | None:
        """The revision id of the spec the agent last accepted, or None when not held."""
        w = self._workloads.get(workload_id)
        return None if w is None else w.revision_id

    def running_ids(self) -> list[str]:
        """The ids of the workloads this agent holds Running."""
        return [wid for wid, w in self._workloads.items()
                if _STATE_NAMES.get(w.actual) == "Running"]

    def requested(self) -> tuple[int, int]:
        """(cpu millicores, memory MiB) requested by the PENDING and RUNNING workloads."""
        cpu = mem = 0
        for w in self._workloads.values():
            if w.actual in _HOLDS_CAPACITY:
                cpu += w.cpu_m
                mem += w.memory_mb
        return cpu, mem

    def over_capacity(self) -> bool:
        cpu, mem = self.requested()
        return cpu > self.behaviour.cpu_millicores or mem > self.behaviour.memory_mb

    def kill_workloads(self, workload_ids: Iterable[str]) -> int:
        """Simulate killed workloads: they vanish from the agent. Returns how many were held."""
        removed = 0
        for workload_id in workload_ids:
            if self._workloads.pop(workload_id, None) is not None:
                removed += 1
        self._changed()
        return removed

    def states(self) -> Counter[str]:
        return Counter(_STATE_NAMES.get(w.actual, "Unknown") for w in self._workloads.values())

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
                state=_STATE_NAMES.get(w.actual, "Unknown"),
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
                        type=_TYPE_NAMES.get(w.type, "container"),
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
        self._max_term = self._counters.record_apply(term, self._max_term)
        return self._apply(request)

    async def DeleteWorkload(
        self, request: agent_pb2.DeleteWorkloadRequest, context: Any
    ) -> agent_pb2.DeleteWorkloadResponse:
        await self._admit("DeleteWorkload", context)
        if not request.id:
            return agent_pb2.DeleteWorkloadResponse(
                success=False, message="invalid request: workload id is required"
            )
        if self.behaviour.refuse_deletes:
            return agent_pb2.DeleteWorkloadResponse(
                success=False, message="cannot delete the workload now: runtime busy")
        self._workloads.pop(request.id, None)
        self._changed()
        return agent_pb2.DeleteWorkloadResponse(
            success=True, message="workload deletion submitted for processing"
        )

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
        wanted = request.type
        if wanted:
            return agent_pb2.ListWorkloadsResponse(
                workloads=[self._status(w) for w in self._workloads.values() if w.type == wanted]
            )
        if self._listing is None:
            self._listing = agent_pb2.ListWorkloadsResponse(
                workloads=[self._status(w) for w in self._workloads.values()]
            )
        return self._listing

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

    # -- apply state machine -----------------------------------------------------------------

    def _apply(self, request: agent_pb2.ApplyWorkloadRequest) -> agent_pb2.ApplyWorkloadResponse:
        if not request.id:
            return agent_pb2.ApplyWorkloadResponse(
                applied=False, message="invalid request: workload id is required"
            )
        if request.spec.WhichOneof("spec") is None:
            return agent_pb2.ApplyWorkloadResponse(
                applied=False,
                message="invalid request: spec must contain container, compose, or vm "
                "specification",
            )
        desired = (
            _DESIRED_STOPPED if request.desired_state == _DESIRED_STOPPED else _DESIRED_RUNNING
        )
        w = self._workloads.get(request.id)
        if w is not None and w.revision_id == request.revision_id and w.desired == desired:
            settled = _RUNNING if desired == _DESIRED_RUNNING else _STOPPED
            if w.actual == settled:
                return agent_pb2.ApplyWorkloadResponse(
                    applied=True,
                    skipped=True,
                    message="revision already applied",
                    status=self._status(w),
                )
            if w.actual == _PENDING:
                return self._submitted(w)
        wtype = request.type or agent_pb2.WORKLOAD_TYPE_CONTAINER
        if _TYPE_NAMES.get(wtype, "") in self.behaviour.missing_runtimes:
            return agent_pb2.ApplyWorkloadResponse(
                applied=False, message=f"runtime not available: {_TYPE_NAMES[wtype]}")
        cpu_m, memory_mb = _requested(request.spec)
        now = int(time.time())
        task_id = f"apply-{request.id}-{time.time_ns()}"
        if w is None:
            w = _Workload(
                workload_id=request.id,
                type=wtype,
                revision_id=request.revision_id,
                desired=desired,
                actual=_PENDING,
                message="",
                cpu_m=cpu_m,
                memory_mb=memory_mb,
                created_at=now,
                updated_at=now,
                task_id=task_id,
            )
            self._workloads[request.id] = w
        else:
            w.type = wtype
            w.revision_id = request.revision_id
            w.desired = desired
            w.cpu_m = cpu_m
            w.memory_mb = memory_mb
            w.task_id = task_id
        w.actual = _PENDING
        w.message = "task pending execution"
        w.updated_at = now
        self._changed()
        self._arm(w)
        return self._submitted(w)

    def _arm(self, w: _Workload) -> None:
        """Schedule the outcome of ``w``'s pending apply on the fleet's timer."""
        w.gen += 1
        self._clock.call_later(
            self.behaviour.apply_latency_s, partial(self._finish_apply, w, w.gen, self._epoch)
        )

    def _finish_apply(self, w: _Workload, gen: int, epoch: int) -> None:
        if epoch != self._epoch or gen != w.gen or self._workloads.get(w.workload_id) is not w:
            return
        rate = self.behaviour.failure_rate
        if w.desired == _DESIRED_STOPPED:
            w.actual, w.message = _STOPPED, ""
        elif rate > 0 and self._rng.random() < rate:
            w.actual, w.message = _FAILED, f"simulated runtime failure (failure_rate={rate})"
        else:
            w.actual, w.message = _RUNNING, ""
        w.updated_at = int(time.time())
        self._changed()

    def _submitted(self, w: _Workload) -> agent_pb2.ApplyWorkloadResponse:
        return agent_pb2.ApplyWorkloadResponse(
            applied=True,
            skipped=False,
            message="workload apply submitted for processing",
            status=agent_pb2.WorkloadStatus(
                id=w.workload_id,
                actual_state=_PENDING,
                message="task pending execution",
                updated_at=w.updated_at,
                metadata={"task_id": w.task_id, "task_status": "pending"},
            ),
        )

    @staticmethod
    def _status(w: _Workload) -> agent_pb2.WorkloadStatus:
        return agent_pb2.WorkloadStatus(
            id=w.workload_id,
            type=w.type,
            revision_id=w.revision_id,
            desired_state=w.desired,
            actual_state=w.actual,
            message=w.message,
            created_at=w.created_at,
            updated_at=w.updated_at,
        )


# ----------------------------------------------------------------------------------------------
# The fleet
# ----------------------------------------------------------------------------------------------


class Fleet:
    """N simulated nodes registering and heartbeating against one scheduler address.

    The control loop of each node follows the Go agent: RegisterNode, one Heartbeat right away,
    then one per interval (the scheduler's ``heartbeat_interval_seconds``, 10 s if 0, unless
    ``heartbeat_interval_s`` overrides it). A rejected or failed registration is retried after
    1 s, doubling to 30 s. A failed heartbeat re-registers at once after a good one, with the
    same backoff otherwise. Only after the first registration is the next heartbeat spread
    uniformly over one interval, so that a fleet started at once does not beat in lockstep.

    Args:
        scheduler: ``host:port`` of the scheduler's AgentControl service.
        count: number of nodes; ids are ``f"{prefix}{i:05d}"`` for i = first..first+count-1.
        first: the first node's index; several simulator processes with disjoint ranges make
            one fleet (its nodes are spread over the scheduler addresses by index, so the
            spread is the same as one process's).
        behaviour: shared by every node without an entry in ``behaviours``.
        behaviours: per-node overrides, by node id.
        heartbeat_interval_s: overrides the interval RegisterNode answers (tests).
        concurrency: control RPCs (register, heartbeat) in flight at most; None: one per node.
            With fewer, a slow scheduler stretches the fleet's heartbeat intervals (at 5,000
            nodes, 200 workers and 0.7 s answers give 300 heartbeats/s of the 500 due, and
            leases expired that real agents would have renewed).
        control_channels: channels (TCP connections) to the scheduler, shared round-robin.
        start_batch: servers started together.
        rpc_timeout_s: deadline of each control RPC.
        seed: seeds jitter and failure draws.
        tls: mTLS for the nodes' servers and the channels to the scheduler (None: plaintext).
    """

    def __init__(
        self,
        scheduler: str,
        *,
        count: int = 20,
        first: int = 1,
        prefix: str = "sim-node-",
        behaviour: NodeBehaviour | None = None,
        behaviours: Mapping[str, NodeBehaviour] | None = None,
        heartbeat_interval_s: float | None = None,
        concurrency: int | None = None,
        control_channels: int = 1,
        start_batch: int = 250,
        rpc_timeout_s: float = 10.0,
        seed: int | None = None,
        tls: SimTls | None = None,
    ) -> None:
        self._tls = tls
        if concurrency is None:
            concurrency = count
        if min(count, first, concurrency, control_channels, start_batch) < 1:
            raise ValueError(
                "count, first, concurrency, control_channels and start_batch must be >= 1")
        if heartbeat_interval_s is not None and heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        self.scheduler = scheduler
        #: "host:port[,host:port...]": each node keeps to one address (as an agent configured
        #: with one scheduler address does); nodes are spread over them round-robin
        self._addresses = [a.strip() for a in scheduler.split(",") if a.strip()]
        if not self._addresses:
            raise ValueError("scheduler: at least one HOST:PORT is required")
        control_channels = max(control_channels, len(self._addresses))
        self.counters = FleetCounters()
        self._clock = DueHeap(self.counters)
        self._rng = random.Random(seed)
        self._heartbeat_interval_s = heartbeat_interval_s
        self._concurrency = concurrency
        self._channel_count = control_channels
        self._start_batch = start_batch
        self._rpc_timeout_s = rpc_timeout_s
        default = behaviour if behaviour is not None else NodeBehaviour()
        overrides = behaviours or {}
        nodes: list[SimNode] = []
        for i in range(first, first + count):
            node_id = f"{prefix}{i:05d}"
            node = SimNode(
                node_id,
                overrides.get(node_id, default),
                clock=self._clock,
                counters=self.counters,
                rng=self._rng,
                on_restart=self._on_restart,
                tls=tls,
            )
            node.control.slot = i % control_channels
            nodes.append(node)
        self._nodes = tuple(nodes)
        self._by_id = {n.node_id: n for n in nodes}
        self._queue: asyncio.Queue[tuple[SimNode, int]] = asyncio.Queue()
        self._channels: list[Any] = []
        self._stubs: list[control_pb2_grpc.AgentControlStub] = []
        self._workers: list[asyncio.Task[None]] = []
        #: Set whenever a node registers (wakes wait_registered).
        self._registrations = asyncio.Event()
        self._started = False
        self._stopped = False
        #: while set, no node registers or heartbeats (tests that need the agents silent)
        self._held = False
        #: Seconds start() took (servers up, registration scheduled).
        self.start_s = 0.0

    @property
    def nodes(self) -> tuple[SimNode, ...]:
        return self._nodes

    def node(self, node_id: str) -> SimNode:
        """The node with this id (KeyError if there is none)."""
        return self._by_id[node_id]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every server (in batches) and begin registering; return without waiting for
        registrations (see :meth:`wait_registered`). On failure everything started is stopped."""
        if self._started:
            raise RuntimeError("fleet already started")
        self._started = True
        loop = asyncio.get_running_loop()
        began = loop.time()
        self._warn_fd_limit()
        try:
            await self._start_all(loop)
        except BaseException:
            await self.stop()
            raise
        self.start_s = loop.time() - began
        logger.info("sim: %d nodes serving after %.2fs", len(self._nodes), self.start_s)

    async def _start_all(self, loop: asyncio.AbstractEventLoop) -> None:
        self._clock.start()
        for index in range(self._channel_count):
            address = self._addresses[index % len(self._addresses)]
            options = (("grpc.use_local_subchannel_pool", 1),)
            channel = (grpc.aio.secure_channel(address, self._tls.channel_credentials(),
                                               options=options)
                       if self._tls is not None
                       else grpc.aio.insecure_channel(address, options=options))
            self._channels.append(channel)
            stub = control_pb2_grpc.AgentControlStub(channel)  # type: ignore[no-untyped-call]
            self._stubs.append(stub)
        self._workers = [
            loop.create_task(self._worker(), name=f"sim-control-{i}")
            for i in range(self._concurrency)
        ]
        for i in range(0, len(self._nodes), self._start_batch):
            batch = self._nodes[i : i + self._start_batch]
            results = await asyncio.gather(*(n.start() for n in batch), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            # Register each batch at once: registration overlaps the start of the next batch.
            for node in batch:
                self._schedule(node, 0.0)

    async def stop(self) -> None:
        """Stop heartbeating, every server and the scheduler channels; await every task."""
        if self._stopped:
            return
        self._stopped = True
        await self._clock.stop()
        workers, self._workers = self._workers, []
        await _cancel_and_wait(workers)
        for i in range(0, len(self._nodes), self._start_batch):
            await asyncio.gather(*(n.close() for n in self._nodes[i : i + self._start_batch]))
        channels, self._channels = self._channels, []
        self._stubs = []
        for channel in channels:
            await channel.close()

    async def wait_registered(self) -> None:
        """Return once every running node is registered (wrap it in ``asyncio.timeout``)."""
        while any(n.alive and not n.control.registered for n in self._nodes):
            self._registrations.clear()
            await self._registrations.wait()

    # -- statistics --------------------------------------------------------------------------

    def stats(self, *, per_node: bool = False) -> dict[str, Any]:
        """A JSON-ready snapshot of the fleet and its counters."""
        c = self.counters
        states: Counter[str] = Counter()
        over: list[str] = []
        registered = alive = 0
        for node in self._nodes:
            states.update(node.states())
            if node.over_capacity():
                over.append(node.node_id)
            if node.alive:
                alive += 1
                if node.control.registered:
                    registered += 1
        out: dict[str, Any] = {
            "nodes": len(self._nodes),
            "alive": alive,
            "registered": registered,
            "workloads_held": sum(states.values()),
            "workloads_by_state": dict(states),
            "rpcs": dict(c.rpcs),
            "applies": c.applies,
            "double_applies": c.double_applies,
            "double_applies_node_scope": c.double_applies_node_scope,
            "wrong_node_refused": c.wrong_node_refused,
            "max_term_seen": c.max_term_seen,
            "applies_by_term": {str(t): n for t, n in sorted(c.applies_by_term.items())},
            "over_capacity_nodes": len(over),
            "over_capacity_node_ids": over[:50],
            "control": dict(c.control),
            "internal_errors": c.internal_errors,
            "timers_pending": len(self._clock),
            "timer_lag_max_s": round(self._clock.max_lag_s, 4),
            "start_s": round(self.start_s, 3),
        }
        if per_node:
            out["per_node"] = {n.node_id: n.held for n in self._nodes}
        return out

    # -- control loop ------------------------------------------------------------------------

    def _warn_fd_limit(self) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = 2 * len(self._nodes) + 64
        if soft != resource.RLIM_INFINITY and soft < need:
            logger.warning(
                "sim: open-file limit %d is below the ~%d a %d-node fleet needs once a "
                "scheduler connects to every node (one listening socket + one connection each)",
                soft,
                need,
                len(self._nodes),
            )

    def hold_control(self, held: bool) -> None:
        """Postpone every register and heartbeat while ``held`` (a control plane gone quiet).

        For tests whose injected state a heartbeat would repair before they observe it; the
        agents keep serving AgentService meanwhile.
        """
        self._held = held

    def _schedule(self, node: SimNode, delay: float) -> None:
        self._clock.call_later(delay, partial(self._enqueue, node, node.control.gen))

    def _enqueue(self, node: SimNode, gen: int) -> None:
        if node.control.gen == gen and node.alive:
            self._queue.put_nowait((node, gen))

    def _on_restart(self, node: SimNode) -> None:
        if self._started and not self._stopped:
            self._schedule(node, 0.0)

    async def _worker(self) -> None:
        while True:
            node, gen = await self._queue.get()
            if node.control.gen != gen or not node.alive:
                continue
            if self._held:
                self._schedule(node, HOLD_RECHECK_S)
                continue
            try:
                delay = await self._control_step(node, gen)
            except Exception:
                logger.exception("sim: control step failed for %s", node.node_id)
                self.counters.internal_errors += 1
                delay = REGISTER_BACKOFF_MAX_S
            if delay is not None and node.control.gen == gen:
                self._schedule(node, delay)

    def _backoff(self, ctl: ControlState) -> float:
        delay = ctl.backoff_s
        ctl.backoff_s = min(delay * 2, REGISTER_BACKOFF_MAX_S)
        return delay

    async def _control_step(self, node: SimNode, gen: int) -> float | None:
        """Register if needed, then heartbeat; return the delay until the node's next step, or
        None when the node crashed or restarted meanwhile (its new generation is scheduled)."""
        ctl = node.control
        loop = asyncio.get_running_loop()
        stub = self._stubs[ctl.slot]
        counts = self.counters.control
        if not ctl.registered or loop.time() >= ctl.lease_deadline:
            ctl.registered = False
            accepted = False
            interval = 0
            try:
                answer = await stub.RegisterNode(
                    node.register_request(), timeout=self._rpc_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                counts["register_errors"] += 1
                counts[f"register_errors_{exc.code().name}"] += 1
                logger.debug("sim: RegisterNode %s failed: %s", node.node_id, exc.code())
            else:
                accepted = answer.accepted
                interval = answer.heartbeat_interval_seconds
                if not accepted:
                    counts["register_rejected"] += 1
                    logger.debug("sim: RegisterNode %s rejected: %s", node.node_id, answer.reason)
            if ctl.gen != gen:
                return None
            if not accepted:
                return self._backoff(ctl)
            counts["register_ok"] += 1
            ctl.registered = True
            self._registrations.set()
            ctl.heartbeat_ok = False
            ctl.interval_s = self._heartbeat_interval_s or float(
                interval or DEFAULT_HEARTBEAT_INTERVAL_S
            )
            ctl.lease_deadline = loop.time() + AGENT_LEASE_S
        try:
            reply = await stub.Heartbeat(node.heartbeat_request(), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            counts["heartbeat_errors"] += 1
            counts[f"heartbeat_errors_{exc.code().name}"] += 1
            logger.debug("sim: Heartbeat %s failed: %s", node.node_id, exc.code())
            if ctl.gen != gen:
                return None
            ctl.registered = False
            if ctl.heartbeat_ok:
                ctl.heartbeat_ok = False
                return 0.0
            return self._backoff(ctl)
        if ctl.gen != gen:
            return None
        counts["heartbeats_ok"] += 1
        if not reply.acknowledged:
            counts["heartbeats_unacknowledged"] += 1
        if reply.drain_node:
            counts["drain_requested"] += 1
        ctl.heartbeat_ok = True
        ctl.backoff_s = REGISTER_BACKOFF_START_S
        ctl.lease_deadline = loop.time() + AGENT_LEASE_S
        if ctl.first:
            ctl.first = False
            return self._rng.uniform(0.0, ctl.interval_s)
        return ctl.interval_s


# ----------------------------------------------------------------------------------------------
# GET /stats over plain asyncio
# ----------------------------------------------------------------------------------------------


class StatsServer:
    """Serves ``GET /stats`` (``?per_node=1`` adds per-node held counts) as JSON on loopback."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    async def start(self, port: int, host: str = HOST) -> int:
        """Listen on ``host:port`` (0 picks a free port); return the port."""
        self._server = await asyncio.start_server(self._handle, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        await _cancel_and_wait(list(self._handlers))
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            async with asyncio.timeout(10):
                request_line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
            status, body = self._answer(request_line)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            logger.debug("sim: stats request dropped")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            if task is not None:
                self._handlers.discard(task)

    def _answer(self, request_line: bytes) -> tuple[str, bytes]:
        parts = request_line.decode("latin-1").split()
        if len(parts) < 2:
            return "400 Bad Request", b'{"error": "bad request"}'
        method, target = parts[0], urlsplit(parts[1])
        if target.path != "/stats":
            return "404 Not Found", b'{"error": "not found"}'
        if method != "GET":
            return "405 Method Not Allowed", b'{"error": "GET only"}'
        per_node = parse_qs(target.query).get("per_node", ["0"])[0] not in ("", "0", "false")
        return "200 OK", json.dumps(self._fleet.stats(per_node=per_node)).encode()


# ----------------------------------------------------------------------------------------------
# CLI contract (wired into ``persys-scheduler sim`` by ops/cli.py)
# ----------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {value}")
    return value


def _read_tls(paths: list[str] | None) -> SimTls | None:
    if paths is None:
        return None
    try:
        ca, cert, key = (Path(p).read_bytes() for p in paths)
    except OSError as exc:
        raise SystemExit(f"sim: --tls: {exc}") from None
    return SimTls(ca=ca, cert=cert, key=key)


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``sim`` options to ``parser`` (read back by :func:`run_sim`)."""
    parser.add_argument(
        "--scheduler", required=True, metavar="HOST:PORT[,HOST:PORT...]",
        help="the scheduler's gRPC address; several spread the nodes over the replicas"
    )
    parser.add_argument("--nodes", type=_positive_int, default=20, help="nodes (default 20)")
    parser.add_argument(
        "--apply-latency",
        type=_non_negative_float,
        default=0.2,
        metavar="SECONDS",
        help="delay before an applied workload runs (default 0.2)",
    )
    parser.add_argument(
        "--failure-rate",
        type=_probability,
        default=0.0,
        help="probability that an apply ends FAILED (default 0)",
    )
    parser.add_argument(
        "--slow-answer",
        type=_non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="extra delay on every agent RPC (default 0)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="override the interval the scheduler answers at registration",
    )
    parser.add_argument(
        "--first-index",
        type=_positive_int,
        default=1,
        metavar="I",
        help="index of the first node id (default 1); processes with disjoint ranges are one fleet",
    )
    parser.add_argument("--prefix", default="sim-node-", help="node id prefix (default sim-node-)")
    parser.add_argument(
        "--tls", nargs=3, default=None, metavar=("CA", "CERT", "KEY"),
        help="PEM files for mTLS both ways, as a Go agent has (its certificate must name "
             "127.0.0.1); default: plaintext, for a scheduler started with -insecure",
    )
    parser.add_argument(
        "--cpu", type=_positive_int, default=8000, help="millicores per node (default 8000)"
    )
    parser.add_argument(
        "--memory", type=_positive_int, default=16384, help="MiB per node (default 16384)"
    )
    parser.add_argument(
        "--concurrency",
        type=_positive_int,
        default=None,
        help="control RPCs in flight at most (default: one per node, like real agents)",
    )
    parser.add_argument(
        "--control-channels",
        type=_positive_int,
        default=1,
        help="connections to the scheduler (default 1)",
    )
    parser.add_argument(
        "--no-usage",
        action="store_true",
        help="leave per-workload usage snapshots out of heartbeats",
    )
    parser.add_argument(
        "--stats-port",
        type=_non_negative_int,
        default=0,
        help="serve GET /stats as JSON on 127.0.0.1:PORT (default 0: off)",
    )
    parser.add_argument(
        "--report-every",
        type=_non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="log a one-line summary this often (default 10; 0: never)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for jitter and failures")


def _raise_fd_limit(nodes: int) -> None:
    """Raise the soft open-file limit towards the hard one if the fleet may need it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * nodes + 256
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        logger.info("sim: raised the open-file soft limit from %d to %d", soft, target)


async def run_sim(args: argparse.Namespace) -> int:
    """Run a fleet until SIGINT/SIGTERM, then stop it cleanly; return the exit code.

    Prints one JSON line when the fleet is serving (``{"event": "sim_ready", ...}``) and one
    with the final statistics when it stopped (``{"event": "sim_stopped", "stats": ...}``).
    """
    behaviour = NodeBehaviour(
        apply_latency_s=args.apply_latency,
        failure_rate=args.failure_rate,
        slow_answer_s=args.slow_answer,
        cpu_millicores=args.cpu,
        memory_mb=args.memory,
        report_usage=not args.no_usage,
    )
    _raise_fd_limit(args.nodes)
    fleet = Fleet(
        args.scheduler,
        count=args.nodes,
        first=args.first_index,
        prefix=args.prefix,
        behaviour=behaviour,
        heartbeat_interval_s=args.heartbeat_interval,
        concurrency=args.concurrency,
        control_channels=args.control_channels,
        seed=args.seed,
        tls=_read_tls(args.tls),
    )
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stopping.set)
    stats_server: StatsServer | None = None
    try:
        await fleet.start()
        stats_port = 0
        if args.stats_port:
            stats_server = StatsServer(fleet)
            stats_port = await stats_server.start(args.stats_port)
        ports = [n.port for n in fleet.nodes]
        ready = {
            "event": "sim_ready",
            "nodes": len(ports),
            "ports": [min(ports), max(ports)],
            "start_s": round(fleet.start_s, 3),
            "stats_url": f"http://{HOST}:{stats_port}/stats" if stats_port else None,
        }
        print(json.dumps(ready), flush=True)
        while not stopping.is_set():
            if args.report_every <= 0:
                await stopping.wait()
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(args.report_every):
                    await stopping.wait()
            s = fleet.stats()
            logger.info(
                "sim: %d/%d registered, %d workloads held, %d applies, %d over capacity, "
                "%d double applies, %d wrong-node refusals",
                s["registered"],
                s["nodes"],
                s["workloads_held"],
                s["applies"],
                s["over_capacity_nodes"],
                s["double_applies"],
                s["wrong_node_refused"],
            )
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
        if stats_server is not None:
            await stats_server.close()
        final = fleet.stats()  # before stopping: "alive" and "registered" still mean something
        await fleet.stop()
    print(json.dumps({"event": "sim_stopped", "stats": final}), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - manual use; the CLI is ops/cli.py
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    _parser = argparse.ArgumentParser(prog="python -m ops.sim")
    add_sim_arguments(_parser)
    sys.exit(asyncio.run(run_sim(_parser.parse_args())))
