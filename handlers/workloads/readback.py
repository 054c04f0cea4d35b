"""After a write whose outcome is unknown (etcd's answer lost): read the write back before
answering, and keep asking in a task the dispatcher owns while etcd cannot tell.

Apart because creating and updating a workload settle a lost answer the same way: a committed
change whose answer was lost runs its follow-up (the agent apply) instead of being left for
the reconcile loop's re-apply guard, and a write that never landed is not guessed to have.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from eventsource.commit import Committer
from eventsource.errors import StoreError
from handlers.workloads.dispatch import Dispatcher

log = logging.getLogger("persys.workloads")

#: how often, and how many times, a write whose outcome is unknown is read back while etcd
#: does not answer (then the reconcile loop's re-apply guard takes over)
RESOLVE_INTERVAL_S = 1.0
RESOLVE_ATTEMPTS = 60
#: a write not found once etcd answers is read once more after this: longer than etcd's own
#: request timeout (5 s + 2 election timeouts by default), within which a request still
#: inside etcd is applied or dropped
RESOLVE_SETTLE_S = 10.0


class ReadBack:
    """Settles unknown outcomes by reading etcd; the later reads run in dispatcher tasks."""

    def __init__(self, *, committer: Committer, dispatcher: Dispatcher) -> None:
        self.committer = committer
        self.dispatcher = dispatcher

    async def created(self, key: str, value: bytes) -> int:
        """The revision at which ``key`` was created holding ``value`` (a new status record,
        unique to its attempt by its timestamps), or 0; raises ``StoreError`` while etcd
        cannot tell."""
        etcd = self.committer.etcd
        kv = await etcd.get(key)
        if kv is None:
            return 0
        first = kv if kv.version == 1 else await etcd.get(key, revision=kv.create_revision)
        return kv.create_revision if first is not None and first.value == value else 0

    async def holds(self, key: str, value: bytes, *, after: int) -> int:
        """The revision at which ``key`` was written holding ``value`` after ``after``, or
        0; raises ``StoreError`` while etcd cannot tell."""
        kv = await self.committer.etcd.get(key)
        return kv.mod_revision if kv is not None and kv.value == value and (
            kv.mod_revision > after) else 0

    async def resolve(self, landed: Callable[[], Awaitable[int]],
                      then: Callable[[int], None], *, what: str) -> int:
        """After an unknown outcome: the commit revision when ``landed`` reads the write back
        (``then`` has run), else 0. A miss is not final: the request may still be inside
        etcd and be applied after the read (seen with etcd stopped and resumed), so the
        write is read again in a task the dispatcher owns, which runs ``then`` if it shows
        up; a committed change whose answer was lost is not left for the reconcile loop's
        re-apply guard."""
        try:
            revision = await landed()
        except StoreError as exc:
            log.info("outcome of the %s unknown; asking etcd again later: %s", what, exc)
            revision = 0
        if revision:
            log.warning("outcome of the %s was unknown; read back as committed at %d", what,
                        revision)
            then(revision)
        else:
            self.dispatcher.spawn(self._resolve_later(landed, then, what=what))
        return revision

    async def _resolve_later(self, landed: Callable[[], Awaitable[int]],
                             then: Callable[[int], None], *, what: str) -> None:
        answered = 0
        for _ in range(RESOLVE_ATTEMPTS):
            await asyncio.sleep(RESOLVE_INTERVAL_S if not answered else RESOLVE_SETTLE_S)
            try:
                revision = await landed()
            except StoreError:
                continue
            if revision:
                log.warning("outcome of the %s was unknown; read back as committed at %d",
                            what, revision)
                then(revision)
                return
            answered += 1
            if answered > 1:
                return  # absent once etcd answered, and still after etcd's request timeout
        log.warning("outcome of the %s still unknown; the reconcile loop settles it", what)
