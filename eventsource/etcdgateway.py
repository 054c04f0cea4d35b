"""Blocking calls to etcd's JSON gateway: per-thread connections, endpoint failover, and the
one translation of transport failures into ``eventsource.errors``.

Why it is apart from ``eventsource.etcd``: this is the part that runs on worker threads and
knows HTTP (etcd3gw, ``lean_http``): which failures may be retried on the next endpoint, which
leave a write's outcome unknown, and how a streaming gateway answer is read. ``AsyncEtcd``
builds on :class:`EtcdGateway` and adds the asyncio side (thread lanes, deadlines) and the
key-value, transaction and lease calls.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import requests
from etcd3gw import exceptions as etcd_exc
from etcd3gw.client import Etcd3Client

from eventsource.errors import Compacted, LeaseLost, OutcomeUnknown, Unavailable
from eventsource.etcdtls import EtcdTls
from eventsource.lean_http import LeanSession, RequestNotSent

log = logging.getLogger("persys.etcd")

T = TypeVar("T")


def parse_endpoint(endpoint: str, default_protocol: str = "http") -> tuple[str, str, int]:
    """``host:port`` or ``http(s)://host:port`` -> (protocol, host, port)."""
    text = endpoint.strip()
    protocol = default_protocol
    if "://" in text:
        protocol, text = text.split("://", 1)
    text = text.rstrip("/")
    host, _, port = text.rpartition(":")
    if not host:
        host, port = text, "2379"
    return protocol, host.strip("[]"), int(port)


#: answers etcd3gw treats as a connection failure (so the next endpoint is tried)
RETRY_ELSEWHERE = frozenset({408, 503, 504})
#: gateway methods that change etcd: after a failure that leaves their outcome unknown they are
#: never sent to another endpoint (OutcomeUnknown), only when they provably were not sent
WRITE_PATHS = frozenset({"/kv/txn", "/kv/put", "/kv/deleterange", "/lease/grant",
                         "/kv/compaction"})

#: etcd 3.5's gateway decodes a streaming request body with a first read of at most 512 bytes,
#: and Go's HTTP/1.1 server discards what is still unread once the first answer is flushed: only
#: the requests in those first 512 bytes are sure to be answered (measured: 17 answers for 64 or
#: 256 keepalives). ``_post_stream_blocking`` refuses a longer body.
STREAM_BODY_MAX = 512


class _TryElsewhere(Exception):
    """This endpoint cannot serve now; the next one may."""

    def __init__(self, reason: object) -> None:
        super().__init__(describe_failure(reason))
        self.reason = describe_failure(reason)


