"""Rebuild a gRPC method handler around a wrapped behaviour, whatever its kind.

Why one place: every server interceptor that acts inside a call (the metrics, the certificate
check) must find which of the four behaviours a handler has and rebuild the handler with the
same (de)serializers; a copy per interceptor drifts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

#: handler kind, its constructor, and whether the response is a stream
_KINDS: tuple[tuple[str, Callable[..., grpc.RpcMethodHandler], bool], ...] = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
)

#: (behaviour, response is a stream) -> the behaviour to serve instead
Wrap = Callable[[Callable[..., Any], bool], Callable[..., Any]]


def rewrap(handler: grpc.RpcMethodHandler, wrap: Wrap) -> grpc.RpcMethodHandler:
    """``handler`` serving ``wrap(behaviour, streams)`` instead of its behaviour."""
    for kind, make, streams in _KINDS:
        behavior = getattr(handler, kind)
        if behavior is not None:
            return make(wrap(behavior, streams),
                        request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler


class WrapCache:
    """Wrapped handlers by method, made once: grpc asks the interceptors for a handler on
    every call, and rebuilding one costs a handler and closures per call.

    A cached entry is used only while the inner handler is the same object, so an inner
    interceptor that hands out a new handler per call is still wrapped correctly. The size is
    bounded by the registered methods: an unknown method has no handler and is not wrapped.
    """

    def __init__(self) -> None:
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def get(self, method: str, handler: grpc.RpcMethodHandler,
            make: Callable[[grpc.RpcMethodHandler], grpc.RpcMethodHandler]
            ) -> grpc.RpcMethodHandler:
        cached = self._by_method.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = make(handler)
        self._by_method[method] = (handler, wrapped)
        return wrapped


class RebuildingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A server interceptor that serves, for each method it ``wants``, the handler its
    ``rebuild`` makes of the inner one (made once per method, ``WrapCache``).

    Why a base: every interceptor that acts inside a call asks the inner interceptors for the
    handler, leaves the ones it has no business with, and caches what it rebuilt; one copy of
    those steps per interceptor drifts.
    """

    def __init__(self) -> None:
        self._wrapped = WrapCache()

    def wants(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        """Whether ``method``'s handler is rebuilt (by default every one)."""
        return True

    def rebuild(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or not self.wants(method, handler):
            return handler
        return self._wrapped.get(method, handler, lambda inner: self.rebuild(method, inner))
