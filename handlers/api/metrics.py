"""``persys_scheduler_grpc_server_requests_total`` and ``..._request_duration_seconds``.

Why an interceptor: every service of the server (AgentControl, health, reflection) is counted
the way the Go version's stats handler counted it, with the full method name and the status
code, without each handler having to remember. Streams are counted once, when they end (as in
the Go version), so a WatchEvents call shows up with its whole duration. Codes are what the Go
version's labels held, grpc-go's ``codes.Code.String()`` (``OK``, ``NotFound``, ``Canceled``:
``go_code``), as in ``agent_rpc_requests_total``: a Go dashboard's ``code="Unavailable"``
matches.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from handlers.agents.codes import go_code
from handlers.api.grpcwrap import RebuildingInterceptor, rewrap

_S = grpc.StatusCode


def _code_of(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The status the call ended with: set by the handler (abort or set_code), else implied."""
    if error is None or isinstance(error, grpc.aio.AbortError):
        code = context.code()
        if isinstance(code, grpc.StatusCode):
            return go_code(code)
        return go_code(_S.OK if error is None else _S.UNKNOWN)
    if isinstance(error, asyncio.CancelledError):
        return go_code(_S.CANCELLED)
    return go_code(_S.UNKNOWN)


class ServerMetrics(RebuildingInterceptor):
    """Counts and times every RPC the server answers."""

    def __init__(self, requests: Counter, duration: Histogram) -> None:
        self._requests = requests
        self._duration = duration
        super().__init__()
        # the metric children by (method, code), looked up once: bounded like the handlers
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def _record(self, method: str, code: str, began: float) -> None:
        children = self._children.get((method, code))
        if children is None:
            children = (self._requests.labels(method, code),
                        self._duration.labels(method, code))
            self._children[(method, code)] = children
        children[0].inc()
        children[1].observe(time.perf_counter() - began)

    def rebuild(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        return rewrap(handler, lambda behavior, streams: (
            self._wrap_stream if streams else self._wrap_unary)(method, behavior))

    def _wrap_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            began = time.perf_counter()
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                self._record(method, _code_of(context, exc), began)
                raise
            self._record(method, _code_of(context, None), began)
            return response

        return unary

    def _wrap_stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):
            # a handler that writes with context.write() and returns
            return self._wrap_unary(method, behavior)

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            began = time.perf_counter()
            try:
                async for response in behavior(request, context):
                    yield response
            except BaseException as exc:
                self._record(method, _code_of(context, exc), began)
                raise
            self._record(method, _code_of(context, None), began)

        return stream
