"""The Go scheduler's attributes on each call's server span, from the request's fields.

Why an interceptor: the server span is the OpenTelemetry instrumentation's (the interceptor
outside this one), and what the Go version annotated it with (``scheduler.node_id``,
``scheduler.workload_id``, ``scheduler.workload_desired_state``, ``scheduler.workload_type``)
is in the request of every call that has it; reading it here keeps the handlers free of
tracing. Installed only when traces are exported (``handlers.app.tracing``); a call whose
span is not recorded costs one check.

The span is renamed to Go's form of the method, ``package.Service/Method`` (otelgrpc's name;
the Python instrumentation keeps the path's leading slash), so a query by operation name finds
both versions' spans.

The in-band outcome of the workload commands (``success=false`` with a ``failure_reason``) is
put on the span as well, since for the gRPC instrumentation such a call is a success.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from eventsource import tracing
from handlers.api.grpcwrap import RebuildingInterceptor, rewrap

#: request field -> attribute (the Go names)
REQUEST_FIELDS = (
    ("node_id", tracing.NODE_ID),
    ("workload_id", tracing.WORKLOAD_ID),
    ("desired_state", tracing.DESIRED_STATE),
)


#: the request fields a message type has, and whether it has a ``spec`` (whose ``type`` is
#: the workload type)
_Plan = tuple[tuple[tuple[str, str], ...], bool]


def _plan(descriptor: Any) -> _Plan:
    names = descriptor.fields_by_name
    return tuple((f, a) for f, a in REQUEST_FIELDS if f in names), "spec" in names


class CallAttributes(RebuildingInterceptor):
    """Sets the request's Go attributes on the current (server) span."""

    def __init__(self) -> None:
        super().__init__()
        #: message full name -> the fields to read (looked up once per type)
        self._plans: dict[str, _Plan] = {}

    def wants(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        return not handler.request_streaming

    def rebuild(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        name = method.lstrip("/")
        return rewrap(handler, lambda behavior, streams: (
            self._wrap_stream if streams else self._wrap_unary)(name, behavior))

    def annotate(self, name: str, request: Any) -> None:
        span = trace.get_current_span()
        if not span.is_recording():
            return
        span.update_name(name)
        descriptor = getattr(request, "DESCRIPTOR", None)
        if descriptor is None:
            return
        plan = self._plans.get(descriptor.full_name)
        if plan is None:
            plan = self._plans[descriptor.full_name] = _plan(descriptor)
        fields, has_spec = plan
        for name, attribute in fields:
            value = getattr(request, name)
            if value:
                span.set_attribute(attribute, str(value))
        if has_spec and request.HasField("spec") and request.spec.type:
            span.set_attribute(tracing.WORKLOAD_TYPE, request.spec.type)

    @staticmethod
    def outcome(response: Any) -> None:
        """An in-band refusal (``success=false``) shows as the span's error."""
        if response is None or getattr(response, "success", True):
            return
        span = trace.get_current_span()
        if not span.is_recording():
            return
        message = str(getattr(response, "error_message", "") or "")
        field = response.DESCRIPTOR.fields_by_name.get("failure_reason")
        if field is not None and field.enum_type is not None:
            value = field.enum_type.values_by_number.get(int(response.failure_reason))
            if value is not None:
                span.set_attribute("scheduler.failure_reason", value.name)
        span.set_status(Status(StatusCode.ERROR, message[:1000]))

    def _wrap_unary(self, name: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.annotate(name, request)
            response = await behavior(request, context)
            self.outcome(response)
            return response

        return unary

    def _wrap_stream(self, name: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):
            # a handler that writes with context.write() and returns
            return self._wrap_unary(name, behavior)
        annotate = self.annotate

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            annotate(name, request)
            async for response in behavior(request, context):
                yield response

        return stream
