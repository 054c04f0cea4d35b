"""The Go scheduler's attributes on each agent call's client span.

Why an interceptor: the client span is the OpenTelemetry instrumentation's (the interceptor in
front of this one on every agent channel; it also writes the span's W3C ``traceparent`` into
the call's metadata), and what the Go version annotated it with is in the call: the node in
``x-persys-node-id``, the workload in the request's ``id``, the type and desired state of an
apply. The span is renamed to Go's form of the method (``persys.agent.v1.AgentService/
ApplyWorkload``, without the path's leading slash), as otelgrpc named it. Installed only when
traces are exported (``handlers.app.tracing``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace

from eventsource import tracing
from proto.persys.agent.v1 import agent_pb2

NODE_ID_METADATA = "x-persys-node-id"


def _enum_name(enum: Any, number: int, prefix: str) -> str:
    name: str = enum.Name(number) if number in enum.values() else str(number)
    return name.removeprefix(prefix).lower()


def annotate_call(span: Any, metadata: Any, request: Any) -> None:
    """``scheduler.node_id``, ``scheduler.workload_id`` and, for an apply, the workload's
    type and desired state, on ``span``."""
    for key, value in metadata or ():
        if key == NODE_ID_METADATA:
            span.set_attribute(tracing.NODE_ID, value)
            break
    workload_id = getattr(request, "id", "")
    if workload_id:
        span.set_attribute(tracing.WORKLOAD_ID, workload_id)
    if isinstance(request, agent_pb2.ApplyWorkloadRequest):
        span.set_attribute(tracing.WORKLOAD_TYPE, _enum_name(
            agent_pb2.WorkloadType, request.type, "WORKLOAD_TYPE_"))
        span.set_attribute(tracing.DESIRED_STATE, _enum_name(
            agent_pb2.DesiredState, request.desired_state, "DESIRED_STATE_"))


class AgentCallAttributes(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Sets the call's Go attributes on the current (client) span."""

    async def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        span = trace.get_current_span()
        if span.is_recording():
            method = client_call_details.method
            if isinstance(method, bytes):  # grpc gives bytes here (grpc/grpc#31092)
                method = method.decode()
            span.update_name(str(method).lstrip("/"))
            annotate_call(span, client_call_details.metadata, request)
        return await continuation(client_call_details, request)
