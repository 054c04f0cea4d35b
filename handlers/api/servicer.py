"""The ``persys.control.v1.AgentControl`` servicer: thin, validate -> one handler -> answer.

Errors follow docs/architecture.md, "Errors and answers": the RPCs Go clients already call answer
expected failures in-band (``accepted``/``success`` false with a reason, ``INVALID_SPEC`` naming
the field); the new RPCs and reads use gRPC status codes, with UNAVAILABLE naming the mode when
the scheduler is degraded. RPCs that a later feature implements answer UNIMPLEMENTED naming it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Protocol

import grpc

from eventsource.errors import Conflict, OutcomeUnknown, StoreError
from eventsource.metrics import Metrics
from handlers.api.access import caller_of
from handlers.api.convert import disk_view, node_view, workload_view
from handlers.api.explain import PlacementExplainer
from handlers.api.spec_message import spec_message
from handlers.api.watchlimits import WatchLimits, peer_host
from handlers.cluster.modes import ModeState
from handlers.identity.authz import Caller
from handlers.nodes.commands import NodeCommands
from handlers.nodes.usage import UsageSink
from handlers.settings.config import Settings
from handlers.specs.fields import (
    REASON_MAX,
    InvalidSpec,
    check_label,
    check_text,
    validate_id,
)
from handlers.specs.validation import parse_apply, spec_size
from handlers.storage.buckets.commands import BucketCommands
from handlers.storage.buckets.model import (
    BucketError,
    access_message,
    bucket_view,
    object_message,
)
from handlers.storage.disks import DiskCommands, DiskError, DiskRequest
from handlers.workloads.commands import WorkloadCommands
from handlers.workloads.outcome import Outcome
from handlers.writes.cas import NotFound
from projections.cluster import ClusterProjection
from proto.persys.control.v1 import control_pb2, control_pb2_grpc

log = logging.getLogger("persys.api")

FAILURE = control_pb2.FailureReason
#: what a taint's effect may be ("" means NoSchedule, as in the Go version)
TAINT_EFFECTS = frozenset({"", "NoSchedule", "PreferNoSchedule"})


class EventQueries(Protocol):
    async def list_events(self, req: control_pb2.ListEventsRequest,
                          context: grpc.aio.ServicerContext) -> control_pb2.ListEventsResponse: ...

    def watch_events(self, req: control_pb2.WatchEventsRequest,
                     context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[control_pb2.SchedulerEventView]: ...


def not_stored(exc: Exception) -> str:
    """The message of a command whose write failed: an unknown outcome is not "not stored"
    (etcd may have applied it and lost only its answer)."""
    if isinstance(exc, OutcomeUnknown):
        return (f"outcome unknown, the change may have been stored: {exc}; send the same "
                "request again to learn")
    return f"state not stored: {exc}"


class ControlServicer(control_pb2_grpc.AgentControlServicer):
    """Every AgentControl RPC."""

    def __init__(
        self,
        *,
        settings: Settings,
        cluster: ClusterProjection,
        nodes: NodeCommands,
        workloads: WorkloadCommands,
        usage: UsageSink,
        events: EventQueries | None,
        mode: ModeState,
        metrics: Metrics,
        disks: DiskCommands | None = None,
        buckets: BucketCommands | None = None,
        explainer: PlacementExplainer | None = None,
    ) -> None:
        self.explainer = explainer
        self.disks = disks
        self.buckets = buckets
        self.settings = settings
        self.cluster = cluster
        self.nodes = nodes
        self.workloads = workloads
        self.usage = usage
        self.events = events
        self.mode = mode
        self.metrics = metrics
        self.watch_limits = WatchLimits(settings.watch_max, settings.watch_max_per_caller)

    # -- helpers ----------------------------------------------------------------------------
    async def _require_writable(self, context: grpc.aio.ServicerContext) -> None:
        if not self.mode.writable:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"scheduler {self.mode.mode}: {self.mode.reason}")

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller | None:
        """The client certificate's identity, or None without TLS (nothing to bind to)."""
        return None if self.settings.insecure else caller_of(context)

    # -- registration and heartbeat (in-band errors) ----------------------------------------
    async def RegisterNode(self, request: control_pb2.RegisterNodeRequest,
                           context: grpc.aio.ServicerContext
                           ) -> control_pb2.RegisterNodeResponse:
        outcome = await self.nodes.register(request, self._caller(context))
        resp = control_pb2.RegisterNodeResponse(
            accepted=outcome.accepted, reason=outcome.reason,
            heartbeat_interval_seconds=outcome.interval_s)
        if outcome.lease_expires_at is not None:
            resp.lease_expires_at.FromDatetime(outcome.lease_expires_at)
        if not outcome.accepted:
            log.info("registration refused node_id=%s reason=%r", request.node_id, outcome.reason)
        return resp

    async def Heartbeat(self, request: control_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> control_pb2.HeartbeatResponse:
        outcome = await self.nodes.heartbeat(request, self._caller(context))
        if outcome.refused:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, outcome.refused)
        if not outcome.known:
            # the Go agent re-registers when a heartbeat fails: that is what an unknown node needs
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"node {request.node_id!r} is not registered")
        resp = control_pb2.HeartbeatResponse(acknowledged=True, drain_node=outcome.drain)
        if outcome.lease_expires_at is not None:
            resp.lease_expires_at.FromDatetime(outcome.lease_expires_at)
        return resp

    # -- workload commands (in-band errors) --------------------------------------------------
    @staticmethod
    def _apply_response(outcome: Outcome) -> control_pb2.ApplyWorkloadResponse:
        if outcome.ok:
            return control_pb2.ApplyWorkloadResponse(success=True)
        reason = FAILURE.Value(outcome.failure) if outcome.failure else FAILURE.RUNTIME_ERROR
        return control_pb2.ApplyWorkloadResponse(
            success=False, failure_reason=reason, error_message=outcome.message)

    async def ApplyWorkload(self, request: control_pb2.ApplyWorkloadRequest,
                            context: grpc.aio.ServicerContext
                            ) -> control_pb2.ApplyWorkloadResponse:
        size = spec_size(request)
        if size > self.settings.max_spec_bytes:
            return control_pb2.ApplyWorkloadResponse(
                success=False, failure_reason=FAILURE.INVALID_SPEC,
                error_message=f"spec: {size} bytes exceeds the limit of "
                              f"{self.settings.max_spec_bytes} bytes")
        try:
            parsed = parse_apply(request, created_at=datetime.now(UTC).isoformat())
        except InvalidSpec as exc:
            return control_pb2.ApplyWorkloadResponse(
                success=False, failure_reason=FAILURE.INVALID_SPEC, error_message=str(exc))
        try:
            outcome = await self.workloads.apply(parsed)
        except StoreError as exc:
            outcome = Outcome(False, "RUNTIME_ERROR", not_stored(exc))
        return self._apply_response(outcome)

    async def DeleteWorkload(self, request: control_pb2.DeleteWorkloadRequest,
                             context: grpc.aio.ServicerContext
                             ) -> control_pb2.DeleteWorkloadResponse:
        try:
            workload_id = validate_id("workload_id", request.workload_id)
            outcome = await self.workloads.delete(workload_id)
        except InvalidSpec as exc:
            outcome = Outcome(False, "INVALID_SPEC", str(exc))
        except (StoreError, Conflict) as exc:
            outcome = Outcome(False, "RUNTIME_ERROR", not_stored(exc))
        return control_pb2.DeleteWorkloadResponse(success=outcome.ok,
                                                  error_message=outcome.message if not outcome.ok
                                                  else "")

    async def RetryWorkload(self, request: control_pb2.RetryWorkloadRequest,
                            context: grpc.aio.ServicerContext
                            ) -> control_pb2.RetryWorkloadResponse:
        try:
            workload_id = validate_id("workload_id", request.workload_id)
            outcome = await self.workloads.retry(workload_id)
        except (InvalidSpec, StoreError, Conflict) as exc:
            log.info("retry refused workload_id=%r: %s", request.workload_id, exc)
            return control_pb2.RetryWorkloadResponse(accepted=False)
        return control_pb2.RetryWorkloadResponse(accepted=outcome.ok)

    async def SubmitAutomationSuggestion(
        self, request: control_pb2.SubmitAutomationSuggestionRequest,
        context: grpc.aio.ServicerContext,
    ) -> control_pb2.SubmitAutomationSuggestionResponse:
        s = request.suggestion
        now = datetime.now(UTC)
        action = s.action_type
        A = control_pb2.AutomationActionType

        def answer(accepted: bool, reason: str, applied: str = ""
                   ) -> control_pb2.SubmitAutomationSuggestionResponse:
            resp = control_pb2.SubmitAutomationSuggestionResponse(
                accepted=accepted, decision="accepted" if accepted else "rejected",
                reason=reason, applied_action=applied if accepted else "")
            resp.decided_at.FromDatetime(now)
            return resp

        try:
            workload_id = validate_id("suggestion.target_workload", s.target_workload)
        except InvalidSpec as exc:
            return answer(False, str(exc))
        if not self.mode.writable:
            return answer(False, f"scheduler {self.mode.mode}: {self.mode.reason}")
        try:
            if action == A.AUTOMATION_ACTION_SET_DESIRED_STATE:
                if not s.desired_state.strip():
                    return answer(False, "suggestion.desired_state: required")
                req = control_pb2.ApplyWorkloadRequest(workload_id=workload_id,
                                                       desired_state=s.desired_state)
                outcome = await self.workloads.apply(parse_apply(req, created_at=""))
                return answer(outcome.ok, outcome.message or "desired state updated",
                              "set_desired_state")
            if action == A.AUTOMATION_ACTION_RETRY_WORKLOAD:
                outcome = await self.workloads.retry(workload_id)
                return answer(outcome.ok, outcome.message or "retry triggered", "retry_workload")
            if action == A.AUTOMATION_ACTION_DELETE_WORKLOAD:
                outcome = await self.workloads.delete(workload_id)
                return answer(outcome.ok, outcome.message or "delete requested",
                              "delete_workload")
            if action == A.AUTOMATION_ACTION_SCALE_REPLICAS:
                return answer(False, "replica updates are not supported by the scheduler")
        except (StoreError, Conflict, InvalidSpec) as exc:
            return answer(False, str(exc))
        return answer(False, "suggestion.action_type: unspecified or unknown")

    # -- node control (status codes) --------------------------------------------------------
    async def _node_control(self, context: grpc.aio.ServicerContext, node_id_raw: str,
                            body: Callable[[str], Awaitable[Any]]) -> Any:
        try:
            node_id = validate_id("node_id", node_id_raw)
        except InvalidSpec as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self._require_writable(context)
        try:
            return await body(node_id)
        except InvalidSpec as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NotFound:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node {node_id!r} not found")
        except Conflict as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"concurrent updates: {exc}")
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd: {exc}")

    async def _node_view(self, node_id: str) -> control_pb2.NodeView:
        if self.cluster.nodes.get(node_id) is None:
            return control_pb2.NodeView(node_id=node_id)
        reports = await self.usage.last_reports([node_id])
        at, used = reports.get(node_id, (None, None))
        return self._view_of(node_id, at, used) or control_pb2.NodeView(node_id=node_id)

    def _control_view(self, node_id: str) -> control_pb2.NodeView:
        """The view a node control (drain, taint, label) answers with: its last heartbeat as
        this replica saw it, without the Redis read GetNode makes. Why: a label or taint
        change is a write path that runs at hundreds per second (the events benchmark), and
        the answer is about the change, not the heartbeat."""
        return self._view_of(node_id, self.usage.heartbeat_seen_here(node_id),
                             self.usage.used_seen_here(node_id)) or (
            control_pb2.NodeView(node_id=node_id))

    def _view_of(self, node_id: str, last_heartbeat: datetime | None,
                 used: tuple[int, int] | None = None) -> control_pb2.NodeView | None:
        """The node's view from the projections; ``last_heartbeat`` from handlers.nodes.usage (a
        heartbeat writes nothing to etcd)."""
        item = self.cluster.nodes.get(node_id)
        if item is None:
            return None
        alloc = self.cluster.allocations.get(node_id)
        return node_view(item.value, alloc.value if alloc else None,
                         alive=self.cluster.alive.get(node_id) is not None,
                         last_heartbeat=last_heartbeat, used=used)

    async def _check_reason(self, context: grpc.aio.ServicerContext, reason: str) -> None:
        try:
            check_text("reason", reason, REASON_MAX)
        except InvalidSpec as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def DrainNode(self, request: control_pb2.DrainNodeRequest,
                        context: grpc.aio.ServicerContext) -> control_pb2.DrainNodeResponse:
        await self._check_reason(context, request.reason)

        async def body(node_id: str) -> control_pb2.DrainNodeResponse:
            _node, moved = await self.nodes.drain(node_id, request.reason)
            return control_pb2.DrainNodeResponse(
                accepted=True, message=f"node draining; {moved} workloads relocated",
                relocated_workloads=moved, node=self._control_view(node_id))
        result: control_pb2.DrainNodeResponse = await self._node_control(
            context, request.node_id, body)
        return result

    async def UndrainNode(self, request: control_pb2.UndrainNodeRequest,
                          context: grpc.aio.ServicerContext) -> control_pb2.UndrainNodeResponse:
        await self._check_reason(context, request.reason)

        async def body(node_id: str) -> control_pb2.UndrainNodeResponse:
            await self.nodes.undrain(node_id, request.reason)
            return control_pb2.UndrainNodeResponse(accepted=True, message="node ready",
                                                   node=self._control_view(node_id))
        result: control_pb2.UndrainNodeResponse = await self._node_control(
            context, request.node_id, body)
        return result

    async def TaintNode(self, request: control_pb2.TaintNodeRequest,
                        context: grpc.aio.ServicerContext) -> control_pb2.TaintNodeResponse:
        taint = request.taint
        if not taint.key.strip():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "taint.key: required")
        if taint.effect not in TAINT_EFFECTS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "taint.effect: must be NoSchedule or PreferNoSchedule")
        await self._check_label(context, "taint", taint.key.strip(), taint.value)

        async def body(node_id: str) -> control_pb2.TaintNodeResponse:
            await self.nodes.taint(node_id, taint.key.strip(), taint.value, taint.effect)
            return control_pb2.TaintNodeResponse(accepted=True, message="tainted",
                                                  node=self._control_view(node_id))
        result: control_pb2.TaintNodeResponse = await self._node_control(
            context, request.node_id, body)
        return result

    async def UntaintNode(self, request: control_pb2.UntaintNodeRequest,
                          context: grpc.aio.ServicerContext) -> control_pb2.UntaintNodeResponse:
        if not request.key.strip():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "key: required")
        if request.effect not in TAINT_EFFECTS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "effect: must be empty, NoSchedule or PreferNoSchedule")
        await self._check_label(context, "taint", request.key.strip(), "")

        async def body(node_id: str) -> control_pb2.UntaintNodeResponse:
            await self.nodes.untaint(node_id, request.key.strip(), request.effect)
            return control_pb2.UntaintNodeResponse(accepted=True, message="untainted",
                                                    node=self._control_view(node_id))
        result: control_pb2.UntaintNodeResponse = await self._node_control(
            context, request.node_id, body)
        return result

    async def SetNodeLabel(self, request: control_pb2.SetNodeLabelRequest,
                           context: grpc.aio.ServicerContext
                           ) -> control_pb2.SetNodeLabelResponse:
        await self._check_label_key(context, request.key.strip())
        await self._check_label(context, "label", request.key.strip(), request.value)

        async def body(node_id: str) -> control_pb2.SetNodeLabelResponse:
            await self.nodes.set_label(node_id, request.key.strip(), request.value)
            return control_pb2.SetNodeLabelResponse(accepted=True, message="label set",
                                                     node=self._control_view(node_id))
        result: control_pb2.SetNodeLabelResponse = await self._node_control(
            context, request.node_id, body)
        return result

    async def DeleteNodeLabel(self, request: control_pb2.DeleteNodeLabelRequest,
                              context: grpc.aio.ServicerContext
                              ) -> control_pb2.DeleteNodeLabelResponse:
        await self._check_label_key(context, request.key.strip())
        await self._check_label(context, "label", request.key.strip(), "")

        async def body(node_id: str) -> control_pb2.DeleteNodeLabelResponse:
            await self.nodes.delete_label(node_id, request.key.strip())
            return control_pb2.DeleteNodeLabelResponse(accepted=True, message="label deleted",
                                                        node=self._control_view(node_id))
        result: control_pb2.DeleteNodeLabelResponse = await self._node_control(
            context, request.node_id, body)
        return result

    @staticmethod
    async def _check_label_key(context: grpc.aio.ServicerContext, key: str) -> None:
        """A label key an operator may set or delete: given, and not the scheduler's own."""
        if not key:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "key: required")
        if key == "scheduler_shard":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "key: scheduler_shard is managed by the scheduler")

    @staticmethod
    async def _check_label(context: grpc.aio.ServicerContext, field: str, key: str,
                           value: str) -> None:
        try:
            check_label(field, key, value)
        except InvalidSpec as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    # -- reads (projections) ----------------------------------------------------------------
    async def _require_ready(self, context: grpc.aio.ServicerContext) -> None:
        if not self.cluster.is_ready():
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "scheduler is loading its projections from etcd")

    async def ListNodes(self, request: control_pb2.ListNodesRequest,
                        context: grpc.aio.ServicerContext) -> control_pb2.ListNodesResponse:
        await self._require_ready(context)
        wanted = request.status.strip().lower()
        resp = control_pb2.ListNodesResponse()
        node_ids = sorted(self.cluster.nodes.items)
        reports = await self.usage.last_reports(node_ids)  # one read for the whole listing
        for node_id in node_ids:
            at, used = reports.get(node_id, (None, None))
            view = self._view_of(node_id, at, used)
            if view is None or (wanted and view.status.lower() != wanted):
                continue  # deleted while the heartbeat times were read, or filtered out
            resp.nodes.append(view)
        return resp

    async def GetNode(self, request: control_pb2.GetNodeRequest,
                      context: grpc.aio.ServicerContext) -> control_pb2.GetNodeResponse:
        await self._require_ready(context)
        try:
            validate_id("node_id", request.node_id)
        except InvalidSpec as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            found = await self.cluster.nodes.get_fresh(request.node_id.strip())
        except StoreError as exc:
            # not in the projection, and etcd cannot say whether it was just created
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd: {exc}")
        if found is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node {request.node_id!r} not found")
        return control_pb2.GetNodeResponse(node=await self._node_view(request.node_id.strip()))

    async def ListWorkloads(self, request: control_pb2.ListWorkloadsRequest,
                            context: grpc.aio.ServicerContext
                            ) -> control_pb2.ListWorkloadsResponse:
        await self._require_ready(context)
        wanted = request.status.strip().lower()
        node_filter = request.node_id.strip()
        if node_filter:
            ids = sorted(wid for wid, item in self.cluster.statuses.items.items()
                         if (item.value.node_id or item.value.assigned_node) == node_filter)
        else:
            ids = sorted(self.cluster.specs.items)
        resp = control_pb2.ListWorkloadsResponse()
        for wid in ids:
            spec = self.cluster.specs.get(wid)
            if spec is None:
                continue
            status = self.cluster.statuses.get(wid)
            # the status itself, not its view's text: a VM's shows "Running (ip=...)"
            shown = (status.value.status if status else "") or "Unknown"
            if wanted and shown.lower() != wanted:
                continue
            resp.workloads.append(workload_view(spec.value, status.value if status else None))
        return resp

    async def GetWorkload(self, request: control_pb2.GetWorkloadRequest,
                          context: grpc.aio.ServicerContext) -> control_pb2.GetWorkloadResponse:
        await self._require_ready(context)
        wid = request.workload_id.strip()
        try:
            validate_id("workload_id", wid)
        except InvalidSpec as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            spec = await self.cluster.specs.get_fresh(wid)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd: {exc}")
        if spec is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"workload {wid!r} not found")
        assert spec is not None
        status = self.cluster.statuses.get(wid)
        usage = await self.usage.get(wid)
        return control_pb2.GetWorkloadResponse(
            workload=workload_view(spec.value, status.value if status else None, usage),
            spec=spec_message(spec.value, status.value.metadata if status else {}))

    async def GetClusterSummary(self, request: control_pb2.GetClusterSummaryRequest,
                                context: grpc.aio.ServicerContext
                                ) -> control_pb2.GetClusterSummaryResponse:
        await self._require_ready(context)
        resp = control_pb2.GetClusterSummaryResponse()
        for item in self.cluster.nodes.items.values():
            resp.total_nodes += 1
            if item.value.status.lower() == "ready":
                resp.ready_nodes += 1
            else:
                resp.not_ready_nodes += 1
        for wid, spec in self.cluster.specs.items.items():
            resp.total_workloads += 1
            st = self.cluster.statuses.get(wid)
            status = (st.value.status if st else "").lower()
            if spec.value.desired_state.lower() == "deleted" or status == "deleted":
                resp.deleted_workloads += 1
            elif status == "running":
                resp.running_workloads += 1
            elif status == "failed":
                resp.failed_workloads += 1
            elif status in ("pending", "unknown", "updating", "scheduled", ""):
                resp.pending_workloads += 1
        resp.generated_at.FromDatetime(datetime.now(UTC))
        return resp

    # -- events -----------------------------------------------------------------------------
    async def ListEvents(self, request: control_pb2.ListEventsRequest,
                         context: grpc.aio.ServicerContext) -> control_pb2.ListEventsResponse:
        if self.events is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "events need REDIS_ADDR")
        assert self.events is not None
        return await self.events.list_events(request, context)

    async def WatchEvents(self, request: control_pb2.WatchEventsRequest,
                          context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[control_pb2.SchedulerEventView]:
        if self.events is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "events need REDIS_ADDR")
        assert self.events is not None
        caller = self._caller(context)
        identity = caller.describe() if caller is not None else peer_host(context.peer())
        refusal = self.watch_limits.acquire(identity)
        if refusal is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        try:
            async for view in self.events.watch_events(request, context):
                yield view
        finally:
            self.watch_limits.release(identity)

    # -- not yet implemented features -------------------------------------------------------
    async def ControlStream(self, request_iterator: Any, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[control_pb2.ControlMessage]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "ControlStream is not implemented (as in the Go scheduler)")
        yield control_pb2.ControlMessage()  # pragma: no cover

    async def _unimplemented(self, context: grpc.aio.ServicerContext, feature: str) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{feature} is not implemented yet in this scheduler")

    async def _disk_call(self, context: grpc.aio.ServicerContext, body: Any,
                         *, mutating: bool) -> Any:
        if self.disks is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the disk API is not configured")
        if mutating:
            await self._require_writable(context)
        try:
            return await body()
        except DiskError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd: {exc}")

    async def CreateDisk(self, request: control_pb2.CreateDiskRequest,
                         context: grpc.aio.ServicerContext) -> control_pb2.CreateDiskResponse:
        async def body() -> control_pb2.CreateDiskResponse:
            assert self.disks is not None
            record = await self.disks.create(DiskRequest(
                name=request.name, driver=request.driver, size_gb=request.size_gb,
                fs_type=request.fs_type, access_mode=request.access_mode,
                retain_policy=request.retain_policy, node_id=request.node_id,
                mount_path=request.mount_path))
            return control_pb2.CreateDiskResponse(disk=disk_view(record))

        result: control_pb2.CreateDiskResponse = await self._disk_call(context, body,
                                                                       mutating=True)
        return result

    async def ListDisks(self, request: control_pb2.ListDisksRequest,
                        context: grpc.aio.ServicerContext) -> control_pb2.ListDisksResponse:
        async def body() -> control_pb2.ListDisksResponse:
            assert self.disks is not None
            return control_pb2.ListDisksResponse(
                disks=[disk_view(r) for r in await self.disks.list()])

        result: control_pb2.ListDisksResponse = await self._disk_call(context, body,
                                                                      mutating=False)
        return result

    async def GetDisk(self, request: control_pb2.GetDiskRequest,
                      context: grpc.aio.ServicerContext) -> control_pb2.GetDiskResponse:
        async def body() -> control_pb2.GetDiskResponse:
            assert self.disks is not None
            _, record = await self.disks.get(request.disk_id)
            return control_pb2.GetDiskResponse(disk=disk_view(record))

        result: control_pb2.GetDiskResponse = await self._disk_call(context, body,
                                                                    mutating=False)
        return result

    async def DeleteDisk(self, request: control_pb2.DeleteDiskRequest,
                         context: grpc.aio.ServicerContext) -> control_pb2.DeleteDiskResponse:
        async def body() -> control_pb2.DeleteDiskResponse:
            assert self.disks is not None
            await self.disks.delete(request.disk_id, force=request.force)
            return control_pb2.DeleteDiskResponse(success=True)

        result: control_pb2.DeleteDiskResponse = await self._disk_call(context, body,
                                                                       mutating=True)
        return result

    # -- buckets (Ceph RGW + Vault; handlers/storage/buckets/) ------------------------------------
    async def _bucket_call(self, context: grpc.aio.ServicerContext, body: Any) -> Any:
        if self.buckets is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "buckets need PERSYS_RGW_ENDPOINT, PERSYS_RGW_ACCESS_KEY and "
                "PERSYS_RGW_SECRET_KEY (and PERSYS_VAULT_ADDR for the bucket credentials)")
        try:
            return await body()
        except BucketError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))

    async def CreateBucket(self, request: control_pb2.CreateBucketRequest,
                           context: grpc.aio.ServicerContext) -> control_pb2.CreateBucketResponse:
        async def body() -> control_pb2.CreateBucketResponse:
            assert self.buckets is not None
            info, access = await self.buckets.create(request.name, request.region,
                                                     request.versioning)
            return control_pb2.CreateBucketResponse(bucket=bucket_view(info),
                                                    access=access_message(access))

        result: control_pb2.CreateBucketResponse = await self._bucket_call(context, body)
        return result

    async def ListBuckets(self, request: control_pb2.ListBucketsRequest,
                          context: grpc.aio.ServicerContext) -> control_pb2.ListBucketsResponse:
        async def body() -> control_pb2.ListBucketsResponse:
            assert self.buckets is not None
            return control_pb2.ListBucketsResponse(
                buckets=[bucket_view(i) for i in await self.buckets.list()])

        result: control_pb2.ListBucketsResponse = await self._bucket_call(context, body)
        return result

    async def GetBucket(self, request: control_pb2.GetBucketRequest,
                        context: grpc.aio.ServicerContext) -> control_pb2.GetBucketResponse:
        async def body() -> control_pb2.GetBucketResponse:
            assert self.buckets is not None
            return control_pb2.GetBucketResponse(
                bucket=bucket_view(await self.buckets.get(request.bucket_id)))

        result: control_pb2.GetBucketResponse = await self._bucket_call(context, body)
        return result

    async def DeleteBucket(self, request: control_pb2.DeleteBucketRequest,
                           context: grpc.aio.ServicerContext) -> control_pb2.DeleteBucketResponse:
        async def body() -> control_pb2.DeleteBucketResponse:
            assert self.buckets is not None
            await self.buckets.delete(request.bucket_id, force=request.force)
            return control_pb2.DeleteBucketResponse(success=True)

        result: control_pb2.DeleteBucketResponse = await self._bucket_call(context, body)
        return result

    async def GetBucketAccess(self, request: control_pb2.GetBucketAccessRequest,
                              context: grpc.aio.ServicerContext
                              ) -> control_pb2.GetBucketAccessResponse:
        async def body() -> control_pb2.GetBucketAccessResponse:
            assert self.buckets is not None
            access = await self.buckets.access(request.bucket_id)
            return control_pb2.GetBucketAccessResponse(access=access_message(access))

        result: control_pb2.GetBucketAccessResponse = await self._bucket_call(context, body)
        return result

    async def ListBucketObjects(self, request: control_pb2.ListBucketObjectsRequest,
                                context: grpc.aio.ServicerContext
                                ) -> control_pb2.ListBucketObjectsResponse:
        async def body() -> control_pb2.ListBucketObjectsResponse:
            assert self.buckets is not None
            page = await self.buckets.list_objects(
                request.bucket_id, prefix=request.prefix,
                continuation_token=request.continuation_token, max_keys=request.max_keys)
            return control_pb2.ListBucketObjectsResponse(
                objects=[object_message(o) for o in page.objects],
                next_continuation_token=page.next_continuation_token,
                is_truncated=page.is_truncated, prefix=page.prefix)

        result: control_pb2.ListBucketObjectsResponse = await self._bucket_call(context, body)
        return result

    # -- placement explanations (gRPC status codes) -----------------------------------------
    async def ExplainPlacement(self, request: control_pb2.ExplainPlacementRequest,
                               context: grpc.aio.ServicerContext
                               ) -> control_pb2.ExplainPlacementResponse:
        await self._require_ready(context)
        if self.explainer is None:
            refused: control_pb2.ExplainPlacementResponse = await self._unimplemented(
                context, "placement explanations")
            return refused
        return await self.explainer.explain(request, context, now=datetime.now(UTC))
