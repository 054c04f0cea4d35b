"""Pooled channels to the compute agents.

One ``grpc.aio`` channel per node, keyed by node id and endpoint, created on first use and reused
for every later call (no TLS handshake per RPC). A channel is rebuilt when the node's endpoint
changes, after a transport failure, or when the certificate files change; a replaced channel is
closed once its calls in flight have ended, and every channel on shutdown. Keepalive pings are at
most every 300 s and only with calls in flight, because Go agents run grpc-go's default
enforcement and answer ``too_many_pings`` otherwise.

Every call carries ``x-persys-node-id`` (so an agent can refuse a call meant for another node),
``x-persys-instance-id`` and, when this replica leads, ``x-persys-leader-term``; every call has a
deadline. A leader checks its renew deadline right before each call (``guard``).

With traces exported, every channel carries the tracing interceptors (``interceptors``): each
call is a client span whose W3C ``traceparent`` goes to the agent in the call's metadata.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from eventsource.errors import NotLeader
from eventsource.metrics import Metrics
from handlers.agents.codes import go_code
from proto.persys.agent.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger("persys.agents")

KEEPALIVE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 300_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 32 * 1024 * 1024),
    # no bandwidth-delay probing: it pings on received data to size flow-control windows for
    # bulk transfers, and agent calls are small. Off, a call costs about 20% less client CPU
    # with 1,000 channels (428-529 -> 350-391 us), which is a 5,000-node cycle's main cost.
    ("grpc.http2.bdp_probe", 0),
]

UNREACHABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

#: grpc's own wording when no connection could be made: the call was never sent
_NOT_CONNECTED = "failed to connect to all addresses"
#: what follows it when TCP worked and TLS did not: our side refused the agent's certificate
#: (handshake/certificate wording), or the agent refused ours (TLS 1.3 reports that as the
#: socket closing once our side had finished its half of the handshake)
_TLS_WORDS = ("handshake", "certificate", "ssl_error", "tls", "alert", "socket closed")


def is_handshake_failure(code: grpc.StatusCode, details: str) -> bool:
    """Whether a call failed while connecting, in TLS rather than TCP.

    Only grpc's own "failed to connect" counts: such a call never reached the agent, so
    retrying it cannot apply anything twice. An UNAVAILABLE the agent answered itself (whatever
    it says about certificates) is not one.
    """
    if code != grpc.StatusCode.UNAVAILABLE:
        return False
    text = details.lower()
    if not text.startswith(_NOT_CONNECTED):
        return False
    return any(word in text for word in _TLS_WORDS)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca: str
    cert: str
    key: str

    def fingerprint(self) -> tuple[float, ...]:
        stamps = []
        for path in (self.ca, self.cert, self.key):
            try:
                stamps.append(os.stat(path).st_mtime)
            except OSError:
                stamps.append(0.0)
        return tuple(stamps)

    def credentials(self) -> grpc.ChannelCredentials:
        with open(self.ca, "rb") as ca, open(self.cert, "rb") as cert, open(self.key, "rb") as key:
            return grpc.ssl_channel_credentials(ca.read(), key.read(), cert.read())


#: ListWorkloads answered as the bytes on the wire (``list_workloads_raw``)
LIST_WORKLOADS_PATH = "/persys.agent.v1.AgentService/ListWorkloads"


@dataclass(slots=True)
class _Entry:
    endpoint: str
    channel: grpc.aio.Channel
    stub: agent_pb2_grpc.AgentServiceStub
    tls_stamp: tuple[float, ...]
    #: ListWorkloads without a response deserializer: the answer's bytes
    raw_list: Any
    #: calls on this channel not yet answered
    in_flight: int = 0
    #: replaced (transport failure, new endpoint or certificate): closed once idle
    retired: bool = False
    #: its close was started (by whichever path came first)
    closed: bool = False


class AgentError(Exception):
    """An agent RPC failed; ``unreachable`` tells transport failures from agent answers."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details

    @property
    def unreachable(self) -> bool:
        return self.code in UNREACHABLE_CODES

    @property
    def not_found(self) -> bool:
        return bool(self.code == grpc.StatusCode.NOT_FOUND)


