"""Requests whose bytes are not the message they claim: answered INVALID_ARGUMENT, logged once
in a while.

Why an interceptor: grpc.aio decodes a request before any handler runs, and a body that does
not parse ends the call UNKNOWN with an ERROR traceback in the log, one per call (a flood a
hostile caller controls). The handlers of single-request methods are rebuilt to take the raw
bytes and decode them here, where a bad body is answered with the status every client reads
as "your request is wrong", and the log gets one line per ``LOG_EVERY_S`` with the count of
those it left out.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from handlers.api.grpcwrap import RebuildingInterceptor

log = logging.getLogger("persys.api")

#: at most one log line about malformed bodies per this many seconds
LOG_EVERY_S = 10.0


class RateLimitedLog:
    """One warning per ``every_s``; the lines left out are counted in the next."""

    def __init__(self, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._last = float("-inf")
        self.suppressed = 0

    def warning(self, message: str, *args: Any) -> None:
        now = self.clock()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return
        self._last = now
        left_out, self.suppressed = self.suppressed, 0
        log.warning(message + " (%d more since the last such line)", *args, left_out)


class RequestDecoding(RebuildingInterceptor):
    """Decodes single requests itself, so a malformed one is INVALID_ARGUMENT."""

    def __init__(self) -> None:
        super().__init__()
        self.log = RateLimitedLog()

    def wants(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        return handler.request_deserializer is not None

    async def _decode(self, method: str, decode: Callable[[bytes], Any], raw: Any,
                      context: grpc.aio.ServicerContext) -> Any:
        try:
            return decode(raw if raw is not None else b"")
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or worse
            self.log.warning("malformed request body method=%s peer=%s: %s", method,
                             context.peer(), type(exc).__name__)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: the body is not a valid {method} request message")

    def rebuild(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        decode = handler.request_deserializer
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary(raw: Any, context: grpc.aio.ServicerContext) -> Any:
                request = await self._decode(method, decode, raw, context)
                return await behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=None,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            streamer = handler.unary_stream
            if inspect.isasyncgenfunction(streamer):
                async def stream(raw: Any, context: grpc.aio.ServicerContext
                                 ) -> AsyncIterator[Any]:
                    request = await self._decode(method, decode, raw, context)
                    async for response in streamer(request, context):
                        yield response

                behavior_: Callable[..., Any] = stream
            else:
                async def writer(raw: Any, context: grpc.aio.ServicerContext) -> Any:
                    request = await self._decode(method, decode, raw, context)
                    return await streamer(request, context)

                behavior_ = writer
            return grpc.unary_stream_rpc_method_handler(
                behavior_, request_deserializer=None,
                response_serializer=handler.response_serializer)
        return handler  # a stream of requests: grpc decodes each
