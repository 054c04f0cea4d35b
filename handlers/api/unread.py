"""Answers a caller has not read yet, bounded per connection and in all.

Why: an answer grpc.aio has handed to its core stays in this process until the caller's
HTTP/2 flow-control window lets it out; a caller that never reads keeps every answer it
asked for (300 unread ListNodes answers of 1.7 MB grew the scheduler from 300 to 829 MB),
and its calls stay open (measured: the call's done callback runs only once the answer left).
Keepalive cuts a caller that stopped reading its socket within about
``SCHEDULER_GRPC_KEEPALIVE_TIME`` + ``..._TIMEOUT``, but not one that reads its socket,
answers pings and keeps its window closed. So every unary answer is counted here from the
moment it is handed to gRPC until its call is done:

* a connection holding more than ``SCHEDULER_GRPC_MAX_UNREAD_BYTES_PER_CONNECTION`` (16 MiB)
  of unread answers gets RESOURCE_EXHAUSTED for its next calls, before any work;
* an answer that would take the process past ``SCHEDULER_GRPC_MAX_UNREAD_BYTES`` (256 MiB)
  is refused RESOURCE_EXHAUSTED instead of sent, unless it is small (``SMALL_ANSWER_BYTES``):
  heartbeats, registrations and applies of callers that read are not refused because other
  callers do not read; a connection that holds unread answers is refused before any work
  while the total is over, and so is a call whose method's last answer would not fit (an
  answer that will be refused is not built: building them kept the process's memory high).

The bytes counted are the serialized answers; the process holds about twice as much for them
(grpc keeps the Python bytes and its own copy until the answer left): with the defaults, 30
callers keeping their windows closed at 1,000 nodes took the scheduler from 137 to 708 MiB
(164 MiB after), where before nothing bounded it (5.6 GiB and growing). Building answers only to
refuse them had kept it at 2.1 GiB with 512 MiB counted, hence the refusal before the build.

A WatchEvents stream needs no entry: its next event is written only once the previous one
left (``context.write`` waits), so it holds one message at most. The handler's response is
serialized here (the handler is rebuilt without a response serializer), so its size costs no
second encoding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from handlers.api.grpcwrap import RebuildingInterceptor

#: answers up to this size are never refused for the total (a heartbeat answer is ~100 B)
SMALL_ANSWER_BYTES = 64 * 1024


class UnreadLedger:
    """Unread answer bytes by connection (the peer ``ip:port``) and in all; pure counting."""

    def __init__(self, per_connection: int, total: int) -> None:
        self.per_connection = per_connection
        self.total = total
        self._by_peer: dict[str, int] = {}
        self._held = 0
        #: the size of each method's last answer: an answer that will not be sent is not built
        self._last_size: dict[str, int] = {}

    @property
    def held(self) -> int:
        """Unread answer bytes in all."""
        return self._held

    def of(self, peer: str) -> int:
        return self._by_peer.get(peer, 0)

    def refusal_before(self, peer: str, method: str = "") -> str | None:
        """Why a new call of ``peer`` to ``method`` is refused before any work, or None."""
        expected = self._last_size.get(method, 0)
        if expected:
            why = self.refusal_of(expected)
            if why is not None:
                return why.replace("an answer of", "an answer (as its last) of", 1)
        mine = self._by_peer.get(peer, 0)
        if mine > self.per_connection:
            return (f"this connection has {mine} bytes of answers it has not read, more than "
                    f"SCHEDULER_GRPC_MAX_UNREAD_BYTES_PER_CONNECTION={self.per_connection}: "
                    "read them (or close the connection) before calling again")
        if mine and self._held > self.total:
            return (f"the scheduler holds {self._held} bytes of answers callers have not read, "
                    f"more than SCHEDULER_GRPC_MAX_UNREAD_BYTES={self.total}, {mine} of them "
                    "this connection's: read them before calling again")
        return None

    def refusal_of(self, size: int) -> str | None:
        """Why an answer of ``size`` bytes is not sent, or None."""
        if size > SMALL_ANSWER_BYTES and self._held + size > self.total:
            return (f"an answer of {size} bytes would take the answers callers have not read "
                    f"past SCHEDULER_GRPC_MAX_UNREAD_BYTES={self.total} "
                    f"({self._held} held); retry later")
        return None

    def sized(self, method: str, size: int) -> None:
        """``method`` answered ``size`` bytes (sent or refused)."""
        self._last_size[method] = size

    def add(self, peer: str, size: int) -> None:
        self._by_peer[peer] = self._by_peer.get(peer, 0) + size
        self._held += size

    def release(self, peer: str, size: int) -> None:
        mine = self._by_peer.get(peer, 0) - size
        if mine > 0:
            self._by_peer[peer] = mine
        else:
            self._by_peer.pop(peer, None)
        self._held = max(0, self._held - size)


class UnreadAnswers(RebuildingInterceptor):
    """Counts each unary answer until its call is done; refuses as ``UnreadLedger`` says."""

    def __init__(self, ledger: UnreadLedger, refused: Callable[[str], None] | None = None) -> None:
        self.ledger = ledger
        self._refused = refused
        super().__init__()

    def wants(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        return handler.unary_unary is not None

    async def _refuse(self, method: str, context: grpc.aio.ServicerContext, why: str) -> None:
        if self._refused is not None:
            self._refused(method)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)

    def rebuild(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behavior = handler.unary_unary
        serialize = handler.response_serializer
        ledger = self.ledger

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            peer = context.peer()
            why = ledger.refusal_before(peer, method)
            if why is not None:
                await self._refuse(method, context, why)
            response = await behavior(request, context)
            data = serialize(response) if serialize is not None else response
            size = len(data)
            ledger.sized(method, size)
            why = ledger.refusal_of(size)
            if why is not None:
                await self._refuse(method, context, why)
            ledger.add(peer, size)
            context.add_done_callback(lambda _call: ledger.release(peer, size))
            return data

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=handler.request_deserializer, response_serializer=None)
