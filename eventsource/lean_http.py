"""A lean stand-in for the one ``requests.Session`` method etcd3gw calls: ``post``.

Why: the scheduler is one GIL-bound process, and every etcd gateway call through ``requests``
spends more Python time in request preparation, adapter lookup, hooks, cookie and proxy merging
and urllib3's pool than in the round trip itself (py-spy: about half of all etcd client time).
etcd3gw accepts a preconfigured session; this one keeps one keep-alive ``http.client``
connection and does only what a JSON POST to the gateway needs. Failures are raised as the
``requests`` exceptions etcd3gw translates, so its error mapping stays the one in use.

Not thread-safe, like ``requests.Session``: each worker thread of the etcd pool owns one.
"""

from __future__ import annotations

import http.client
import json
import select
import ssl
from typing import Any

import requests

from eventsource.etcdtls import EtcdTls


class LeanResponse:
    """The parts of ``requests.Response`` etcd3gw reads."""

    __slots__ = ("body", "reason", "status_code")

    def __init__(self, status_code: int, reason: str, body: bytes) -> None:
        self.status_code = status_code
        self.reason = reason
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)


class LeanSession:
    """``post(url, json=..., timeout=...)`` over one keep-alive connection to one endpoint."""

    def __init__(self, protocol: str, host: str, port: int, *,
                 tls: EtcdTls | None = None) -> None:
        self.protocol = protocol
        self.host = host
        self.port = port
        self.tls = tls
        self._prefix = f"{protocol}://"
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is not None and conn.sock is not None and _peer_closed(conn.sock):
            # the gateway closed an idle connection: never send a request into it
            self.close()
            conn = None
        if conn is None:
            if self.protocol == "https":
                try:
                    context = (self.tls.ssl_context() if self.tls is not None
                               else ssl.create_default_context())
                except (OSError, ssl.SSLError) as exc:  # unreadable or mismatched files
                    raise requests.exceptions.SSLError(f"etcd tls files: {exc}") from exc
                conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                                   context=context)
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            self._conn = conn
        elif conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def post(self, url: str, *, json: Any = None, timeout: float | None = None,
             **_: Any) -> LeanResponse:
        # etcd3gw builds "<protocol>://<host>:<port><path>"; only the path is sent
        path = url[url.index("/", len(self._prefix)):] if url.startswith(self._prefix) else url
        return self.post_bytes(path, _dumps(json), timeout=timeout)

    def post_bytes(self, path: str, body: bytes, *, timeout: float | None = None) -> LeanResponse:
        """POST a body as it is: a streaming gateway method takes newline-delimited JSON."""
        conn = self._connection(timeout)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except TimeoutError as exc:
            self.close()
            raise requests.exceptions.Timeout(f"etcd {path}: {exc}") from exc
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise requests.exceptions.ConnectionError(f"etcd {path}: {exc!r}") from exc
        if resp.will_close:
            self.close()
        return LeanResponse(resp.status, resp.reason, data)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _peer_closed(sock: Any) -> bool:
    """True when an idle keep-alive socket is readable, i.e. the peer closed it (or sent
    something unasked, which also makes it unusable)."""
    poller = select.poll()  # not select.select: a scheduler holds thousands of descriptors
    try:
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
