"""Our own reader of the etcd gateway's watch stream.

Why not etcd3gw's watch helper: it swallows exceptions in a detached thread, ignores
``canceled``/``compact_revision`` and never notices a dropped connection, so a cache built on it
can silently stop updating. This reader posts to ``/v3/watch`` with ``progress_notify`` on, parses
the newline-delimited JSON itself on one thread per watch, and hands batches to the event loop.
Every failure surfaces to the consumer as an exception:

* ``Compacted`` when the start revision is gone (the consumer must re-list),
* ``WatchCanceled`` for any other server-side cancel,
* ``Unavailable`` when the connection drops or stays silent past the read timeout (the consumer
  may resume from ``last_revision + 1``).

Events and progress notifications both advance ``last_revision``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import requests

from eventsource.errors import Compacted, Unavailable, WatchCanceled
from eventsource.etcd import KeyValue, b64
from eventsource.etcdtls import EtcdTls, system_ca
from eventsource.keys import prefix_end

log = logging.getLogger("persys.watch")


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A put (``deleted`` False) or delete of one key."""

    kv: KeyValue
    deleted: bool


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """Everything etcd sent in one response; ``events`` is empty for a progress notification."""

    revision: int
    events: list[WatchEvent]


_END = object()


class WatchStream:
    """A prefix watch from ``start_revision``, consumed with ``async for``.

    The stream ends only by an exception or by ``close()``; the owner closes it.
    """

    def __init__(
        self,
        base_url: str,
        prefix: str,
        start_revision: int,
        *,
        read_timeout: float = 5.0,
        connect_timeout: float = 3.0,
        no_delete: bool = False,
        queue_max: int = 10_000,
        tls: EtcdTls | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.prefix = prefix
        self.start_revision = start_revision
        self.read_timeout = read_timeout
        self.connect_timeout = connect_timeout
        self.no_delete = no_delete
        #: the newest revision this stream has reported (events or progress)
        self.last_revision = start_revision - 1
        self._queue: asyncio.Queue[WatchBatch | BaseException | object] = asyncio.Queue(
            maxsize=queue_max
        )
        self._loop = asyncio.get_running_loop()
        self._stop = threading.Event()
        self._response: requests.Response | None = None
        self._session = requests.Session()
        self._session.trust_env = False
        if tls is not None:
            options = tls.requests_options()
            self._session.verify = options["verify"]
            self._session.cert = options["cert"]
        elif base_url.startswith("https://"):
            self._session.verify = system_ca()  # as the gateway client verifies
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-watch:{prefix}", daemon=True
        )
        self._thread.start()

    def _deliver(self, item: WatchBatch | BaseException | object) -> None:
        if self._stop.is_set():
            return

        def put() -> None:
            try:
                self._queue.put_nowait(item)
            except asyncio.QueueFull:
                # a consumer that cannot keep up must re-list rather than grow memory
                self._queue = asyncio.Queue(maxsize=1)
                self._queue.put_nowait(Unavailable("watch consumer too slow"))

        try:
            self._loop.call_soon_threadsafe(put)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._stop.set()

    def _request_body(self) -> dict[str, Any]:
        create: dict[str, Any] = {
            "key": b64(self.prefix),
            "range_end": b64(prefix_end(self.prefix.encode())),
            "start_revision": str(self.start_revision),
            "progress_notify": True,
        }
        if self.no_delete:
            create["filters"] = ["NODELETE"]
        return {"create_request": create}

    def _run(self) -> None:
        try:
            response = self._session.post(
                f"{self.base_url}/v3/watch",
                json=self._request_body(),
                stream=True,
                timeout=(self.connect_timeout, self.read_timeout),
            )
            self._response = response
            if response.status_code != 200:
                raise Unavailable(f"watch HTTP {response.status_code}: {response.text[:200]}")
            for line in response.iter_lines(chunk_size=None):
                if self._stop.is_set():
                    return
                if not line:
                    continue
                self._handle(json.loads(line))
            raise Unavailable("watch stream ended")
        except (Compacted, WatchCanceled, Unavailable) as exc:
            self._deliver(exc)
        except Exception as exc:  # noqa: BLE001 - a thread boundary: every failure is delivered
            # closing the response from the loop thread makes the reader fail in many ways
            # (AttributeError inside http.client included); after close() none of them matter
            if not self._stop.is_set():
                self._deliver(Unavailable(f"watch connection lost: {exc!r}"))
        finally:
            if self._response is not None:
                self._response.close()
            self._session.close()

    def _handle(self, message: dict[str, Any]) -> None:
        if "error" in message:
            raise Unavailable(f"watch error: {message['error']}")
        result = message.get("result", {})
        if result.get("canceled"):
            compact = int(result.get("compact_revision", 0))
            if compact:
                raise Compacted(compact)
            raise WatchCanceled(str(result.get("cancel_reason", "watch canceled")))
        if int(result.get("compact_revision", 0)):
            raise Compacted(int(result["compact_revision"]))
        revision = int(result.get("header", {}).get("revision", 0))
        if result.get("created") and not result.get("events"):
            return
        events = [
            WatchEvent(kv=KeyValue.from_json(ev.get("kv", {})), deleted=ev.get("type") == "DELETE")
            for ev in result.get("events", [])
        ]
        if events:
            revision = max(e.kv.mod_revision for e in events)
        self._deliver(WatchBatch(revision=revision, events=events))

    async def __aiter__(self) -> AsyncIterator[WatchBatch]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                return
            assert isinstance(item, WatchBatch)
            if item.revision > self.last_revision:
                self.last_revision = item.revision
            yield item

    def take_ready(self) -> list[WatchBatch]:
        """Every batch already received, without waiting (consumers that coalesce work).

        Stops at an error or the end marker, which stays queued for the next ``__anext__``.
        """
        ready: list[WatchBatch] = []
        while not self._queue.empty():
            item = self._queue._queue[0]  # type: ignore[attr-defined]  # peek: errors stay
            if not isinstance(item, WatchBatch):
                break
            self._queue.get_nowait()
            if item.revision > self.last_revision:
                self.last_revision = item.revision
            ready.append(item)
        return ready

    def close(self) -> None:
        """Stop delivering; safe to call more than once and from the loop.

        The reader thread notices at its next chunk (progress notifications arrive every
        second) or at its read timeout, and then closes its own connection. Closing the
        response from here instead would block the loop until the reader's read returns.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._queue.put_nowait(_END)
        except asyncio.QueueFull:
            pass

    async def __aenter__(self) -> WatchStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
