"""Traces of the simulated agents: a server span per agent call, under the scheduler's.

A Go agent exports its own spans (``PERSYS_OTLP_ENDPOINT``); the simulated fleet does the
same when given an endpoint (``persys-scheduler sim --otlp-endpoint``, or that variable): each
node's server reads the W3C ``traceparent`` the scheduler sends in the call's metadata, so an
agent call's server span sits under the scheduler's client span in one trace. One SDK provider
serves the whole fleet (service ``persys-agent-sim``); the node is the span's
``scheduler.node_id``. Without an endpoint nothing is installed.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

from handlers.app.tracing import build_provider, shutdown_provider
from handlers.settings.tracing import trace_endpoint_url

#: the service name of the fleet's spans
SIM_SERVICE_NAME = "persys-agent-sim"


class SimTracing:
    """The fleet's tracer provider and the server interceptor of every node, or none."""

    def __init__(self, endpoint: str) -> None:
        self.provider: TracerProvider | None = None
        self.url = ""
        if endpoint:
            self.url = trace_endpoint_url(endpoint, insecure=True, name="--otlp-endpoint")
            self.provider = build_provider(self.url, service_name_=SIM_SERVICE_NAME,
                                           sampler=ParentBased(ALWAYS_ON))

    def interceptors(self) -> list[Any]:
        if self.provider is None:
            return []
        return [aio_server_interceptor(  # type: ignore[no-untyped-call]
            tracer_provider=self.provider)]

    async def aclose(self) -> None:
        provider, self.provider = self.provider, None
        if provider is not None:
            await shutdown_provider(provider, what="sim traces")
