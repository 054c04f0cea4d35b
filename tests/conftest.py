"""Project-wide pytest configuration: the real-server fixtures live in tests/fixtures/."""

from __future__ import annotations

from tests.fixtures.servers import (
    etcd_private,
    etcd_server,
    key_root,
    redis_private,
    redis_server,
    stream_key,
)

__all__ = [
    "etcd_private",
    "etcd_server",
    "key_root",
    "redis_private",
    "redis_server",
    "stream_key",
]
