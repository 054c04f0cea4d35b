"""Usage telemetry from heartbeats: to Redis, never etcd.

Per-workload usage changes on every heartbeat; writing it to etcd (the Go version's
``UpdateWorkloadRuntimeDetails``) made each heartbeat several Raft writes. Here it goes to a
Redis key per workload (JSON with a TTL, read by GetWorkload) and to the meter stream
``persys:usage:stream`` in the Go version's entry format, de-duplicated per heartbeat (the agent
reports each snapshot twice).

Best effort, and never in the way: a heartbeat only queues its snapshots (bounded; the oldest
are dropped and counted when Redis is slow or down). One writer task sends what is queued in
batches, one script call per batch, on its own connection, so telemetry can never take the
connections the event relay needs. 5,000 nodes x 20 workloads every 10 s is 10,000 snapshots/s:
as single commands that was most of a scheduler's event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Mapping
from json.encoder import encode_basestring_ascii
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from eventsource.events import new_event_id

log = logging.getLogger("persys.usage")

#: compact JSON (one encoder, built once: ``json.dumps`` with options builds one per call)
_compact = json.JSONEncoder(separators=(",", ":")).encode

#: KEYS: per snapshot its usage key, then the meter stream last. ARGV: ttl, maxlen, meter on
#: (1/0), then one JSON array holding per snapshot [usage JSON, event id, node id, workload id,
#: revision, reported at, meter payload]: one argument for the batch instead of seven per
#: snapshot, because redis-py packs every argument in Python (at 500 heartbeats/s packing 3,500
#: arguments per batch was 9% of the scheduler's CPU) while Redis decodes the array in C.
#: Entries have the Go version's fields.
RECORD_SCRIPT = """
local n = #KEYS - 1
local meter = ARGV[3] == '1'
local rows = cjson.decode(ARGV[4])
for i = 1, n do
  local r = rows[i]
  redis.call('SET', KEYS[i], r[1], 'EX', ARGV[1])
  if meter then
    redis.call('XADD', KEYS[n + 1], 'MAXLEN', '~', ARGV[2], '*',
      'event_id', r[2], 'node_id', r[3], 'workload_id', r[4],
      'revision_id', r[5], 'reported_at', r[6], 'payload', r[7])
  end
end
return n
"""

#: one snapshot, ready for the script: (key, usage JSON, event id, node id, workload id,
#: revision, reported at, payload)
Snapshot = tuple[str, str, str, str, str, str, str, str]


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
        max_queued: int = 50_000,
        batch: int = 500,
    ) -> None:
        self.client = client
        self.meter_stream = meter_stream
        self.meter_maxlen = meter_maxlen
        self.meter_enabled = meter_enabled
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.timeout = timeout
        self.batch = batch
        self._script = client.register_script(RECORD_SCRIPT) if client is not None else None
        self._queue: deque[Snapshot] = deque(maxlen=max_queued)
        self._ready = asyncio.Event()
        #: snapshots dropped (queue full, or a batch Redis refused)
        self.dropped = 0

    def offer(
        self, node_id: str, snapshots: Mapping[str, dict[str, Any]],
        revisions: Mapping[str, str], reported_at: str,
    ) -> None:
        """Queue one heartbeat's snapshots; returns at once."""
        if self._script is None or not snapshots:
            return
        quote = encode_basestring_ascii
        for workload_id, usage in snapshots.items():
            revision = revisions.get(workload_id, "")
            stamp = str(usage.get("collectedAt") or reported_at)
            event_id = new_event_id()
            usage_json = _compact(usage)
            payload = ""
            if self.meter_enabled:
                # the usage is encoded once and spliced in: the same text as encoding the dict
                payload = (f'{{"event_id":{quote(event_id)},"node_id":{quote(node_id)},'
                           f'"workload_id":{quote(workload_id)},"revision_id":{quote(revision)},'
                           f'"reported_at":{quote(stamp)},"usage":{usage_json}}}')
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1  # the deque drops the oldest
            self._queue.append((f"{self.key_prefix}{workload_id}", usage_json, event_id,
                                node_id, workload_id, revision, stamp, payload))
        self._ready.set()

    async def run(self) -> None:
        """The writer task: send what is queued, a batch per script call."""
        if self._script is None:
            return
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                await self._send(self._take())

    def _take(self) -> list[Snapshot]:
        out: list[Snapshot] = []
        while self._queue and len(out) < self.batch:
            out.append(self._queue.popleft())
        return out

    async def _send(self, batch: list[Snapshot]) -> None:
        assert self._script is not None
        keys = [s[0] for s in batch]
        keys.append(self.meter_stream)
        args: list[str | int] = [self.ttl_s, self.meter_maxlen, 1 if self.meter_enabled else 0,
                                 _compact([snapshot[1:] for snapshot in batch])]
        try:
            async with asyncio.timeout(self.timeout):
                await self._script(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self.dropped += len(batch)
            log.warning("usage telemetry dropped snapshots=%d total_dropped=%d: %s",
                        len(batch), self.dropped, exc)

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
