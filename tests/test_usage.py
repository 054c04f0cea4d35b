"""Usage telemetry on a real Redis: the per-workload key and the meter entry keep the Go
version's format, including text JSON must escape, after the batch moved to one JSON argument."""

from __future__ import annotations

import asyncio
import contextlib
import json

import redis.asyncio as aioredis

from handlers.nodes.usage import UsageSink
from tests.fixtures.waiting import wait_for


async def test_snapshots_reach_the_key_and_the_meter_stream_as_the_go_version_wrote_them(
        redis_server, stream_key) -> None:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    meter = f"{stream_key}:meter"
    sink = UsageSink(client, meter_stream=meter, meter_maxlen=1000, meter_enabled=True,
                     key_prefix=f"{stream_key}:usage:", batch=2)
    usages = {
        f"w{i}": {"workloadId": f"w{i}", "cpuPercent": 12.5 + i, "memoryBytes": 1 << 30,
                  "source": 'agent "ü" \\ \n', "collectedAt": ""}
        for i in range(5)
    }
    writer = asyncio.ensure_future(sink.run())
    try:
        sink.offer("node-ü", usages, {"w0": "rev-\"1\""}, "2026-11-30T00:00:00Z")

        async def entries() -> list[dict[str, str]] | None:
            found = [f for _, f in await client.xrange(meter)]
            return found if len(found) == 5 else None

        fields = await wait_for(entries, timeout=10, message="five meter entries")
        for wid, usage in usages.items():
            assert json.loads(await client.get(f"{stream_key}:usage:{wid}")) == usage
        first = fields[0]
        assert first["workload_id"] == "w0"
        assert first["node_id"] == "node-ü"
        assert first["revision_id"] == 'rev-"1"'
        assert first["reported_at"] == "2026-11-30T00:00:00Z"
        expected = {"event_id": first["event_id"], "node_id": "node-ü", "workload_id": "w0",
                    "revision_id": 'rev-"1"', "reported_at": "2026-11-30T00:00:00Z",
                    "usage": usages["w0"]}
        # the exact text the Go-format encoder of the whole dict gives
        assert first["payload"] == json.dumps(expected, separators=(",", ":"))
        assert sink.dropped == 0
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
        await client.aclose()
