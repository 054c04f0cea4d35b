"""The mode supervisor: probes etcd every few seconds on every replica and sets the mode.

It also writes the ``initialized`` marker on a cluster's first start, which is how a new
cluster (no marker: normal) is told from one whose state was lost (marker, no state: recovery).
Mode changes are logged and become ``SchedulerModeChanged`` events once etcd is writable again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from eventsource.clock import Clock
from eventsource.commit import Change, Committer
from eventsource.errors import Conflict, StoreError
from eventsource.etcd import BULK, SESSION, AsyncEtcd, Compare, Lane, Put
from eventsource.events import Event, rfc3339
from eventsource.keys import KeyLayout
from handlers.cluster.modes import ModeState, Probe, decide_mode

log = logging.getLogger("persys.mode")


async def has_state(etcd: AsyncEtcd, layout: KeyLayout, *, lane: Lane = BULK) -> bool:
    """Whether etcd holds any node, workload or assignment (one key is enough)."""
    for prefix in (layout.nodes_prefix, layout.specs_prefix, layout.statuses_prefix,
                   layout.assignments_prefix):
        page = await etcd.range_prefix(prefix, limit=1, keys_only=True, lane=lane)
        if page.kvs:
            return True
    return False


class ModeSupervisor:
    def __init__(self, etcd: AsyncEtcd, layout: KeyLayout, committer: Committer, mode: ModeState,
                 clock: Clock, *, allow_empty_state: bool, instance_id: str,
                 interval: float = 3.0,
                 on_revision: Callable[[int], None] | None = None) -> None:
        self.etcd = etcd
        self.layout = layout
        self.committer = committer
        self.mode = mode
        self.clock = clock
        self.allow_empty_state = allow_empty_state
        self.instance_id = instance_id
        self.interval = interval
        #: told etcd's revision at each probe (the projections' lag gauge)
        self.on_revision = on_revision
        self._pending: list[Event] = []

    async def probe(self) -> Probe:
        try:
            # on the session lane: the probe asks whether etcd answers, not how long this
            # process's own queue of writes is (a probe queued behind a placement burst timed
            # out and put a healthy replica in degraded mode)
            marker = await self.etcd.get(self.layout.initialized, lane=SESSION)
            state = await has_state(self.etcd, self.layout, lane=SESSION)
            alarms = await self.etcd.alarms(lane=SESSION)
            if self.on_revision is not None:
                self.on_revision(await self.etcd.current_revision(lane=SESSION))
        except StoreError as exc:
            return Probe(etcd_ok=False, initialized=False, has_state=False,
                         allow_empty_state=self.allow_empty_state, error=str(exc))
        return Probe(etcd_ok=True, initialized=marker is not None, has_state=state,
                     allow_empty_state=self.allow_empty_state, alarms=tuple(alarms))

    async def tick(self) -> None:
        probe = await self.probe()
        mode, reason = decide_mode(probe)
        previous = self.mode.mode
        now = self.clock.now()
        if self.mode.set(mode, reason, now):
            log.warning("scheduler mode changed from=%s to=%s reason=%r", previous, mode, reason)
            self._pending.append(Event(
                type="SchedulerModeChanged", reason=reason, timestamp=now,
                details={"from": previous, "to": mode, "instance_id": self.instance_id,
                         "changed_at": rfc3339(now)}))
        if probe.etcd_ok and not probe.alarms and probe.has_state and not probe.initialized:
            await self._mark_initialized()
        if self._pending and probe.etcd_ok and not probe.alarms:
            try:
                await self.committer.commit(Change(kind="mode", events=list(self._pending)))
                self._pending.clear()
            except (StoreError, Conflict) as exc:
                log.info("mode change event not yet stored: %s", exc)

    async def _mark_initialized(self) -> None:
        try:
            await self.committer.commit(Change(
                kind="mode", compares=[Compare.absent(self.layout.initialized)],
                puts=[Put(self.layout.initialized, rfc3339(self.clock.now()).encode())]))
        except (Conflict, StoreError):
            return

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except StoreError as exc:
                log.warning("mode probe failed: %s", exc)
            await asyncio.sleep(self.interval)
