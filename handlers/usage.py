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

#: KEYS: the usage key of each workload, then the meter stream. ARGV: ttl, maxlen, meter on
#: (1/0), node id, then per workload: usage JSON, event id, workload id, revision, reported at,
#: meter payload. Entries have the Go version's fields.
RECORD_SCRIPT = """
local n = #KEYS - 1
local meter = ARGV[3] == '1'
local a = 5
for i = 1, n do
  redis.call('SET', KEYS[i], ARGV[a], 'EX', ARGV[1])
  if meter then
    redis.call('XADD', KEYS[n + 1], 'MAXLEN', '~', ARGV[2], '*',
      'event_id', ARGV[a + 1], 'node_id', ARGV[4], 'workload_id', ARGV[a + 2],
      'revision_id', ARGV[a + 3], 'reported_at', ARGV[a + 4], 'payload', ARGV[a + 5])
  end
  a = a + 6
end
return n
"""


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
        # one script call per heartbeat instead of two commands per workload: packing and
        # parsing dozens of commands per heartbeat was a quarter of a busy scheduler's loop
        self._script = client.register_script(RECORD_SCRIPT) if client is not None else None

    async def record(
        self, node_id: str, snapshots: Mapping[str, dict[str, Any]],
        revisions: Mapping[str, str], reported_at: str,
    ) -> None:
        if self._script is None or not snapshots:
            return
        keys: list[str] = []
        args: list[str | int] = [self.ttl_s, self.meter_maxlen, 1 if self.meter_enabled else 0,
                                 node_id]
        for workload_id, usage in snapshots.items():
            keys.append(f"{self.key_prefix}{workload_id}")
            revision = revisions.get(workload_id, "")
            stamp = str(usage.get("collectedAt") or reported_at)
            event_id = new_event_id()
            payload = ""
            if self.meter_enabled:
                payload = json.dumps({"event_id": event_id, "node_id": node_id,
                                      "workload_id": workload_id, "revision_id": revision,
                                      "reported_at": stamp, "usage": usage},
                                     separators=(",", ":"))
            args += [json.dumps(usage, separators=(",", ":")), event_id, workload_id, revision,
                     stamp, payload]
        keys.append(self.meter_stream)
        try:
            async with asyncio.timeout(self.timeout):
                await self._script(keys=keys, args=args)
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
