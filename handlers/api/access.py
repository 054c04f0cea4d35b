"""The gRPC side of :mod:`handlers.identity.authz`: the caller's certificate, and the interceptor
that keeps agent certificates to the agent RPCs.

Installed only with mTLS: under ``-insecure`` there is no certificate to decide on (as in the
Go version, which the flag exists to match).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from handlers.api.grpcwrap import RebuildingInterceptor, rewrap
from handlers.identity.authz import AGENT_METHODS, Caller, refuse_call

log = logging.getLogger("persys.access")

CONTROL_SERVICE = "/persys.control.v1.AgentControl/"

def caller_of(context: grpc.aio.ServicerContext) -> Caller:
    """The verified client certificate's identity (empty without TLS)."""
    return Caller.from_auth_context(context.auth_context())


class AgentRoleInterceptor(RebuildingInterceptor):
    """Answers ``PERMISSION_DENIED`` when a certificate may not call an AgentControl RPC
    (:func:`handlers.identity.authz.refuse_call`). Health and reflection stay open to every verified
    certificate."""

    def __init__(self, agent_names: tuple[str, ...], on_refusal: Callable[[str], None],
                 operator_names: tuple[str, ...] = ()) -> None:
        self._agent_names = agent_names
        self._operator_names = operator_names
        self._on_refusal = on_refusal
        super().__init__()

    def wants(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        return (method.startswith(CONTROL_SERVICE)
                and method[len(CONTROL_SERVICE):] not in AGENT_METHODS)

    def rebuild(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        short = method[len(CONTROL_SERVICE):]
        return rewrap(handler, lambda behavior, streams: self._guard(short, behavior, streams))

    async def _check(self, method: str, context: grpc.aio.ServicerContext) -> None:
        caller = caller_of(context)
        reason = refuse_call(method, caller, self._agent_names, self._operator_names)
        if reason is not None:
            self._on_refusal(method)
            log.warning("call refused method=%s caller=%s", method, caller.describe())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)

    def _guard(self, method: str, behavior: Callable[..., Any],
               streams: bool) -> Callable[..., Any]:
        if streams and inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[Any]:
                await self._check(method, context)
                async for response in behavior(request, context):
                    yield response

            return stream

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._check(method, context)
            return await behavior(request, context)

        return unary
