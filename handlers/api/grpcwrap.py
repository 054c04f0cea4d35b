"""Rebuild a gRPC method handler around a wrapped behaviour, whatever its kind.

Why one place: every server interceptor that acts inside a call (the metrics, the certificate
check) must find which of the four behaviours a handler has and rebuild the handler with the
same (de)serializers; a copy per interceptor drifts.
"""

from __future__ import annotations

from collections.abc import Callable
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
