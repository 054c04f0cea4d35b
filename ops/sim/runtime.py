"""The node behaviour model: what a simulated agent's runtime does with an apply or a delete.

Apart from the gRPC side (``ops.sim.node``) because this is the part that decides: which
workloads a node holds and in which state, the asynchronous apply (PENDING at once, the outcome
after ``apply_latency_s`` on the fleet's timer, FAILED with probability ``failure_rate``), the
refused deletes and missing runtimes a :class:`~ops.sim.config.NodeBehaviour` injects, and the
capacity the held workloads use. :class:`SimRuntime` is the base of
:class:`~ops.sim.node.SimNode`; its answers are agent protobuf messages, its input the agent's
requests, and it does no I/O.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

from ops.sim.clock import DueHeap
from ops.sim.config import NodeBehaviour
from proto.persys.agent.v1 import agent_pb2

_MIB = 1024 * 1024

_PENDING = agent_pb2.ACTUAL_STATE_PENDING
_RUNNING = agent_pb2.ACTUAL_STATE_RUNNING
_STOPPED = agent_pb2.ACTUAL_STATE_STOPPED
_FAILED = agent_pb2.ACTUAL_STATE_FAILED
_DESIRED_RUNNING = agent_pb2.DESIRED_STATE_RUNNING
_DESIRED_STOPPED = agent_pb2.DESIRED_STATE_STOPPED
_HOLDS_CAPACITY = frozenset((_PENDING, _RUNNING))

#: Agent ActualState -> the heartbeat's normalised state string.
STATE_NAMES: dict[agent_pb2.ActualState.ValueType, str] = {
    _PENDING: "Pending",
    _RUNNING: "Running",
    _STOPPED: "Stopped",
    _FAILED: "Failed",
}
#: Agent WorkloadType -> the type name of heartbeat usage snapshots and ``missing_runtimes``.
TYPE_NAMES: dict[agent_pb2.WorkloadType.ValueType, str] = {
    agent_pb2.WORKLOAD_TYPE_CONTAINER: "container",
    agent_pb2.WORKLOAD_TYPE_COMPOSE: "compose",
    agent_pb2.WORKLOAD_TYPE_VM: "vm",
    agent_pb2.WORKLOAD_TYPE_MICROVM: "vm",
}


def _requested(spec: agent_pb2.WorkloadSpec) -> tuple[int, int]:
    """(cpu millicores, memory MiB) an agent spec asks for, as the scheduler encodes them."""
    kind = spec.WhichOneof("spec")
    if kind == "container":
        res = spec.container.resources
        return res.cpu_shares, -(-res.memory_bytes // _MIB)
    if kind == "vm":
        return spec.vm.vcpus * 1000, spec.vm.memory_mb
    return 0, 0


@dataclass(slots=True)
class HeldWorkload:
    """One workload a simulated agent holds, with the state of its last apply."""

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


class SimRuntime:
    """The in-memory workloads of one simulated agent and its apply/delete state machine.

    Apply outcomes are scheduled on the fleet's ``clock``; failures are drawn from ``rng``.
    """

    def __init__(self, behaviour: NodeBehaviour, *, clock: DueHeap, rng: random.Random) -> None:
        self.behaviour = behaviour
        self._clock = clock
        self._rng = rng
        self._workloads: dict[str, HeldWorkload] = {}
        #: The unfiltered ListWorkloads answer, rebuilt only after a change (``_changed``).
        #: Building 20 statuses costs the simulator ~130 us per call, which at 5,000 nodes
        #: took CPU the scheduler under test shares on this machine; a real agent's cost is
        #: on its own host.
        self._listing: agent_pb2.ListWorkloadsResponse | None = None
        #: Bumped on crash: pending apply completions of an older epoch are void.
        self._epoch = 0

    def _changed(self) -> None:
        """Every change to the held workloads or their states comes through here."""
        self._listing = None

    # -- crash and restart -------------------------------------------------------------------

    def _void_pending_applies(self) -> None:
        """The node vanished: the outcomes of the applies in flight never arrive."""
        self._epoch += 1

    def _come_back(self, *, keep_workloads: bool) -> None:
        """After a crash: resume the pending applies, or lose every workload."""
        if keep_workloads:
            for w in self._workloads.values():
                if w.actual == _PENDING:
                    self._arm(w)
        else:
            self._workloads.clear()
            self._changed()

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
        return None if w is None else STATE_NAMES.get(w.actual, "Unknown")

    def workload_revision(self, workload_id: str) -> str | None:
        """The revision id of the spec the agent last accepted, or None when not held."""
        w = self._workloads.get(workload_id)
        return None if w is None else w.revision_id

    def running_ids(self) -> list[str]:
        """The ids of the workloads this agent holds Running."""
        return [wid for wid, w in self._workloads.items()
                if STATE_NAMES.get(w.actual) == "Running"]

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
        return Counter(STATE_NAMES.get(w.actual, "Unknown") for w in self._workloads.values())

    # -- listing and delete ------------------------------------------------------------------

    def _list(self, wanted: agent_pb2.WorkloadType.ValueType) -> agent_pb2.ListWorkloadsResponse:
        """The ListWorkloads answer: every held workload, or those of type ``wanted``."""
        if wanted:
            return agent_pb2.ListWorkloadsResponse(
                workloads=[self._status(w) for w in self._workloads.values() if w.type == wanted]
            )
        if self._listing is None:
            self._listing = agent_pb2.ListWorkloadsResponse(
                workloads=[self._status(w) for w in self._workloads.values()]
            )
        return self._listing

    def _delete(self, request: agent_pb2.DeleteWorkloadRequest) -> agent_pb2.DeleteWorkloadResponse:
        if not request.id:
            return agent_pb2.DeleteWorkloadResponse(
                success=False, message="invalid request: workload id is required"
            )
        if self.behaviour.refuse_deletes:
            return agent_pb2.DeleteWorkloadResponse(
                success=False, message="cannot delete the workload now: runtime busy")
        if self.behaviour.delete_latency_s > 0 and request.id in self._workloads:
            self._clock.call_later(self.behaviour.delete_latency_s,
                                   partial(self._remove, request.id, self._epoch))
        else:
            self._remove(request.id, self._epoch)
        return agent_pb2.DeleteWorkloadResponse(
            success=True, message="workload deletion submitted for processing"
        )

    def _remove(self, workload_id: str, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._workloads.pop(workload_id, None)
        self._changed()

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
        if TYPE_NAMES.get(wtype, "") in self.behaviour.missing_runtimes:
            return agent_pb2.ApplyWorkloadResponse(
                applied=False, message=f"runtime not available: {TYPE_NAMES[wtype]}")
        cpu_m, memory_mb = _requested(request.spec)
        now = int(time.time())
        task_id = f"apply-{request.id}-{time.time_ns()}"
        if w is None:
            w = HeldWorkload(
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

    def _arm(self, w: HeldWorkload) -> None:
        """Schedule the outcome of ``w``'s pending apply on the fleet's timer."""
        w.gen += 1
        self._clock.call_later(
            self.behaviour.apply_latency_s, partial(self._finish_apply, w, w.gen, self._epoch)
        )

    def _finish_apply(self, w: HeldWorkload, gen: int, epoch: int) -> None:
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

    def _submitted(self, w: HeldWorkload) -> agent_pb2.ApplyWorkloadResponse:
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
    def _status(w: HeldWorkload) -> agent_pb2.WorkloadStatus:
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
