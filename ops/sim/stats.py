"""``GET /stats`` of a running fleet over plain asyncio, for the benchmark's simulator processes.

Apart because it is a server of its own (loopback, JSON, one request per connection) that only
the ``persys-scheduler sim`` process starts; the snapshot it serves is
:meth:`ops.sim.fleet.Fleet.stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ops.sim.clock import cancel_and_wait
from ops.sim.fleet import Fleet
from ops.sim.node import HOST

logger = logging.getLogger(__name__)


class StatsServer:
    """Serves ``GET /stats`` (``?per_node=1`` adds per-node held counts) as JSON on loopback."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    async def start(self, port: int, host: str = HOST) -> int:
        """Listen on ``host:port`` (0 picks a free port); return the port."""
        self._server = await asyncio.start_server(self._handle, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        await cancel_and_wait(list(self._handlers))
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            async with asyncio.timeout(10):
                request_line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
            status, body = self._answer(request_line)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            logger.debug("sim: stats request dropped")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            if task is not None:
                self._handlers.discard(task)

    def _answer(self, request_line: bytes) -> tuple[str, bytes]:
        parts = request_line.decode("latin-1").split()
        if len(parts) < 2:
            return "400 Bad Request", b'{"error": "bad request"}'
        method, target = parts[0], urlsplit(parts[1])
        if target.path != "/stats":
            return "404 Not Found", b'{"error": "not found"}'
        if method != "GET":
            return "405 Method Not Allowed", b'{"error": "GET only"}'
        per_node = parse_qs(target.query).get("per_node", ["0"])[0] not in ("", "0", "false")
        return "200 OK", json.dumps(self._fleet.stats(per_node=per_node)).encode()
