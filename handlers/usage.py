"""Usage telemetry from heartbeats: to Redis, never etcd.

Per-workload usage changes on every heartbeat; writing it to etcd (the Go version's
``UpdateWorkloadRuntimeDetails``) made each heartbeat several Raft writes. Here it goes to a
Redis hash per workload (with a TTL, read by GetWorkload) and to the meter stream
``persys:usage:stream`` in the Go version's entry format, de-duplicated per heartbeat (the agent
reports each snapshot twice). Best effort with a short timeout: telemetry never blocks scheduling.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from eventsource.events import new_event_id

log = logging.getLogger("persys.usage")


class UsageSink:
    def __init__(
        self,
        client: aioredis.Redis | None,
        *,
        meter_stream: str,
        meter_maxlen: int,
        meter_enabled: bool,
        key_prefix: str = "persys:scheduler:usage:",
        ttl_s: int = 600,
        timeout: float = 2.0,
    ) -> None:
        self.client = client
        self.meter_stream = meter_stream
        self.meter_maxlen = meter_maxlen
        self.meter_enabled = meter_enabled
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.timeout = timeout

    async def record(
        self, node_id: str, snapshots: Mapping[str, dict[str, Any]],
        revisions: Mapping[str, str], reported_at: str,
    ) -> None:
        if self.client is None or not snapshots:
            return
        try:
            async with asyncio.timeout(self.timeout):
                pipe = self.client.pipeline(transaction=False)
                for workload_id, usage in snapshots.items():
                    key = f"{self.key_prefix}{workload_id}"
                    pipe.set(key, json.dumps(usage, separators=(",", ":")), ex=self.ttl_s)
                    if self.meter_enabled:
                        event_id = new_event_id()
                        payload = {"event_id": event_id, "node_id": node_id,
                                   "workload_id": workload_id,
                                   "revision_id": revisions.get(workload_id, ""),
                                   "reported_at": usage.get("collectedAt") or reported_at,
                                   "usage": usage}
                        pipe.xadd(self.meter_stream, {
                            "event_id": event_id, "node_id": node_id, "workload_id": workload_id,
                            "revision_id": revisions.get(workload_id, ""),
                            "reported_at": str(payload["reported_at"]),
                            "payload": json.dumps(payload, separators=(",", ":")),
                        }, maxlen=self.meter_maxlen, approximate=True)
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("usage telemetry dropped node_id=%s: %s", node_id, exc)

    async def get(self, workload_id: str) -> dict[str, Any] | None:
        if self.client is None:
            return None
        try:
            async with asyncio.timeout(self.timeout):
                raw = await self.client.get(f"{self.key_prefix}{workload_id}")
        except (RedisError, OSError, TimeoutError):
            return None
        if not raw:
            return None
        value = json.loads(raw)
        return value if isinstance(value, dict) else None
