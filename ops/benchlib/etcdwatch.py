"""Counting etcd writes in a window, from a watch on the scheduler's key root.

Why a watch: it sees every key any writer changed, whatever the writer exports, so the same
count works against any persys-compatible scheduler; and the window is exact in revisions (from
the revision at ``start()`` to the one at ``stop()``), not in wall-clock guesses.

Keys are grouped by prefix: the first path segment (``/nodes/``, ``/workloads-status/`` ...), or
the first three under ``/persys/scheduler/`` (``/persys/scheduler/alive/``); event records
(outbox keys) are also counted by their ``type``, which says what a write was for. A scenario that
must attribute writes to a writer (records carry the writer's instance id) passes ``on_event``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import urllib.request
from collections import Counter
from collections.abc import Callable

from eventsource.errors import StoreError
from eventsource.keys import prefix_end
from eventsource.watch import WatchEvent, WatchStream
from ops.devstack.etcdapi import EtcdError, etcd_revision


def key_group(key: str, root: str = "") -> str:
    """The prefix a key is counted under (see the module docstring)."""
    path = key[len(root):] if root and key.startswith(root) else key
    parts = path.split("/")
    # "/a/b/c" -> ["", "a", "b", "c"]
    if len(parts) > 3 and parts[1] == "persys" and parts[2] == "scheduler":
        return "/" + "/".join(parts[1:4]) + ("/" if len(parts) > 4 else "")
    if len(parts) > 2:
        return f"/{parts[1]}/"
    return path


#: Write categories by key group, the same for every target (the Go layout, which this
#: implementation keeps): what a write was for, whoever made it.
CATEGORIES = (
    ("node", ("/nodes/", "/persys/scheduler/alive/")),
    ("workload spec", ("/workloads-spec/", "/workloads/")),
    ("workload status", ("/workloads-status/",)),
    ("retry", ("/retries/",)),
)


def write_category(group: str) -> str:
    """node, workload spec, workload status, retry, or other (of a ``key_group``)."""
    for name, groups in CATEGORIES:
        if group in groups:
            return name
    return "other"


def describe_categories(by_group: Counter[str], per: float = 1.0, unit: str = "") -> str:
    """``"node 3, workload status 2, other 1 (/allocations/ 1)"``, each count divided by
    ``per`` (placements, seconds ...), every category named even when 0."""
    totals: Counter[str] = Counter()
    others: Counter[str] = Counter()
    for group, n in by_group.items():
        category = write_category(group)
        totals[category] += n
        if category == "other":
            others[group] += n
    parts = [f"{name} {totals[name] / per:.3g}{unit}" for name, _ in CATEGORIES]
    other = f"other {totals['other'] / per:.3g}{unit}"
    if others:
        other += " (" + ", ".join(f"{g} {n / per:.3g}" for g, n in others.most_common()) + ")"
    return ", ".join([*parts, other])


def count_prefix(etcd_url: str, prefix: str, *, timeout: float = 10.0) -> int:
    """How many keys start with ``prefix`` (a count-only range; blocking, use a thread)."""
    end = prefix_end(prefix.encode())
    body = json.dumps({
        "key": base64.b64encode(prefix.encode()).decode(),
        "range_end": base64.b64encode(end).decode(),
        "count_only": True,
    }).encode()
    request = urllib.request.Request(f"{etcd_url.rstrip('/')}/v3/kv/range", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        reply = json.loads(resp.read() or b"{}")
    return int(reply.get("count", 0)) if isinstance(reply, dict) else 0


def event_type(value: bytes) -> str:
    """The ``type`` of a JSON event record, or "?" when the value is not one."""
    try:
        decoded = json.loads(value)
    except ValueError:
        return "?"
    return str(decoded.get("type", "?")) if isinstance(decoded, dict) else "?"


class WriteCounter:
    """Puts and deletes under ``root`` between ``start()`` and ``stop()``.

    Args:
        etcd_url: ``http://host:port`` of the etcd JSON gateway.
        root: the scheduler's key root ('' for the whole keyspace).
        on_event: called with every event inside the window (e.g. to read a writer id).
    """

    def __init__(self, etcd_url: str, root: str = "", *,
                 on_event: Callable[[WatchEvent], None] | None = None) -> None:
        self.etcd_url = etcd_url.rstrip("/")
        self.root = root
        self.on_event = on_event
        self.by_group: Counter[str] = Counter()
        #: Event records written (keys under an ``outbox`` or ``events`` prefix), by ``type``.
        self.event_types: Counter[str] = Counter()
        self.puts = 0
        self.deletes = 0
        self.start_revision = 0
        self.end_revision = 0
        self.error = ""
        self._stream: WatchStream | None = None
        self._task: asyncio.Task[None] | None = None
        self._end = 0
        #: Set once the watch has delivered everything up to the end revision.
        self._reached = asyncio.Event()

    @property
    def writes(self) -> int:
        return self.puts + self.deletes

    async def start(self) -> None:
        """Begin counting at the next revision."""
        current = await asyncio.to_thread(etcd_revision, self.etcd_url)
        self.start_revision = current + 1
        # every key of the layout starts with "<root>/"
        self._stream = WatchStream(self.etcd_url, f"{self.root}/", self.start_revision,
                                   read_timeout=10.0)
        self._task = asyncio.get_running_loop().create_task(self._consume(),
                                                            name="bench-etcd-watch")

    async def _consume(self) -> None:
        assert self._stream is not None
        try:
            async for batch in self._stream:
                for event in batch.events:
                    rev = event.kv.mod_revision
                    if self._end and rev > self._end:
                        continue
                    self._count(event)
                if self._end and self._stream.last_revision >= self._end:
                    self._reached.set()
        except StoreError as exc:
            self.error = f"etcd watch failed: {exc!r}"

    def _count(self, event: WatchEvent) -> None:
        key = event.kv.key
        if event.deleted:
            self.deletes += 1
        else:
            self.puts += 1
        group = key_group(key, self.root)
        self.by_group[group] += 1
        if not event.deleted and ("outbox" in group or "events" in group):
            self.event_types[event_type(event.kv.value)] += 1
        if self.on_event is not None:
            self.on_event(event)

    async def stop(self, *, settle_s: float = 5.0) -> None:
        """End the window at the current revision and wait (up to ``settle_s``) until the watch
        has delivered it; then stop the watch."""
        try:
            self._end = await asyncio.to_thread(etcd_revision, self.etcd_url)
        except (OSError, EtcdError) as exc:
            self.error = self.error or f"could not read the end revision: {exc!r}"
        self.end_revision = self._end
        stream = self._stream
        if stream is not None and self._end and stream.last_revision >= self._end:
            self._reached.set()
        if self._end and self._task is not None and not self._task.done():
            # progress notifications (1 s on the bench's etcd) move last_revision on
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(settle_s):
                    await self._reached.wait()
        if stream is not None and self._end and stream.last_revision < self._end:
            self.error = self.error or (
                f"the watch reached revision {stream.last_revision} of {self._end} within "
                f"{settle_s:g}s; the count may be short")
        await self.close()

    async def close(self) -> None:
        """Stop the watch and its task (idempotent)."""
        stream, self._stream = self._stream, None
        task, self._task = self._task, None
        if stream is not None:
            stream.close()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
