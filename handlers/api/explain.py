"""ExplainPlacement: why a stored workload is where it is, or where a spec would go.

The answer comes from ``handlers.placement.explanation``, the pure explanation built on the
placement function itself, fed by this replica's placer (the same node index, allocation
sums, liveness set and in-flight reservations a placement reads). Nothing is stored.

Bounds: the request is validated as ApplyWorkload validates it (``INVALID_ARGUMENT`` naming
the field); the answer holds counts by reason, at most 50 candidates and 20 refusals in full,
so it stays a few kilobytes at 5,000 nodes.
"""

from __future__ import annotations

from datetime import datetime

import grpc

from handlers.api.convert import set_time
from handlers.placement.decision import PlacementRequest
from handlers.placement.explanation import TOP_MAX, Explanation
from handlers.placement.placer import Placer
from handlers.specs.fields import InvalidSpec, validate_id
from handlers.specs.validation import parse_apply
from handlers.workloads.assignment import placement_request
from projections.cluster import ClusterProjection
from proto.persys.control.v1 import control_pb2

DEFAULT_TOP = 5
#: the workload id a spec is judged under when the request names none (it seeds the
#: tie-break, so name the id you will apply it with to see the same choice)
SPEC_ID = "explain"


class PlacementExplainer:
    """Answers ExplainPlacement from the projections and the placer."""

    def __init__(self, cluster: ClusterProjection, placer: Placer) -> None:
        self.cluster = cluster
        self.placer = placer

    async def explain(self, request: control_pb2.ExplainPlacementRequest,
                      context: grpc.aio.ServicerContext, *, now: datetime
                      ) -> control_pb2.ExplainPlacementResponse:
        if not 0 <= request.top <= TOP_MAX:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"top: must be 0-{TOP_MAX}")
        top = request.top or DEFAULT_TOP
        try:
            if request.HasField("spec"):
                return self._of_spec(request, top, now)
            return self._of_stored(validate_id("workload_id", request.workload_id), top, now)
        except InvalidSpec as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        raise AssertionError("unreachable")  # abort raises

    def _of_spec(self, request: control_pb2.ExplainPlacementRequest, top: int,
                 now: datetime) -> control_pb2.ExplainPlacementResponse:
        workload_id = request.workload_id.strip() or SPEC_ID
        parsed = parse_apply(control_pb2.ApplyWorkloadRequest(
            workload_id=workload_id, spec=request.spec), created_at="")
        assert parsed.spec is not None  # a request with a spec parses to one
        req = placement_request(parsed.spec)
        return self._with_holds(_response(req, self.placer.explain(req, top=top), now))

    def _of_stored(self, workload_id: str, top: int,
                   now: datetime) -> control_pb2.ExplainPlacementResponse:
        spec_item = self.cluster.specs.get(workload_id)
        if spec_item is None:
            raise LookupError(f"workload {workload_id!r} not found")
        status_item = self.cluster.statuses.get(workload_id)
        node_id = status_item.value.node_id if status_item else ""
        req = placement_request(spec_item.value)
        allocation = self.cluster.allocations.get(node_id) if node_id else None
        leave_out = ((node_id, req.cpu_m, req.mem_mb) if allocation is not None
                     and workload_id in allocation.value.workloads else None)
        resp = self._with_holds(
            _response(req, self.placer.explain(req, top=top, leave_out=leave_out), now))
        resp.assigned_node_id = node_id
        if status_item is not None:
            resp.assigned_reason = str(status_item.value.metadata.get("assignment_reason", ""))
        return resp

    def _with_holds(self, resp: control_pb2.ExplainPlacementResponse
                    ) -> control_pb2.ExplainPlacementResponse:
        """This replica's in-flight reservations: each lowered its node's free capacity."""
        holds = self.placer.reservations.by_node.values()
        resp.reservations = len(self.placer.reservations.holds())
        resp.reserved_cpu_millicores = sum(cpu for cpu, _ in holds)
        resp.reserved_memory_mb = sum(mem for _, mem in holds)
        return resp


def _response(req: PlacementRequest, found: Explanation,
              now: datetime) -> control_pb2.ExplainPlacementResponse:
    resp = control_pb2.ExplainPlacementResponse(
        workload_id=req.workload_id, chosen_node_id=found.chosen or "",
        nodes_total=found.total, nodes_fit=found.fit, summary=found.summary,
        workload_type=req.workload_type, cpu_millicores=req.cpu_m, memory_mb=req.mem_mb)
    for kind, count in found.refusals:
        resp.refusals.append(control_pb2.PlacementRefusalCount(reason=kind, nodes=count))
    for node_id, why in found.sample:
        resp.refusal_sample.append(control_pb2.PlacementRefusal(node_id=node_id, reason=why))
    for c in found.candidates:
        resp.candidates.append(control_pb2.PlacementCandidate(
            node_id=c.scored.node_id, score=c.scored.score, cpu_headroom=c.scored.cpu_headroom,
            memory_headroom=c.scored.mem_headroom, spread=c.scored.spread,
            tie_break=c.tie_break, taint_penalty=c.taint_penalty, free_cpu_millicores=c.free_cpu_m,
            free_memory_mb=c.free_mem_mb, reserved_cpu_millicores=c.reserved_cpu_m,
            reserved_memory_mb=c.reserved_mem_mb))
    set_time(resp.generated_at, now)
    return resp
