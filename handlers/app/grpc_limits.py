"""The gRPC core's own connection limits, from the settings.

Why: without them a caller could open any number of streams on one connection, reset streams
as fast as it sends them (100,000 resets on one connection added 330 MB and got no GOAWAY),
ping without end, or hold idle connections forever. grpc-core enforces each of these on its
own threads, before a call reaches this process's event loop:

* ``grpc.max_concurrent_streams`` (``SCHEDULER_GRPC_MAX_CONCURRENT_STREAMS``, 1024): streams a
  connection may have open. With it set, the core's overload protection
  (``grpc.http.overload_protection``, on by default) counts streams until they are freed, not
  until they are reset, so a rapid-reset flood is refused stream by stream (measured: 100,000
  reset streams on one connection drew RST_STREAM ENHANCE_YOUR_CALM, or a reset of the TCP
  connection, and no GOAWAY; 14 MiB instead of 760-810 MiB). A refused stream is
  UNAVAILABLE to the client: 256 refused 1,683 of a burst of 3,000 calls over 4 connections
  (tests/test_grpc_server.py's burst), 1024 none; an agent has one or two streams.
* keepalive enforcement: a client pinging more often than
  ``SCHEDULER_GRPC_MIN_PING_INTERVAL`` (10 s) is sent GOAWAY after two strikes; the server
  pings every connection each ``SCHEDULER_GRPC_KEEPALIVE_TIME`` (1 min) and drops
  it when no answer comes within ``SCHEDULER_GRPC_KEEPALIVE_TIMEOUT`` (20 s), so dead peers
  do not hold memory, nor, for longer than about 80 s, a caller that stopped reading its
  socket (the ping cannot reach it; tests/test_grpc_core_limits.py). A caller that reads and
  answers pings but keeps its HTTP/2 flow-control window closed is bounded by the unread
  answer limits instead (``handlers/api/unread.py``).
* ``SCHEDULER_GRPC_MAX_CONNECTIONS`` (16,384, ``grpc.max_allowed_incoming_connections``):
  connections served at once; the core closes a new one past it at accept, before any TLS
  (5,000 agents hold one each). ``SCHEDULER_GRPC_HANDSHAKE_TIMEOUT`` (20 s,
  ``grpc.server_handshake_timeout_ms``, the core's default 2 min) bounds how long an accepted
  connection may hold a slot without completing its TLS and HTTP/2 handshake.
* ``SCHEDULER_GRPC_MAX_CONCURRENT_RPCS`` (32,768, grpc.aio's ``maximum_concurrent_rpcs``):
  calls in handlers at once, WatchEvents streams and calls whose answer is not read yet
  included; past it a call is answered RESOURCE_EXHAUSTED before any work. Unread answers are
  bounded in bytes too (``handlers/api/unread.py``).
* ``SCHEDULER_GRPC_MAX_CONNECTION_IDLE`` (30 min): a connection without calls is closed (an
  agent heartbeats every minute, so only abandoned connections reach it).
* ``SCHEDULER_GRPC_MAX_CONNECTION_AGE`` (0, off) with ``..._GRACE`` (5 min): connections are
  closed after that age, calls in flight getting the grace; off by default because it cuts
  WatchEvents streams (which resume from their cursor) and Go clients of the old scheduler
  were never cut.
"""

from __future__ import annotations

from typing import Any

from handlers.settings.config import Settings


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def connection_options(settings: Settings) -> tuple[tuple[str, Any], ...]:
    """The grpc server options for the settings' connection limits."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
        ("grpc.http.overload_protection", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms",
         _ms(settings.grpc_min_ping_interval_s)),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(settings.grpc_min_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.keepalive_time_ms", _ms(settings.grpc_keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(settings.grpc_keepalive_timeout_s)),
        ("grpc.max_connection_idle_ms", _ms(settings.grpc_max_connection_idle_s)),
        ("grpc.max_allowed_incoming_connections", settings.grpc_max_connections),
        ("grpc.server_handshake_timeout_ms", _ms(settings.grpc_handshake_timeout_s)),
    ]
    if settings.grpc_max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", _ms(settings.grpc_max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms",
             _ms(settings.grpc_max_connection_age_grace_s)),
        ]
    return tuple(options)
