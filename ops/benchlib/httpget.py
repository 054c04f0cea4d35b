"""A minimal asynchronous HTTP/1.1 GET for loopback endpoints (/metrics, /health, /stats).

Why not ``requests`` or ``urllib``: they block, and the bench scrapes while its API clients run
on the same event loop; a thread per scrape would compete with them for the GIL for nothing.
The endpoints it talks to answer one request per connection (``Connection: close``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


class HttpError(RuntimeError):
    """The endpoint answered with a non-200 status, or did not answer in time."""


def split_hostport(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; ``[v6]:port`` accepted."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


async def http_get(address: str, path: str, *, timeout: float = 10.0) -> bytes:
    """GET ``http://address/path`` and return the body.

    Raises:
        HttpError: non-200 answer, malformed answer or timeout.
        OSError: the connection failed.
    """
    host, port = split_hostport(address)
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(
                    f"GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n".encode()
                )
                await writer.drain()
                raw = await reader.read()
            finally:
                writer.close()
                try:
                    await writer.wait_closed()
                except ConnectionError:
                    pass
    except TimeoutError as exc:
        raise HttpError(f"GET http://{address}{path}: no answer within {timeout:g}s") from exc
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise HttpError(f"GET http://{address}{path}: malformed answer")
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status_line.split()
    if len(parts) < 2 or parts[1] != "200":
        raise HttpError(f"GET http://{address}{path}: {status_line}")
    return body


async def get_json(address: str, path: str, *, timeout: float = 10.0) -> dict[str, Any]:
    """GET a JSON object."""
    body = await http_get(address, path, timeout=timeout)
    try:
        decoded = json.loads(body)
    except ValueError as exc:
        raise HttpError(f"GET http://{address}{path}: not JSON: {body[:120]!r}") from exc
    if not isinstance(decoded, dict):
        raise HttpError(f"GET http://{address}{path}: not a JSON object")
    return decoded
