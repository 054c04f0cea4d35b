"""Usage telemetry from heartbeats: to Redis, never etcd.

Per-workload usage changes on every heartbeat; writing it to etcd (the Go version's
``UpdateWorkloadRuntimeDetails``) made each heartbeat several Raft writes. Here it goes to a
Redis key per workload (JSON with a TTL, read by GetWorkload) and to the meter stream
``persys:usage:stream`` in the Go version's entry format, de-duplicated per heartbeat (the agent
reports each snapshot twice).

Each node's last heartbeat time goes the same way (``NodeView.last_heartbeat``): the Go version
rewrote the node record on every heartbeat for it; here a heartbeat writes nothing to etcd (it
renews the node's liveness lease), so its time is kept in a Redis key per node (integer
milliseconds since the epoch, replaced only by a newer time, so replicas writing in their own
order never move it back; TTL ``heartbeat_ttl_s``) and in the receiving replica's memory.
GetNode and ListNodes read both (one MGET for a whole listing) and show the newest of them and
the node record's ``lastHeartbeat``: every replica sees a heartbeat any replica received, and
without Redis, or while it is slow or down, a replica still knows the heartbeats it received.

Best effort, and never in the way: a heartbeat only queues its snapshots (bounded; the oldest
are dropped and counted when Redis is slow or down) and its time (the newest per node: bounded
by the fleet). One writer task sends what is queued in batches, one script call per batch, on
its own connection, so telemetry can never take the connections the event relay needs. 5,000
nodes x 20 workloads every 10 s is 10,000 snapshots/s: as single commands that was most of a
scheduler's event loop. A read waits at most ``read_timeout``; after a failed one, reads leave
Redis alone for ``read_backoff_s`` (a listing must not wait on a dead Redis every time).

Under Sentinel (``REDIS_SENTINELS``) the client follows the master Sentinel names, so nothing
here changes: a batch sent while the master fails over is dropped and counted like any other a
dead Redis refused, later batches go to the new master, and the script is loaded there again
on first use (redis-py retries EVALSHA as EVAL).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from json.encoder import encode_basestring_ascii
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from eventsource.events import new_event_id

log = logging.getLogger("persys.usage")

#: compact JSON (one encoder, built once: ``json.dumps`` with options builds one per call)
_compact = json.JSONEncoder(separators=(",", ":")).encode

#: KEYS: per snapshot its usage key, then per node its heartbeat key, then the meter stream
#: last. ARGV: ttl, maxlen, meter on (1/0), one JSON array holding per snapshot [usage JSON,
#: event id, node id, workload id, revision, reported at, meter payload], the heartbeat TTL, and
#: one JSON array of heartbeats in the order of their keys, each [time, value]: the time in
#: milliseconds since the epoch, the value that time followed by the node's reported CPU
#: (millicores) and memory (MB) in use when the agent said, space-separated. One argument
#: for the batch instead of seven per snapshot, because redis-py packs every argument in
#: Python (at 500 heartbeats/s packing 3,500 arguments per batch was 9% of the scheduler's
#: CPU) while Redis decodes the array in C. Entries have the Go version's fields. A
#: heartbeat time replaces only an older one (another replica may have written a newer one).
RECORD_SCRIPT = """
local rows = cjson.decode(ARGV[4])
local beats = cjson.decode(ARGV[6])
local n, m = #rows, #beats
local meter = ARGV[3] == '1'
local stream = KEYS[n + m + 1]
for i = 1, n do
  local r = rows[i]
  redis.call('SET', KEYS[i], r[1], 'EX', ARGV[1])
  if meter then
    redis.call('XADD', stream, 'MAXLEN', '~', ARGV[2], '*',
      'event_id', r[2], 'node_id', r[3], 'workload_id', r[4],
      'revision_id', r[5], 'reported_at', r[6], 'payload', r[7])
  end
end
for j = 1, m do
  local key = KEYS[n + j]
  local beat = beats[j]
  local stored = tonumber(string.match(redis.call('GET', key) or '', '^%d+') or '')
  if stored == nil or stored < tonumber(beat[1]) then
    redis.call('SET', key, beat[2], 'EX', ARGV[5])
  end
end
return n
"""

#: one snapshot, ready for the script: (key, usage JSON, event id, node id, workload id,
#: revision, reported at, payload)
Snapshot = tuple[str, str, str, str, str, str, str, str]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def heartbeat_key_prefix(etcd_root: str) -> str:
    """Where a cluster's heartbeat times live: its replicas share an etcd root, and clusters
    sharing one Redis do not."""
    return f"persys:scheduler:heartbeat:{etcd_root}:" if etcd_root else (
        "persys:scheduler:heartbeat:")


def _millis(moment: datetime) -> int:
    delta = moment.astimezone(UTC) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def _stored_millis(raw: str | bytes | None) -> int | None:
    return _stored(raw)[0]


def _stored(raw: str | bytes | None) -> tuple[int | None, Used | None]:
    """A heartbeat key's value: ``"<ms>"`` or ``"<ms> <cpu used m> <memory used MB>"``."""
    if raw is None:
        return None, None
    parts = (raw.decode() if isinstance(raw, bytes) else raw).split()
    try:
        ms = int(parts[0]) if parts else None
        used = (int(parts[1]), int(parts[2])) if len(parts) >= 3 else None
    except ValueError:
        return None, None
    return ms, used


