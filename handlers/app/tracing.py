"""Trace export: the OpenTelemetry SDK with its OTLP/HTTP (protobuf) exporter, as the Go
scheduler exported traces, or nothing at all.

Why one object: the composition root builds ``Tracing`` from the settings and hands its tracer
to the components that make spans (commit, batcher, placer, relay, reconcile loop) and its
interceptors to the gRPC server and the agent channels. With no endpoint (``trace_endpoint``
empty, the default) there is no SDK tracer provider, no exporter thread, no interceptor, and
every component gets ``tracer=None``: tracing then costs nothing at all.

The provider is this replica's own (never the process-global one): several replicas in one
process (tests, the benchmark's in-process fleet) each export under their own resource, and one
stopping does not stop the others. Export runs on the SDK's ``BatchSpanProcessor`` thread, off
the event loop; ``aclose`` flushes with a deadline from a thread of its own, so a collector that
does not answer delays the stop by that deadline at most.

gRPC spans come from the official instrumentation (``opentelemetry-instrumentation-grpc``, its
``grpc.aio`` interceptors): a server span per AgentControl call, its context read from the
caller's W3C ``traceparent``; a client span per agent call, its context written into the call's
metadata. Health checks and reflection are not traced (a load balancer's probes would be most
of the traces). The ``scheduler.*`` attributes the Go version put on them are added by our own
interceptors inside them (``handlers.api.tracing``, ``handlers.agents.tracing``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import Tracer

from eventsource.tracing import TRACER_NAME
from handlers.agents.tracing import AgentCallAttributes
from handlers.api.tracing import CallAttributes
from handlers.settings.config import Settings

log = logging.getLogger("persys.tracing")

#: the service whose calls get server spans
TRACED_SERVICE = "persys.control.v1.AgentControl"
_TRACED_PREFIX = f"/{TRACED_SERVICE}/"


def _traced_call(details: Any) -> bool:
    """The instrumentation's filter: AgentControl calls only (a prefix test; its own
    ``service_name`` filter parses the method name on every call)."""
    method = details.method
    if isinstance(method, bytes):
        method = method.decode()
    return isinstance(method, str) and method.startswith(_TRACED_PREFIX)
#: how long a stop waits for the spans still queued to be exported
FLUSH_TIMEOUT_S = 5.0


def sampler_of(name: str, ratio: float) -> Sampler:
    """The SDK sampler of an ``OTEL_TRACES_SAMPLER`` name (validated by the settings)."""
    root: Sampler
    base = name.removeprefix("parentbased_")
    if base == "always_on":
        root = ALWAYS_ON
    elif base == "always_off":
        root = ALWAYS_OFF
    else:
        root = TraceIdRatioBased(ratio)
    return ParentBased(root) if name.startswith("parentbased_") else root


def build_provider(endpoint: str, *, service_name_: str, sampler: Sampler,
                   attributes: Mapping[str, str] | None = None) -> TracerProvider:
    """An SDK provider exporting to the OTLP/HTTP traces URL ``endpoint`` in batches.

    The exporter reads the standard ``OTEL_EXPORTER_OTLP_(TRACES_)HEADERS``, ``_TIMEOUT``,
    ``_COMPRESSION`` and ``_CERTIFICATE``, the processor ``OTEL_BSP_*``, the resource
    ``OTEL_RESOURCE_ATTRIBUTES`` (the service name given here wins over it).
    """
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    resource = Resource.create({**(attributes or {}), "service.name": service_name_})
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


async def shutdown_provider(provider: TracerProvider, *, timeout: float = FLUSH_TIMEOUT_S,
                            what: str = "traces") -> None:
    """Flush what is queued and stop the exporter, waiting ``timeout`` at most.

    In a daemon thread of its own, not the loop's executor: a collector that does not answer
    keeps that thread (until its export times out) but neither the loop nor the process exit.
    """
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def run() -> None:
        try:
            provider.force_flush(timeout_millis=int(timeout * 1000))
            provider.shutdown()
        except Exception:
            log.exception("%s: exporter shutdown failed", what)
        finally:
            loop.call_soon_threadsafe(done.set)

    threading.Thread(target=run, name="trace-shutdown", daemon=True).start()
    try:
        await asyncio.wait_for(done.wait(), timeout + 1.0)
    except TimeoutError:
        log.warning("%s: spans not all exported within %.0fs; dropped", what, timeout)


class Tracing:
    """This replica's tracer and gRPC interceptors, or none (export off)."""

    def __init__(self, settings: Settings, *, version: str = "") -> None:
        self.endpoint = settings.trace_endpoint
        self.provider: TracerProvider | None = None
        #: None when export is off: components then make no spans at all
        self.tracer: Tracer | None = None
        if not self.endpoint:
            return
        attributes = {"service.instance.id": settings.instance_id}
        if version:
            attributes["service.version"] = version
        self.provider = build_provider(
            self.endpoint, service_name_=settings.trace_service_name,
            sampler=sampler_of(settings.trace_sampler, settings.trace_sampler_ratio),
            attributes=attributes)
        self.tracer = self.provider.get_tracer(TRACER_NAME, version or None)
        log.info("traces exported to %s as service %s (sampler %s)", self.endpoint,
                 settings.trace_service_name, settings.trace_sampler)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def server_interceptors(self) -> list[Any]:
        """The server span of each AgentControl call, then the Go attributes on it (the
        first interceptor is the outermost)."""
        if self.provider is None:
            return []
        server = aio_server_interceptor(  # type: ignore[no-untyped-call]
            tracer_provider=self.provider, filter_=_traced_call)
        return [server, CallAttributes()]

    def client_interceptors(self) -> list[Any]:
        """A client span per agent call, its context in the call's metadata, then the Go
        attributes on it."""
        if self.provider is None:
            return []
        client = aio_client_interceptors(  # type: ignore[no-untyped-call]
            tracer_provider=self.provider)
        return [*client, AgentCallAttributes()]

    async def aclose(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        provider, self.provider = self.provider, None
        if provider is not None:
            await shutdown_provider(provider, timeout=timeout)
