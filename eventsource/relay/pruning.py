"""Pruning the outbox of what will never reach the stream, with the gap that says so.

Why apart: two rare paths that delete outbox keys without relaying them, counted in
``events_dropped``. While Redis is down the outbox grows; beyond ``outbox_max`` records the
oldest whole revisions are deleted and one overflow ``EventsGap`` is owed (kept in the mark, so
it survives a failover). Keys that do not decode as outbox records (poison) can never be
relayed and are deleted at once. Both go through the marker's fenced mark transaction.
"""

from __future__ import annotations

import logging
from typing import Any

from eventsource.election import Leadership
from eventsource.errors import Compacted, Conflict, Unavailable
from eventsource.etcd import MAX_TXN_OPS, AsyncEtcd, KeyValue, b64
from eventsource.keys import KeyLayout, prefix_end
from eventsource.metrics import Metrics
from eventsource.relay.marker import MAX_DELETES_PER_TXN, Marker
from eventsource.relay.marks import RelayMark, merge_overflow
from eventsource.relay.outbox import parse_all
from eventsource.relay.view import StreamView
from eventsource.stream.entries import id_key

log = logging.getLogger("persys.relay")


class OutboxPruner:
    """Deletes overflowing and undecodable outbox keys in the relay's fenced transactions."""

    def __init__(self, etcd: AsyncEtcd, layout: KeyLayout, metrics: Metrics, view: StreamView,
                 marker: Marker, *, outbox_max: int) -> None:
        self._etcd = etcd
        self._layout = layout
        self._metrics = metrics
        self._view = view
        self._marker = marker
        self._outbox_max = outbox_max

    async def check_overflow_safely(self, lead: Leadership) -> None:
        try:
            await self.check_overflow(lead)
        except (Unavailable, Conflict, Compacted) as exc:
            log.warning("relay: outbox overflow check failed: %s", exc)

    async def check_overflow(self, lead: Leadership) -> None:
        """Drop the oldest whole revisions beyond ``outbox_max`` and owe one EventsGap."""
        view = self._view
        page = await self._etcd.range_prefix(self._layout.outbox_prefix, count_only=True)
        excess = page.count - self._outbox_max
        if excess <= 0:
            return
        # the oldest keys by mod revision; +MAX_TXN_OPS so the last revision is complete
        body: dict[str, Any] = {
            "key": b64(self._layout.outbox_prefix),
            "range_end": b64(prefix_end(self._layout.outbox_prefix.encode())),
            "sort_order": "ASCEND",
            "sort_target": "MOD",
            "limit": str(excess + MAX_TXN_OPS),
        }
        result = await self._etcd.post("/kv/range", body)
        kvs = [KeyValue.from_json(kv) for kv in result.get("kvs", [])]
        records, poison = parse_all(kvs)
        records.sort(key=lambda r: r.order)
        take = records[:excess]
        if not take:
            return
        last_revision = take[-1].revision
        take.extend(r for r in records[excess:] if r.revision == last_revision)
        mark = RelayMark.decode(await self._etcd.get(self._layout.relay_mark))
        view.mark = id_key(mark.last_id) if mark.last_id else (0, 0)
        view.mark_mod = mark.mod_revision
        gaps = list(mark.gaps)
        dropped = 0
        for start in range(0, len(take), MAX_DELETES_PER_TXN):
            part = take[start : start + MAX_DELETES_PER_TXN]
            dropped += len(part)
            gaps = merge_overflow(gaps, part, open_id=view.open_overflow)
            view.open_overflow = gaps[-1].event_id
            await self._marker.put_mark(lead, view.mark, gaps, [r.key for r in part])
        view.gaps = tuple(gaps)
        self._metrics.events_dropped.inc(dropped)
        self._metrics.state_store_writes.labels("event_dropped").inc(dropped)
        log.error(
            "relay: outbox over %d records while Redis is unreachable: dropped the %d oldest "
            "(%s .. %s); an EventsGap will mark the place",
            self._outbox_max, dropped, take[0].stream_id, take[-1].stream_id,
        )  # fmt: skip
        if poison:
            await self.drop_poison(lead, poison)

    async def drop_poison(self, lead: Leadership, keys: list[str]) -> None:
        """Outbox keys that are not outbox records can never be relayed: delete them."""
        log.error("relay: deleting %d undecodable outbox keys: %s", len(keys), keys[:5])
        for start in range(0, len(keys), MAX_DELETES_PER_TXN):
            part = keys[start : start + MAX_DELETES_PER_TXN]
            await self._marker.put_mark(lead, self._view.mark, self._view.gaps, part)
            self._metrics.events_dropped.inc(len(part))
            self._metrics.state_store_writes.labels("event_dropped").inc(len(part))
