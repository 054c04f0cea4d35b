"""The replica's gRPC server: built with its interceptors, services and options, its port
taken before the replica is ready, served once it is, given back when the start fails, and
stopped gracefully.

Apart from the composition root because the server has a life of its own between those
steps (bound but not serving, serving, stopped) and its own settings (the pending-call limits
below); the composition root only says when each step happens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from eventsource.metrics import Metrics
from handlers.api.access import AgentRoleInterceptor
from handlers.api.decoding import RequestDecoding
from handlers.api.metrics import ServerMetrics
from handlers.api.servicer import ControlServicer
from handlers.api.unread import UnreadAnswers, UnreadLedger
from handlers.app.grpc_limits import connection_options
from handlers.app.start_errors import bind_problem, listen_error
from handlers.cluster.tls import ServerCertificates
from handlers.settings.config import Settings
from proto.persys.control.v1 import control_pb2, control_pb2_grpc

#: How many calls gRPC's core may hold before this process has taken them off its queue.
#: Why: grpc-core's defaults (1,000, and 3,000 as a hard limit) cancel calls at random past
#: the first: a burst of 2,000 one-second calls at a grpc.aio server lost 160 of them as
#: CANCELLED (never seen by a handler). At 5,000 nodes such bursts are normal: every agent
#: re-registers after a failover, and a busy loop lets heartbeats pile up. Each cancelled
#: heartbeat made its agent re-register, which piled up more calls: in a 5,000-node bench
#: with one replica, 16,064 of 35,328 failed registrations were CANCELLED. With room
#: for several calls per node of a 5,000+ node fleet, the burst waits its turn instead (5,000
#: calls at once: none lost). The callers' deadlines still bound the wait, and so does
#: grpc-core's own limit on how long a call may wait unclaimed.
MAX_PENDING_CALLS = 32_768
SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
    # requests are small (a heartbeat is a few KB): bandwidth-delay probing only adds pings;
    # off, a 3 KB call cost the server 10-18% less CPU with 1,000 connected clients
    ("grpc.http2.bdp_probe", 0),
    # grpc sets SO_REUSEPORT by default, so a server on a port another process already serves
    # binds it too (two grpc.aio servers on one port both bound, measured) and the kernel
    # splits new connections between them: a second scheduler on 8085 must fail instead
    ("grpc.so_reuseport", 0),
)


class GrpcEndpoint:
    """The AgentControl, health and reflection services on one grpc.aio server."""

    def __init__(self, settings: Settings, metrics: Metrics, servicer: ControlServicer, *,
                 tracing: Sequence[Any] = ()) -> None:
        self.settings = settings
        #: the tracing interceptors: the server span outermost, the call attributes within
        #: (none when traces are off)
        self.tracing = list(tracing)
        self.metrics = metrics
        self.servicer = servicer
        self.health_servicer = health.aio.HealthServicer()
        #: unary answers handed to gRPC and not yet read, by connection
        self.unread = UnreadLedger(settings.grpc_max_unread_bytes_per_connection,
                                   settings.grpc_max_unread_bytes)
        metrics.unread_answer_bytes.set_function(lambda: self.unread.held)
        #: the server while it serves (``serve`` to ``stop``)
        self.server: grpc.aio.Server | None = None
        #: the server between taking its port and serving (``bind`` to ``serve``)
        self._bound: grpc.aio.Server | None = None
        #: the port taken (``GRPC_PORT``, or the one the system chose for port 0)
        self.port = 0

    def bind(self) -> None:
        """Take the gRPC port, serving nothing yet.

        Raises:
            ListenError: the port could not be had (naming the setting).
        """
        s = self.settings
        server = self._build()
        address = f"{s.grpc_addr}:{s.grpc_port}"
        try:
            if s.insecure:
                port = server.add_insecure_port(address)
            else:
                creds = ServerCertificates(s.tls_ca, s.tls_cert, s.tls_key).credentials()
                port = server.add_secure_port(address, creds)
        except RuntimeError:  # grpc says only "Failed to bind to address"
            raise listen_error("gRPC server", s.grpc_addr, s.grpc_port,
                               bind_problem(s.grpc_addr, s.grpc_port),
                               host_var="PERSYS_GRPC_ADDR", port_var="GRPC_PORT") from None
        self._bound, self.port = server, port

    async def close_unstarted(self) -> None:
        """Give back a port taken by ``bind`` (a grpc server that never started keeps its
        socket open through ``stop``: started and stopped, it closes it)."""
        server, self._bound = self._bound, None
        if server is not None:
            await server.start()
            await server.stop(None)

    def _build(self) -> grpc.aio.Server:
        # the first is the outermost: the server span, the metrics (every call counted, a
        # malformed one too), the unread answers counted (``UnreadAnswers``: a caller
        # holding too many is refused before any work), the body decoded
        # (``RequestDecoding``: a malformed one answered INVALID_ARGUMENT), what reads the
        # decoded request (the call attributes, so a refused call's span still names its
        # workload), then the certificate check
        span, within = self.tracing[:1], self.tracing[1:]
        interceptors: list[grpc.aio.ServerInterceptor] = [
            *span, ServerMetrics(self.metrics.grpc_requests, self.metrics.grpc_duration),
            UnreadAnswers(self.unread,
                          lambda method: self.metrics.calls_refused_unread.labels(method).inc()),
            RequestDecoding(), *within]
        if not self.settings.insecure:
            refused = self.metrics.calls_refused
            interceptors.append(AgentRoleInterceptor(
                self.settings.agent_cert_names, lambda method: refused.labels(method).inc(),
                self.settings.operator_cert_names))
        server = grpc.aio.server(options=SERVER_OPTIONS + connection_options(self.settings),
                                 interceptors=interceptors,
                                 maximum_concurrent_rpcs=self.settings.grpc_max_concurrent_rpcs)
        control_pb2_grpc.add_AgentControlServicer_to_server(  # type: ignore[no-untyped-call]
            self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, server)
        service_name = control_pb2.DESCRIPTOR.services_by_name["AgentControl"].full_name
        reflection.enable_server_reflection(
            (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        return server

    async def serve(self) -> None:
        """Serve on the port ``bind`` took, and report SERVING."""
        server, self._bound = self._bound, None
        assert server is not None, "bind first"
        service_name = control_pb2.DESCRIPTOR.services_by_name["AgentControl"].full_name
        await server.start()
        await self.health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
        self.server = server

    async def stop(self) -> None:
        """Report NOT_SERVING, then stop with a grace period for calls in flight."""
        assert self.server is not None
        await self.health_servicer.enter_graceful_shutdown()
        await self.server.stop(grace=2.0)
        self.server = None
