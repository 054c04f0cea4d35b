"""One gRPC channel to the scheduler, and its status codes turned into exit statuses.

Why a wrapper: every command must end in one readable line, never a traceback, with the exit
status saying whose fault it was. A transport failure (nothing listening, a failed TLS
handshake, no answer in time) is ``Unreachable`` (3) naming the address and the cause; any
other status is the scheduler's answer, ``Refused`` (1), with its code and text. An RPC the
scheduler does not have (the Go one lacks the events, disk and explain RPCs) says so by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from ops.persys.errors import Refused, Unreachable
from ops.persys.session import Target
from proto.persys.control.v1 import control_pb2_grpc

#: what a transport failure's text holds (UNAVAILABLE is also the scheduler's own answer when
#: it is degraded, naming its mode; that is a refusal, not an unreachable server)
TRANSPORT_HINTS = ("failed to connect", "connection refused", "dns resolution", "socket closed",
                   "connection reset", "handshake", "ssl", "tls", "unreachable", "no route",
                   "connect failed", "timed out", "broken pipe", "end of tcp stream",
                   "failed to pick subchannel")
MAX_MESSAGE = 64 * 1024 * 1024


class Client:
    def __init__(self, target: Target) -> None:
        self.target = target
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_MESSAGE),
                                          ("grpc.enable_retries", 0)]
        if target.insecure:
            self.channel = grpc.insecure_channel(target.server, options=options)
        else:
            ca, key, cert = target.read_tls()
            if target.tls_server_name:
                options.append(("grpc.ssl_target_name_override", target.tls_server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                                 certificate_chain=cert)
            self.channel = grpc.secure_channel(target.server, creds, options=options)
        self.stub = control_pb2_grpc.AgentControlStub(self.channel)

    def call(self, method: str, request: Any, *, timeout_s: float | None = None) -> Any:
        """A unary call; ``Refused`` or ``Unreachable`` instead of ``grpc.RpcError``."""
        try:
            return getattr(self.stub, method)(request, timeout=timeout_s or self.target.timeout_s)
        except grpc.RpcError as exc:
            raise self.translate(exc, method) from None

    def stream(self, method: str, request: Any) -> Iterator[Any]:
        """A server stream without a deadline (the caller cancels it)."""
        call = getattr(self.stub, method)(request)
        try:
            yield from call
        except grpc.RpcError as exc:
            raise self.translate(exc, method) from None
        finally:
            call.cancel()

    def translate(self, exc: grpc.RpcError, method: str) -> Refused | Unreachable:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = (exc.details() if hasattr(exc, "details") else "") or ""
        where = self.target.server
        if code == grpc.StatusCode.UNAVAILABLE and is_transport(details):
            return Unreachable(f"cannot reach the scheduler at {where}: {cause_of(details)}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Unreachable(f"no answer from the scheduler at {where} to {method} within "
                               f"{self.target.timeout_s:g} s")
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return Refused(f"the scheduler at {where} does not implement {method}: {details}")
        return Refused(f"{method}: {code.name}: {details}")

    def close(self) -> None:
        self.channel.close()


def is_transport(details: str) -> bool:
    text = details.lower()
    return any(hint in text for hint in TRANSPORT_HINTS)


def cause_of(details: str) -> str:
    """The last, most specific part of gRPC's connection error text."""
    text = details.strip()
    for marker in ("last error: ", "Last error: "):
        if marker in text:
            text = text.split(marker, 1)[1]
    return text or "connection failed"
