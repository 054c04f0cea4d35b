"""The plaintext HTTP endpoint on METRICS_PORT: ``/metrics`` and our own ``/health``.

A few lines of asyncio instead of the Prometheus exporter's catch-all server, so ``/health`` is
ours (docs/architecture.md, "Operating modes and health": string values for status, mode,
reason, modeChangedAt, instanceId, haMode, shardIndex, shardCount, leader, relay) and
everything runs on the one event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("persys.http")

#: the most a request line and its headers may take (as asyncio's reader buffers a line);
#: beyond, the answer is 431
HEADERS_MAX_BYTES = 64 * 1024


class HttpEndpoint:
    def __init__(self, registry: CollectorRegistry, health: Callable[[], dict[str, str]]) -> None:
        self.registry = registry
        self.health = health
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, host: str, port: int, *, serving: bool = True) -> None:
        """Listen on ``host:port``; with ``serving=False`` connections wait in the backlog
        until ``start_serving``.

        Raises:
            OSError: the address cannot be listened on (``socket.gaierror``: no such host).
        """
        self._server = await asyncio.start_server(self._handle, host, port,
                                                  start_serving=serving)

    async def start_serving(self) -> None:
        assert self._server is not None, "start first"
        await self._server.start_serving()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, ctype, body = await self._answer(reader)
            reasons = {200: "OK", 404: "Not Found", 431: "Request Header Fields Too Large"}
            head = (f"HTTP/1.1 {status} {reasons[status]}\r\n"
                    f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode()
            writer.write(head + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError) as exc:
            log.debug("http request dropped: %s", exc)
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
        """The status, content type and body for the request on ``reader``: 431 when its
        request line and headers exceed ``HEADERS_MAX_BYTES`` (one line longer than the
        reader's buffer included)."""
        too_large = (431, "text/plain", b"request header fields too large\n")
        total = 0
        try:
            async with asyncio.timeout(10):
                request_line = await reader.readline()
                total += len(request_line)
                while total <= HEADERS_MAX_BYTES:
                    line = await reader.readline()
                    total += len(line)
                    if line in (b"\r\n", b"\n", b""):
                        break
        except ValueError:  # asyncio.LimitOverrunError: one line over the reader's limit
            return too_large
        if total > HEADERS_MAX_BYTES:
            return too_large
        parts = request_line.decode("latin-1").split()
        path = parts[1].split("?", 1)[0] if len(parts) >= 2 else "/"
        if path == "/health":
            return 200, "application/json", json.dumps(self.health()).encode()
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        return 404, "text/plain", b"not found\n"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