class AgentPool:
    """Channels to agents, one per node."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        instance_id: str,
        rpc_timeout: float,
        tls: TlsFiles | None,
        leader_term: Callable[[], int | None] = lambda: None,
        guard: Callable[[], None] = lambda: None,
        delete_timeout: float | None = None,
        cert_rotator: Callable[[], Awaitable[bool]] | None = None,
        interceptors: Sequence[Any] = (),
    ) -> None:
        self.metrics = metrics
        #: the client interceptors of every channel (tracing; none when traces are off)
        self.interceptors = list(interceptors) or None
        #: asks for a new certificate of our own (``CertManager.force_rotate``); a call that
        #: failed in the handshake is retried once when it answers True
        self.cert_rotator = cert_rotator
        self.instance_id = instance_id
        self.rpc_timeout = rpc_timeout
        #: DeleteWorkload's deadline (``SCHEDULER_AGENT_DELETE_TIMEOUT``): stopping a VM takes
        #: longer than a listing, and a deadline counts as "unreachable" and drops the channel
        self.delete_timeout = delete_timeout
        self.tls = tls
        self.leader_term = leader_term
        self.guard = guard
        self._entries: dict[str, _Entry] = {}
        #: closes of channels replaced or dropped (close() is a coroutine)
        self._closing: set[asyncio.Task[None]] = set()
        #: retired channels with calls still in flight, by id (closed on shutdown too)
        self._retired: dict[int, _Entry] = {}
        #: (method, code) -> its labelled metric children: ``labels()`` costs microseconds
        #: and a cycle at 5,000 nodes records 5,000 calls
        self._recorders: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def _record(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        key = (method, code.name)
        children = self._recorders.get(key)
        if children is None:
            m = self.metrics
            go_key = (method, go_code(code))  # the Go families: grpc-go's code names
            children = self._recorders[key] = (m.agent_rpcs.labels(*key),
                                               m.agent_rpc_requests.labels(*go_key),
                                               m.agent_rpc_duration.labels(*go_key))
        children[0].inc()
        children[1].inc()
        children[2].observe(seconds)

    def _channel(self, node_id: str, endpoint: str) -> _Entry:
        entry = self._entries.get(node_id)
        stamp = self.tls.fingerprint() if self.tls else ()
        if entry is not None and (entry.endpoint != endpoint or entry.tls_stamp != stamp):
            self._drop(node_id)
            entry = None
        if entry is None:
            if self.tls is not None:
                channel = grpc.aio.secure_channel(
                    endpoint, self.tls.credentials(), options=KEEPALIVE_OPTIONS,
                    interceptors=self.interceptors,
                )
            else:
                channel = grpc.aio.insecure_channel(endpoint, options=KEEPALIVE_OPTIONS,
                                                    interceptors=self.interceptors)
            stub = agent_pb2_grpc.AgentServiceStub(channel)  # type: ignore[no-untyped-call]
            raw_list = channel.unary_unary(
                LIST_WORKLOADS_PATH,
                request_serializer=agent_pb2.ListWorkloadsRequest.SerializeToString,
                _registered_method=True)
            entry = _Entry(endpoint, channel, stub, stamp, raw_list)
            self._entries[node_id] = entry
        return entry

    def _drop(self, node_id: str) -> None:
        """Retire the node's channel: the next call opens a new one, and this one is closed
        once the calls still on it have ended. Closing it at once would cancel those calls
        (grpc raises CancelledError in them): one apply's deadline would cancel a VM apply
        still running on the same node, and a certificate rotation every call in flight."""
        entry = self._entries.pop(node_id, None)
        if entry is not None:
            entry.retired = True
            if entry.in_flight == 0:
                self._close_soon(entry)
            else:
                self._retired[id(entry)] = entry

    def _close_soon(self, entry: _Entry) -> None:
        self._retired.pop(id(entry), None)
        if entry.closed:
            return
        entry.closed = True
        # an owned task: a flapping node must not pile up channels
        task = asyncio.get_running_loop().create_task(entry.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def forget(self, node_id: str) -> None:
        """The node left: its channel goes (once its last call has ended)."""
        self._drop(node_id)

    def _metadata(self, node_id: str) -> list[tuple[str, str]]:
        md = [("x-persys-node-id", node_id), ("x-persys-instance-id", self.instance_id)]
        term = self.leader_term()
        if term is not None:
            md.append(("x-persys-leader-term", str(term)))
        return md

    async def call(
        self,
        node_id: str,
        endpoint: str,
        method: str,
        request: Any,
        *,
        timeout: float | None = None,
        leader_only: bool = False,
        raw: bool = False,
    ) -> Any:
        """One agent RPC with a deadline; raises ``AgentError`` (or ``NotLeader``).

        ``raw`` (ListWorkloads only) answers the response's bytes, undecoded.
        """
        try:
            return await self._call_once(node_id, endpoint, method, request, timeout=timeout,
                                         leader_only=leader_only, raw=raw)
        except AgentError as exc:
            if self.cert_rotator is None or not is_handshake_failure(exc.code, exc.details):
                raise
            log.warning("agent %s refused our certificate (%s); asking Vault for a new one",
                        node_id, exc.details)
            if not await self.cert_rotator():
                raise
        return await self._call_once(node_id, endpoint, method, request, timeout=timeout,
                                     leader_only=leader_only, raw=raw)

    async def _call_once(self, node_id: str, endpoint: str, method: str, request: Any, *,
                         timeout: float | None, leader_only: bool, raw: bool) -> Any:
        if leader_only:
            self.guard()
        entry = self._channel(node_id, endpoint)
        rpc = entry.raw_list if raw else getattr(entry.stub, method)
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        entry.in_flight += 1
        try:
            return await rpc(
                request, timeout=timeout or self.rpc_timeout, metadata=self._metadata(node_id)
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in UNREACHABLE_CODES and self._entries.get(node_id) is entry:
                self._drop(node_id)
            raise AgentError(method, code, exc.details() or "") from exc
        finally:
            entry.in_flight -= 1
            if entry.retired and entry.in_flight == 0:
                self._close_soon(entry)
            self._record(method, code, time.perf_counter() - started)

    async def apply(self, node_id: str, endpoint: str, req: agent_pb2.ApplyWorkloadRequest,
                    *, timeout: float | None = None,
                    leader_only: bool = False) -> agent_pb2.ApplyWorkloadResponse:
        resp: agent_pb2.ApplyWorkloadResponse = await self.call(
            node_id, endpoint, "ApplyWorkload", req, timeout=timeout, leader_only=leader_only
        )
        return resp

    async def delete(self, node_id: str, endpoint: str, workload_id: str,
                     *, leader_only: bool = False) -> agent_pb2.DeleteWorkloadResponse:
        resp: agent_pb2.DeleteWorkloadResponse = await self.call(
            node_id, endpoint, "DeleteWorkload", agent_pb2.DeleteWorkloadRequest(id=workload_id),
            timeout=self.delete_timeout, leader_only=leader_only,
        )
        return resp

    async def list_workloads_raw(self, node_id: str, endpoint: str,
                                 *, leader_only: bool = False) -> bytes:
        """ListWorkloads, answered as the serialized ``ListWorkloadsResponse``.

        Why: a reconcile cycle lists every owned agent, and in a steady fleet an agent answers
        what it answered last time. The caller compares the bytes with the last answer and
        decodes only what changed (decoding 20 workloads and building their observations was
        a tenth of a 5,000-node cycle's CPU).
        """
        resp: bytes = await self.call(node_id, endpoint, "ListWorkloads",
                                      agent_pb2.ListWorkloadsRequest(), leader_only=leader_only,
                                      raw=True)
        return resp

    async def status(self, node_id: str, endpoint: str, workload_id: str,
                     *, leader_only: bool = False) -> agent_pb2.GetWorkloadStatusResponse:
        resp: agent_pb2.GetWorkloadStatusResponse = await self.call(
            node_id, endpoint, "GetWorkloadStatus",
            agent_pb2.GetWorkloadStatusRequest(id=workload_id), leader_only=leader_only,
        )
        return resp

    async def close(self) -> None:
        entries, self._entries = self._entries, {}
        retired, self._retired = self._retired, {}
        for entry in [*entries.values(), *retired.values()]:
            if entry.closed:
                continue
            entry.closed = True
            await entry.channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def require_leader_deadline(ok: Callable[[], bool]) -> Callable[[], None]:
    """A guard for ``AgentPool`` that raises ``NotLeader`` when the renew deadline has passed."""

    def guard() -> None:
        if not ok():
            raise NotLeader("renew deadline passed: refusing agent RPC")

    return guard
