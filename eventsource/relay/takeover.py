"""What the relay checks of the stream against its mark each time it takes over.

Why apart: before a leader appends anything it must know where the stream stands: a stream we
must not append to (foreign entries, not a stream, ids ahead of etcd) is moved aside; a stream
that ends below the mark lost data and is owed one ``EventsGap``; and owed gaps that a crashed
relay already wrote are not written twice. The pump runs this at the start of every pass.
"""

from __future__ import annotations

import logging

from eventsource.etcd import AsyncEtcd
from eventsource.metrics import Metrics
from eventsource.relay.marks import CAUSE_LOST, CAUSE_MOVED, RelayMark, lost_gap
from eventsource.relay.view import StreamView
from eventsource.stream.entries import format_id, id_key
from eventsource.stream.errors import StreamWrongType
from eventsource.stream.eventlog import RedisEventLog

log = logging.getLogger("persys.relay")


async def take_over(view: StreamView, *, stream: RedisEventLog, etcd: AsyncEtcd, mark_key: str,
                    metrics: Metrics, batch: int) -> None:
    """Read the stream's top and the mark; move a foreign stream aside; derive gaps.

    ``batch`` is the pump's batch size: at most two batches can be appended but not marked, so
    the owed gaps already written lie within ``2 * batch`` entries after the mark.
    """
    reason = view.force_aside
    view.force_aside = None
    try:
        top = await stream.top()
    except StreamWrongType as exc:
        reason, top = str(exc), None
    # Redis answers: owed gaps may be written from now on, so none is merged into
    view.open_overflow = None
    if reason is None and top is not None and not top.is_ours:
        reason = f"foreign stream: top entry {top.stream_id} carries no eventId"
    mark = RelayMark.decode(await etcd.get(mark_key))
    if reason is None and top is not None:
        current = await etcd.current_revision()
        if id_key(top.stream_id)[0] > current:
            reason = f"stream top {top.stream_id} is ahead of etcd revision {current}"
    moved = False
    if reason is not None:
        new_name = await stream.move_aside(reason)
        metrics.foreign_streams.inc()
        log.warning("relay: moved stream %s aside to %s: %s", stream.key, new_name, reason)
        top, moved = None, True
    view.top = id_key(top.stream_id) if top is not None else (0, 0)
    view.mark = id_key(mark.last_id) if mark.last_id else (0, 0)
    view.mark_mod = mark.mod_revision
    gaps = list(mark.gaps)
    if view.mark > view.top:
        cause = CAUSE_MOVED if moved else CAUSE_LOST
        gap = lost_gap(view.top, view.mark, stream_key=stream.key, cause=cause)
        if all(g.event_id != gap.event_id and g.last != gap.last for g in gaps):
            log.error(
                "relay: stream %s ends at %s but %s was relayed: writing an EventsGap",
                stream.key, format_id(view.top), format_id(view.mark),
            )  # fmt: skip
            gaps.append(gap)
    if gaps and view.top > view.mark:
        # a crash between XADD and the mark update may have written owed gaps already
        after = await stream.range(format_id(view.mark), 2 * batch + 16)
        present = {entry.event_id for entry in after}
        gaps = [g for g in gaps if g.event_id not in present]
    view.gaps = tuple(gaps)
