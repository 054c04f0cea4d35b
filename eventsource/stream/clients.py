"""The Redis clients the stream needs, and the cancellation check every round trip ends with.

Why apart: two Redis pitfalls shape the clients (docs/architecture.md, "Client rules"):
redis-py's default retries would resend an XADD that may already have been applied, and a
blocking read needs a socket timeout above its block. ``reraise_swallowed_cancel`` is the
workaround for a redis-py behaviour that every caller of a Redis round trip (and the leader
loop) needs.
"""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import redis.asyncio as aioredis

#: the longest block of one XREAD (longer blocks meet the client's socket timeout;
#: docs/architecture.md, "Client rules")
MAX_BLOCK_S = 5.0


def reraise_swallowed_cancel() -> None:
    """Re-raise a cancellation that an awaited call swallowed.

    Measured with redis-py 8.1.0: cancelling a task blocked in ``XREAD BLOCK`` can make the
    call return a normal (empty) answer while ``task.cancelling()`` stays 1, so the task would
    carry on as if never cancelled. Every Redis round trip here ends with this check; inside an
    ``asyncio.timeout`` block the re-raised error becomes the timeout, as it should. The leader
    loop checks it on every pass too: a cancellation that arrived while leadership was being
    recorded was swallowed the same way, and the loop outlived shutdown.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def redis_url(addr: str, password: str, db: int) -> str:
    """``redis://`` for ``host:port`` with ``password`` quoted: one from ``openssl rand
    -base64`` holds '/', and '%' must stay itself (go-redis takes the password as is)."""
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{addr}/{db}"


def writer_client(
    url: str,
    *,
    socket_timeout: float = 5.0,
    connect_timeout: float = 5.0,
    max_connections: int = 16,
) -> aioredis.Redis:
    """A command client that never retries (a retried XADD could duplicate an append).

    Its pool makes a caller wait (up to ``connect_timeout``) for one of ``max_connections``
    instead of failing at once: 100 WatchEvents clients opening together each read the
    stream's top, and the default pool answered the 17th with MaxConnectionsError.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        retry=None,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        max_connections=max_connections,
        timeout=connect_timeout,
        decode_responses=True,
    )
    return aioredis.Redis.from_pool(pool)


def tailer_client(url: str, *, block_s: float = MAX_BLOCK_S) -> aioredis.Redis:
    """The one blocking-read client of a process: socket timeout above the block, no retries."""
    if not 0 < block_s <= MAX_BLOCK_S:
        raise ValueError(f"block_s must be in (0, {MAX_BLOCK_S}]")
    return aioredis.Redis.from_url(
        url,
        retry=None,
        socket_timeout=block_s + 5.0,
        socket_connect_timeout=5.0,
        max_connections=4,
        decode_responses=True,
    )