#: a node's own report of what it uses: (CPU millicores, memory MB)
Used = tuple[int, int]


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
        heartbeat_prefix: str = "persys:scheduler:heartbeat:",
        heartbeat_ttl_s: int = 7 * 24 * 3600,
        max_nodes: int = 100_000,
        read_timeout: float = 0.5,
        read_backoff_s: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
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
        self.heartbeat_prefix = heartbeat_prefix
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.max_nodes = max_nodes
        self.read_timeout = read_timeout
        self.read_backoff_s = read_backoff_s
        self._monotonic = monotonic
        #: per node, the newest heartbeat this replica received (ms), least recently beating
        #: first (bounded: a node gone for good is forgotten once ``max_nodes`` others beat)
        self._seen: OrderedDict[str, int] = OrderedDict()
        #: per node, the usage it last reported to this replica (with ``_seen``'s time)
        self._used: dict[str, Used] = {}
        #: heartbeats not yet sent: the newest per node, (ms, stored value)
        self._beats: dict[str, tuple[int, str]] = {}
        #: heartbeat times dropped (batches Redis refused; the node's next heartbeat makes up)
        self.beats_dropped = 0
        #: until when (monotonic) reads leave Redis alone, after one failed
        self._reads_off_until = 0.0

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

    def heartbeat(self, node_id: str, at: datetime, used: Used | None = None) -> None:
        """Record that ``node_id``'s heartbeat (or registration) arrived ``at``, with the
        usage the agent reported (``used``, when it said); returns at once. Only the newest
        per node is kept and sent."""
        ms = _millis(at)
        seen = self._seen.get(node_id)
        if seen is None or ms > seen:
            self._seen[node_id] = ms
            if used is not None:
                self._used[node_id] = used
        self._seen.move_to_end(node_id)
        if len(self._seen) > self.max_nodes:
            gone, _ = self._seen.popitem(last=False)
            self._used.pop(gone, None)
        if self._script is None:
            return
        if ms > self._beats.get(node_id, (-1, ""))[0]:
            value = f"{ms} {used[0]} {used[1]}" if used is not None else str(ms)
            self._beats[node_id] = (ms, value)
        self._ready.set()

    def heartbeat_seen_here(self, node_id: str) -> datetime | None:
        """The newest heartbeat of ``node_id`` this replica received (no Redis read)."""
        ms = self._seen.get(node_id)
        return None if ms is None else _EPOCH + timedelta(milliseconds=ms)

    async def last_heartbeats(self, node_ids: Sequence[str]) -> dict[str, datetime]:
        """Per node, the newest heartbeat any replica recorded in Redis or this replica
        received; nodes with neither are left out (see ``last_reports``)."""
        return {n: at for n, (at, _) in (await self.last_reports(node_ids)).items()}

    def used_seen_here(self, node_id: str) -> Used | None:
        """The usage ``node_id`` last reported to this replica (no Redis read)."""
        return self._used.get(node_id)

    async def last_reports(self, node_ids: Sequence[str]
                           ) -> dict[str, tuple[datetime, Used | None]]:
        """Per node, its newest heartbeat that any replica recorded in Redis or this replica
        received, with the usage it reported then (None when it did not say). One MGET for
        all of them, at most ``read_timeout``; never raises (without an answer from Redis,
        this replica's memory answers alone)."""
        newest = {n: ms for n in node_ids if (ms := self._seen.get(n)) is not None}
        used = {n: u for n in newest if (u := self._used.get(n)) is not None}
        if self.client is not None and node_ids and self._monotonic() >= self._reads_off_until:
            try:
                async with asyncio.timeout(self.read_timeout):
                    stored = await self.client.mget(
                        [f"{self.heartbeat_prefix}{n}" for n in node_ids])
            except (RedisError, OSError, TimeoutError) as exc:
                self._reads_off_until = self._monotonic() + self.read_backoff_s
                log.warning("heartbeat times not read from Redis (not asked again for %.0fs; "
                            "this replica's own are shown): %r", self.read_backoff_s, exc)
            else:
                for node_id, raw in zip(node_ids, stored, strict=True):
                    ms, reported = _stored(raw)
                    if ms is not None and ms > newest.get(node_id, -1):
                        newest[node_id] = ms
                        if reported is not None:
                            used[node_id] = reported
        return {n: (_EPOCH + timedelta(milliseconds=ms), used.get(n))
                for n, ms in newest.items()}

    async def run(self) -> None:
        """The writer task: send what is queued, a batch per script call."""
        if self._script is None:
            return
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue or self._beats:
                await self._send(self._take(), self._take_beats())

    def _take(self) -> list[Snapshot]:
        out: list[Snapshot] = []
        while self._queue and len(out) < self.batch:
            out.append(self._queue.popleft())
        return out

    def _take_beats(self) -> dict[str, tuple[int, str]]:
        if len(self._beats) <= self.batch:
            out, self._beats = self._beats, {}
            return out
        out = dict(itertools.islice(self._beats.items(), self.batch))
        for node_id in out:
            del self._beats[node_id]
        return out

    async def _send(self, batch: list[Snapshot], beats: dict[str, tuple[int, str]]) -> None:
        assert self._script is not None
        keys = [s[0] for s in batch]
        keys += [f"{self.heartbeat_prefix}{node_id}" for node_id in beats]
        keys.append(self.meter_stream)
        args: list[str | int] = [self.ttl_s, self.meter_maxlen, 1 if self.meter_enabled else 0,
                                 _compact([snapshot[1:] for snapshot in batch]),
                                 self.heartbeat_ttl_s,
                                 _compact([[str(ms), value] for ms, value in beats.values()])]
        try:
            async with asyncio.timeout(self.timeout):
                await self._script(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            self.dropped += len(batch)
            self.beats_dropped += len(beats)
            log.warning("usage telemetry dropped snapshots=%d heartbeat_times=%d "
                        "total_dropped=%d: %s", len(batch), len(beats), self.dropped, exc)

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
