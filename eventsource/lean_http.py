"""A lean stand-in for the one ``requests.Session`` method etcd3gw calls: ``post``.

Why: the scheduler is one GIL-bound process, and every etcd gateway call through ``requests``
spends more Python time in request preparation, adapter lookup, hooks, cookie and proxy merging
and urllib3's pool than in the round trip itself (py-spy: about half of all etcd client time).
``http.client`` alone still costs about 160 us of CPU per call, most of it parsing response
headers with the ``email`` package; the gateway needs none of that. This module speaks the small
part of HTTP/1.1 a JSON POST to the gateway needs over one keep-alive socket: one ``sendall``
per request, then the status line, ``Content-Length`` or chunked framing and ``Connection``
(about 45 us per call, measured against etcd 3.5 on loopback). Failures are raised as the
``requests`` exceptions etcd3gw translates, so its error mapping stays the one in use.

Not thread-safe, like ``requests.Session``: each worker thread of the etcd pool owns one.
"""

from __future__ import annotations

import json
import select
import socket
import ssl
from typing import Any

import requests

from eventsource.etcdtls import EtcdTls

_RECV_BYTES = 256 * 1024
#: A status line plus headers longer than this is not the gateway talking.
_MAX_HEAD_BYTES = 64 * 1024


class ProtocolError(Exception):
    """The peer sent something that is not an HTTP/1.x response we can frame."""


class RequestNotSent(requests.exceptions.ConnectionError):
    """The request never left whole (no connection, TLS failed, the send failed): the server
    cannot have acted on it, so it may be sent elsewhere, write or not."""


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


class _Reader:
    """Buffered reads from one socket; bytes past one response stay for the next."""

    __slots__ = ("buffer", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(_RECV_BYTES)
        if not data:
            raise ProtocolError("connection closed by the peer mid-response")
        self.buffer += data

    def until(self, separator: bytes, limit: int) -> bytes:
        """The bytes before ``separator`` (consumed with it)."""
        start = 0
        while True:
            end = self.buffer.find(separator, start)
            if end >= 0:
                out = bytes(self.buffer[:end])
                del self.buffer[:end + len(separator)]
                return out
            if len(self.buffer) > limit:
                raise ProtocolError(f"no {separator!r} within {limit} bytes")
            start = max(0, len(self.buffer) - len(separator) + 1)
            self._fill()

    def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._fill()
        out = bytes(self.buffer[:size])
        del self.buffer[:size]
        return out

    def to_close(self) -> bytes:
        """Everything until the peer closes (a response framed by closing the connection)."""
        while True:
            data = self.sock.recv(_RECV_BYTES)
            if not data:
                out = bytes(self.buffer)
                self.buffer.clear()
                return out
            self.buffer += data


def read_response(reader: _Reader) -> tuple[int, str, bytes, bool]:
    """(status, reason, body, keep_alive) of the next response; interim 1xx answers skipped."""
    while True:
        head = reader.until(b"\r\n\r\n", _MAX_HEAD_BYTES).split(b"\r\n")
        version, _, rest = head[0].partition(b" ")
        code, _, reason = rest.partition(b" ")
        if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise ProtocolError(f"bad status line {head[0][:80]!r}")
        status = int(code)
        length: int | None = None
        chunked = False
        keep_alive = version != b"HTTP/1.0"
        for line in head[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ProtocolError(f"bad header line {line[:80]!r}")
            name = name.strip().lower()
            value = value.strip()
            if name == b"content-length":
                if not value.isdigit():
                    raise ProtocolError(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.lower().endswith(b"chunked")
            elif name == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens:
                    keep_alive = True
        if 100 <= status < 200:
            continue  # 100 Continue and friends carry no body; the real answer follows
        if status in (204, 304):
            body = b""
        elif chunked:
            body = _read_chunked(reader)
        elif length is not None:
            body = reader.exactly(length)
        else:
            body = reader.to_close()
            keep_alive = False
        return status, reason.decode("latin-1"), body, keep_alive


def _read_chunked(reader: _Reader) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = reader.until(b"\r\n", 1024).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size {size_line[:40]!r}") from None
        if size == 0:
            while reader.until(b"\r\n", _MAX_HEAD_BYTES):  # trailers end with an empty line
                pass
            return b"".join(parts)
        parts.append(reader.exactly(size))
        if reader.exactly(2) != b"\r\n":
            raise ProtocolError("chunk not followed by CRLF")


class LeanSession:
    """``post(url, json=..., timeout=...)`` over one keep-alive connection to one endpoint."""

    def __init__(self, protocol: str, host: str, port: int, *,
                 tls: EtcdTls | None = None) -> None:
        self.protocol = protocol
        self.host = host
        self.port = port
        self.tls = tls
        self._prefix = f"{protocol}://"
        self._host_header = f"{host}:{port}".encode("idna")
        self._reader: _Reader | None = None

    def _connection(self, timeout: float | None) -> _Reader:
        reader = self._reader
        if reader is not None and (reader.buffer or _peer_closed(reader.sock)):
            # the gateway closed an idle connection (or sent something unasked): never send
            # a request into it
            self.close()
            reader = None
        if reader is None:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.protocol == "https":
                    sock = self._wrap(sock)
            except BaseException:
                sock.close()
                raise
            reader = _Reader(sock)
            self._reader = reader
        else:
            reader.sock.settimeout(timeout)
        return reader

    def _wrap(self, sock: socket.socket) -> ssl.SSLSocket:
        try:
            context = (self.tls.ssl_context() if self.tls is not None
                       else ssl.create_default_context())
        except (OSError, ssl.SSLError) as exc:  # unreadable or mismatched files
            raise requests.exceptions.SSLError(f"etcd tls files: {exc}") from exc
        return context.wrap_socket(sock, server_hostname=self.host)

    def post(self, url: str, *, json: Any = None, timeout: float | None = None,
             **_: Any) -> LeanResponse:
        # etcd3gw builds "<protocol>://<host>:<port><path>"; only the path is sent
        path = url[url.index("/", len(self._prefix)):] if url.startswith(self._prefix) else url
        return self.post_bytes(path, _dumps(json), timeout=timeout)

    def post_bytes(self, path: str, body: bytes, *, timeout: float | None = None) -> LeanResponse:
        """POST a body as it is: a streaming gateway method takes newline-delimited JSON."""
        try:
            try:
                reader = self._connection(timeout)
                reader.sock.sendall(
                    b"POST %s HTTP/1.1\r\nHost: %s\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (path.encode(), self._host_header, len(body), body))
            except (requests.exceptions.RequestException, OSError, ssl.SSLError) as exc:
                # no connection, no TLS, or the send failed (TimeoutError is an OSError): the
                # server never read a whole request
                self.close()
                raise RequestNotSent(f"etcd {path}: not sent: {exc!r}") from exc
            status, reason, data, keep_alive = read_response(reader)
        except requests.exceptions.RequestException:  # already in etcd3gw's terms
            self.close()
            raise
        except TimeoutError as exc:
            self.close()
            raise requests.exceptions.Timeout(f"etcd {path}: {exc}") from exc
        except ssl.SSLError as exc:
            self.close()
            raise requests.exceptions.SSLError(f"etcd {path}: {exc!r}") from exc
        except (OSError, ProtocolError) as exc:
            self.close()
            raise requests.exceptions.ConnectionError(f"etcd {path}: {exc!r}") from exc
        if not keep_alive:
            self.close()
        return LeanResponse(status, reason, data)

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.sock.close()


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