def describe_failure(reason: object) -> str:
    """A failure as an operator can read it: etcd3gw's connection errors have an empty
    ``str()``, so the exception's type and the chain of causes under it are spelled out
    (``ConnectionFailedError <- ConnectionError: ... Connection refused``)."""
    if not isinstance(reason, BaseException):
        return str(reason)
    parts: list[str] = []
    seen: set[int] = set()
    exc: BaseException | None = reason
    while exc is not None and id(exc) not in seen and len(parts) < 4:
        seen.add(id(exc))
        text = str(exc).strip()
        parts.append(f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


def _stream_answers(path: str, body: bytes
                    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The results of a streaming answer, up to its first error line (returned too)."""
    results: list[dict[str, Any]] = []
    try:
        for line in body.splitlines():
            if not line.strip():
                continue
            answer = json.loads(line)
            if "error" in answer:
                error = dict(answer["error"] or {})
                error["http_code"] = int(error.get("http_code", 0) or 0)
                return results, error
            results.append(dict(answer.get("result") or {}))
    except (ValueError, TypeError, AttributeError) as exc:
        raise Unavailable(f"etcd {path}: unreadable answer: {exc}") from exc
    return results, None


class EtcdGateway:
    """The endpoints of one etcd cluster, called from worker threads (blocking)."""

    def __init__(self, endpoints: Sequence[str], *, timeout: float,
                 tls: EtcdTls | None) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is required")
        self.endpoints = [e.strip() for e in endpoints if e.strip()]
        self.timeout = timeout
        #: client TLS (endpoints without a scheme are then https); watch streams use it too
        self.tls = tls
        self._default_protocol = "https" if tls is not None else "http"
        self._local = threading.local()
        self._current = 0

    # each worker thread owns its own sessions: requests.Session is not thread-safe
    def _client(self, index: int) -> Etcd3Client:
        clients: dict[int, Etcd3Client] | None = getattr(self._local, "clients", None)
        if clients is None:
            clients = {}
            self._local.clients = clients
        client = clients.get(index)
        if client is None:
            protocol, host, port = parse_endpoint(self.endpoints[index], self._default_protocol)
            client = Etcd3Client(
                host=host,
                port=port,
                protocol=protocol,
                timeout=self.timeout,
                api_path="/v3/",
                # one keep-alive connection without requests' per-call machinery (lean_http)
                session=self._session(index),  # type: ignore[arg-type]
            )
            clients[index] = client
        return client

    def _session(self, index: int) -> LeanSession:
        """This thread's connection to endpoint ``index`` (shared with its etcd3gw client)."""
        sessions: dict[int, LeanSession] | None = getattr(self._local, "sessions", None)
        if sessions is None:
            sessions = {}
            self._local.sessions = sessions
        session = sessions.get(index)
        if session is None:
            session = LeanSession(*parse_endpoint(self.endpoints[index], self._default_protocol),
                                  tls=self.tls)
            sessions[index] = session
        return session

    @property
    def base_url(self) -> str:
        protocol, host, port = parse_endpoint(self.endpoints[self._current],
                                              self._default_protocol)
        return f"{protocol}://{host}:{port}"

    def _on_endpoints(self, path: str, call: Callable[[int, float], T], deadline: float) -> T:
        """``call(index, timeout)`` on the current endpoint, then on each next one while it
        raises ``_TryElsewhere``, never past ``deadline`` (monotonic): once the caller has
        given up nothing more is sent. The endpoint that answered becomes the current one."""
        last: object = None
        for attempt in range(len(self.endpoints)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(f"etcd {path}: no answer before the deadline"
                                  + (f" ({last})" if last is not None else ""))
            index = (self._current + attempt) % len(self.endpoints)
            try:
                result = call(index, min(self.timeout, remaining))
            except _TryElsewhere as exc:
                last = exc.reason
                continue
            if index != self._current:
                log.warning("etcd endpoint failover to %s", self.endpoints[index])
                self._current = index
            return result
        raise Unavailable(f"etcd {path}: all endpoints failed: {last}")

    def _post_blocking(self, path: str, body: dict[str, Any], deadline: float
                       ) -> dict[str, Any]:
        write = path in WRITE_PATHS

        def call(index: int, timeout: float) -> dict[str, Any]:
            client = self._client(index)
            client.timeout = timeout  # this thread's own client
            try:
                return dict(client.post(client.get_url(path), json=body))
            except (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError) as exc:
                if write and not isinstance(exc.__context__, RequestNotSent):
                    # sent, and maybe applied (a timeout, or the gateway's 503 for "request
                    # timed out" / "leader changed"): another endpoint could apply it twice
                    raise OutcomeUnknown(f"etcd {path}: outcome unknown: {describe_failure(exc)}"
                                         ) from exc
                raise _TryElsewhere(exc) from exc
            except etcd_exc.Etcd3Exception as exc:
                detail = str(getattr(exc, "detail_text", "") or exc)
                if "compacted" in detail:
                    raise Compacted(0) from exc
                if "lease not found" in detail:
                    raise LeaseLost(detail) from exc
                raise Unavailable(f"etcd {path}: {detail}") from exc
            except requests.RequestException as exc:
                if write and not isinstance(exc, RequestNotSent):
                    raise OutcomeUnknown(f"etcd {path}: outcome unknown: {describe_failure(exc)}"
                                         ) from exc
                raise _TryElsewhere(exc) from exc

        return self._on_endpoints(path, call, deadline)

    def _post_stream_blocking(self, path: str, requests_: Sequence[dict[str, Any]],
                              deadline: float) -> list[dict[str, Any]]:
        """One call of a streaming gateway method: the requests go newline-delimited in one
        body, and the answers come back the same way, one ``{"result": ...}`` per request.

        Returns the results received, in order; fewer than the requests when the gateway
        stopped early (see ``STREAM_BODY_MAX``). Like ``_post_blocking``, a transport error or
        an answer that etcd3gw would call a connection failure (HTTP 408/503/504, in the status
        or in an error line before any result) moves on to the next endpoint."""
        body = b"\n".join(json.dumps(r, separators=(",", ":")).encode() for r in requests_)
        if len(body) > STREAM_BODY_MAX:
            raise ValueError(f"etcd {path}: a streaming body of {len(body)} bytes would not be "
                             f"read whole (at most {STREAM_BODY_MAX})")

        def call(index: int, timeout: float) -> list[dict[str, Any]]:
            try:
                response = self._session(index).post_bytes(f"/v3{path}", body,
                                                           timeout=timeout)
            except requests.RequestException as exc:
                raise _TryElsewhere(exc) from exc
            if response.status_code in RETRY_ELSEWHERE:
                raise _TryElsewhere(f"HTTP {response.status_code} {response.text[:200]}")
            if response.status_code != 200:
                raise Unavailable(f"etcd {path}: HTTP {response.status_code} "
                                  f"{response.text[:200]}")
            results, error = _stream_answers(path, response.body)
            if error is not None and not results:
                message = str(error.get("message", error))
                if error["http_code"] in RETRY_ELSEWHERE:
                    raise _TryElsewhere(message)
                raise Unavailable(f"etcd {path}: {message}")
            return results

        return self._on_endpoints(path, call, deadline)
