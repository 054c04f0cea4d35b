"""Leases and the Go version's election protocol (etcd ``concurrency.Election``) on AsyncEtcd.

Why it exists: the scheduler must share leadership with Go replicas,
so it speaks exactly the protocol of ``go.etcd.io/etcd/client/v3/concurrency``: a candidate puts
``<prefix>/<lease id in lowercase hex>`` with its lease (create-if-absent), and the key with the
lowest ``create_revision`` under ``<prefix>/`` leads; everybody else waits for the deletion of
the newest key created before its own. The leader's fencing token is its key's
``create_revision`` (the *term*); every leader-only write carries :meth:`Leadership.fence`.
See docs/architecture.md, "Leadership, sharding and liveness".

Invariants:

* A :class:`Session` owns exactly one lease and one keepalive task. ``lost`` is set once and never
  cleared: when etcd says the lease is gone, when renewal has failed for a whole TTL, or when the
  session is closed. A lost session is never revived; callers create a new one (never
  re-grant a lease while keeping the role: docs/architecture.md, "Client rules").
* ``last_renew_sent`` is the monotonic time at which the last *successful* keepalive (or the
  grant) was *sent*: the lease is certainly alive until ``last_renew_sent + ttl`` on etcd's
  clock, which is what :meth:`Session.renew_deadline_ok` relies on.
* :meth:`Election.campaign` returns only if, after the wait, the session is still alive and the
  key still exists with the campaigned ``create_revision`` and our lease (the known trap: a
  campaign can report success after its own lease expired).
* A cancelled or failed campaign deletes its own key (best effort, bounded), so a live lease
  never leaves behind a candidate key that would later "lead" with nobody acting on it.
* Every remote call is bounded: AsyncEtcd's own timeout, plus explicit ``asyncio.timeout`` where
  the TTL demands a tighter bound.

Caveat kept on purpose: Go ranges the whole ``<prefix>/``, so the
failover prefix ``/persys/scheduler/leader`` also sees the shard campaigners under
``/persys/scheduler/leader/shard-<i>/``. We keep that semantics exactly (a Go and a Python
replica must never both lead); the consequence is that mixed failover/active-active fleets are
not supported (docs/compatibility.md, "Election prefix overlap").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from eventsource.clock import Clock, SystemClock
from eventsource.errors import (
    Compacted,
    Conflict,
    LeaseLost,
    NotLeader,
    Unavailable,
    WatchCanceled,
)
from eventsource.etcd import AsyncEtcd, Compare, Delete, Get, KeyValue, Put, b64
from eventsource.keys import prefix_end
from eventsource.watch import WatchStream

log = logging.getLogger("persys.election")

__all__ = ["Election", "Leadership", "Session", "leader_key", "observe_leader"]


def leader_key(prefix: str, lease_id: int) -> str:
    """The candidate key of a lease, exactly as Go formats it (``fmt.Sprintf("%s/%x")``)."""
    return f"{prefix.rstrip('/')}/{lease_id:x}"


async def _range_sorted(
    etcd: AsyncEtcd,
    prefix: str,
    *,
    order: str,
    limit: int,
    max_create_revision: int = 0,
) -> tuple[list[KeyValue], int]:
    """One range over ``prefix`` sorted by create revision; returns (kvs, header revision)."""
    body: dict[str, Any] = {
        "key": b64(prefix),
        "range_end": b64(prefix_end(prefix.encode())),
        "sort_order": order,
        "sort_target": "CREATE",
        "limit": str(limit),
    }
    if max_create_revision:
        body["max_create_revision"] = str(max_create_revision)
    result = await etcd.post("/kv/range", body)
    revision = int(result.get("header", {}).get("revision", 0))
    return [KeyValue.from_json(kv) for kv in result.get("kvs", [])], revision


async def observe_leader(etcd: AsyncEtcd, prefix: str) -> KeyValue | None:
    """The current leader's key and value under ``prefix`` (Go ``Election.Leader``), or None."""
    kvs, _ = await _range_sorted(etcd, prefix.rstrip("/") + "/", order="ASCEND", limit=1)
    return kvs[0] if kvs else None


class Session:
    """One lease kept alive by a task this object owns, every TTL/3, or every half of the
    renew deadline its holder checks with :meth:`held` when that is shorter (renewing only
    every TTL/3 against a deadline of TTL/3 or less would make a healthy holder look overdue
    between two keepalives, and its leadership flap).

    Use as ``async with Session(etcd, ttl=15) as session:`` or call :meth:`start` and
    :meth:`close` explicitly.
    """

    def __init__(
        self,
        etcd: AsyncEtcd,
        *,
        ttl: int,
        clock: Clock | None = None,
        retry_interval: float = 0.5,
        renew_deadline: float | None = None,
    ) -> None:
        if ttl < 2:
            raise ValueError("lease TTL must be at least 2 seconds (etcd's minimum)")
        self._etcd = etcd
        self.ttl = ttl
        #: seconds between keepalives
        self.interval = min(ttl / 3.0, renew_deadline / 2.0) if renew_deadline else ttl / 3.0
        self._clock: Clock = clock or SystemClock()
        self._retry_interval = retry_interval
        self._lease_id = 0
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        #: set once the lease is gone (expired, revoked, unrenewable for a TTL, or closed)
        self.lost = asyncio.Event()
        #: why ``lost`` was set (for logs and /health)
        self.lost_reason = ""
        #: monotonic time of the send of the last successful keepalive (or of the grant)
        self.last_renew_sent = 0.0

    @property
    def lease_id(self) -> int:
        if not self._lease_id:
            raise RuntimeError("session not started")
        return self._lease_id

    @property
    def started(self) -> bool:
        return bool(self._lease_id)

    async def start(self) -> Session:
        """Grant the lease and start the keepalive task.

        Raises:
            Unavailable: etcd could not grant the lease.
        """
        if self._lease_id:
            raise RuntimeError("session already started")
        sent = self._clock.monotonic()
        self._lease_id = await self._etcd.lease_grant(self.ttl)
        self.last_renew_sent = sent
        self._task = asyncio.create_task(
            self._keepalive(), name=f"lease-keepalive:{self._lease_id:x}"
        )
        return self

    def alive(self) -> bool:
        """Not lost, and renewed within the TTL (by our clock)."""
        return self.renew_deadline_ok(float(self.ttl))

    def renew_deadline_ok(self, deadline_s: float) -> bool:
        """Whether the last successful keepalive was *sent* less than ``deadline_s`` ago.

        Called right before actions etcd cannot fence (agent RPCs, XADDs): with
        ``deadline_s`` < TTL the lease is known to be alive on etcd for at least
        ``TTL - deadline_s`` more seconds, whatever happened to the keepalive replies since.
        """
        if self.lost.is_set() or not self._lease_id:
            return False
        return self._clock.monotonic() - self.last_renew_sent < deadline_s

    def _mark_lost(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()
            if not self._closed:
                log.warning("lease %x lost: %s", self._lease_id, reason)

    async def _keepalive(self) -> None:
        """The owned task: renew until the lease is lost; any failure marks it lost."""
        try:
            await self._renew_until_lost()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._mark_lost(f"keepalive task failed: {exc!r}")
            raise

    async def _renew_until_lost(self) -> None:
        interval = self.interval
        delay = interval
        while True:
            await asyncio.sleep(delay)
            sent = self._clock.monotonic()
            remaining = self.ttl - (sent - self.last_renew_sent)
            if remaining <= 0:
                self._mark_lost(f"not renewed for {self.ttl}s")
                return
            try:
                async with asyncio.timeout(remaining):
                    await self._etcd.lease_keepalive(self._lease_id)
            except LeaseLost as exc:
                self._mark_lost(str(exc) or "lease expired")
                return
            except (Unavailable, TimeoutError) as exc:
                if self._clock.monotonic() - self.last_renew_sent >= self.ttl:
                    self._mark_lost(f"renewal failed for a whole TTL: {exc}")
                    return
                log.info("lease %x keepalive failed, retrying: %s", self._lease_id, exc)
                delay = min(interval, self._retry_interval)
                continue
            self.last_renew_sent = sent
            delay = interval

    async def close(self, *, revoke: bool = True, revoke_timeout: float = 2.0) -> None:
        """Stop the keepalive task and (by default) revoke the lease; sets ``lost``.

        ``revoke=False`` lets the lease run out its TTL instead (what a crash looks like to
        other replicas). Revocation is best effort and bounded by ``revoke_timeout``: a lease that
        cannot be revoked expires by itself.
        """
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        was_lost = self.lost.is_set()
        self._mark_lost("session closed")
        if revoke and self._lease_id and not was_lost:
            try:
                async with asyncio.timeout(revoke_timeout):
                    await self._etcd.lease_revoke(self._lease_id)
            except (Unavailable, TimeoutError) as exc:
                log.warning("lease %x not revoked (it will expire): %s", self._lease_id, exc)

    async def __aenter__(self) -> Session:
        if not self._lease_id:
            await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


@dataclass(frozen=True, slots=True)
class Leadership:
    """What a won campaign holds: the key, its term, and the fence for leader-only writes."""

    key: str
    #: the key's create revision: the term, and the fencing token
    create_revision: int
    lease_id: int
    value: str
    session: Session = field(repr=False, compare=False)

    @property
    def term(self) -> int:
        return self.create_revision

    def fence(self) -> list[Compare]:
        """Compares that hold only while this leadership does.

        The fence of docs/architecture.md, "Leadership, sharding and liveness"."""
        return [
            Compare.created_at(self.key, self.create_revision),
            Compare.lease_is(self.key, self.lease_id),
        ]

    def held(self, renew_deadline_s: float | None = None) -> bool:
        """Local check: the session is alive and renewed within ``renew_deadline_s``."""
        deadline = float(self.session.ttl) if renew_deadline_s is None else renew_deadline_s
        return self.session.renew_deadline_ok(deadline)


class Election:
    """One candidacy of one session under one election prefix (Go ``concurrency.Election``)."""

    def __init__(
        self,
        etcd: AsyncEtcd,
        session: Session,
        prefix: str,
        value: str,
        *,
        poll_interval: float = 1.0,
        abandon_timeout: float = 2.0,
        guard: Sequence[Compare] = (),
    ) -> None:
        self._etcd = etcd
        self._session = session
        self.prefix = prefix.rstrip("/")
        self.value = value
        #: compares the candidacy itself needs to hold (the shard topology it campaigns with)
        self._guard = tuple(guard)
        self._poll_interval = poll_interval
        self._abandon_timeout = abandon_timeout
        self._key = ""
        self._create_revision = 0
        #: the leadership of the last successful campaign, until resign
        self.leadership: Leadership | None = None

    @property
    def key(self) -> str:
        """This candidate's key (empty before ``campaign``)."""
        return self._key

    async def campaign(self) -> Leadership:
        """Become a candidate and wait until this session leads; cancellable.

        Raises:
            LeaseLost: the session's lease is gone (before, during or right after the wait).
            Conflict: a compare of ``guard`` failed; no candidate key was written.
            Unavailable: etcd could not be reached; the candidate key is removed (best effort).
        """
        session = self._session
        if session.lost.is_set():
            raise LeaseLost(f"session lost before campaign: {session.lost_reason}")
        lease_id = session.lease_id
        key = leader_key(self.prefix, lease_id)
        result = await self._etcd.txn(
            [Compare.absent(key), *self._guard],
            [Put(key, self.value.encode(), lease=lease_id, category="election")],
            [Get(key)],
        )
        existing: KeyValue | None = None
        if result.succeeded:
            create_revision = result.revision
        else:
            kvs = result.range_kvs(0)
            if not kvs:  # our key is absent, so a compare of the guard failed
                raise Conflict(f"campaign {key}: a guarded key changed", revision=result.revision)
            # our key already exists (a second campaign on the same session): keep its term
            if self._guard and not (await self._etcd.txn(self._guard, [])).succeeded:
                raise Conflict(f"campaign {key}: a guarded key changed", revision=result.revision)
            existing = kvs[0]
            create_revision = existing.create_revision
        self._key, self._create_revision = key, create_revision
        try:
            if existing is not None and existing.value != self.value.encode():
                await self.proclaim(self.value)
            await self._wait_predecessors(create_revision - 1)
            leadership = await self._confirm(key, create_revision, lease_id)
        except BaseException:
            await self._abandon()
            raise
        self.leadership = leadership
        log.info("won election %s with %s (term %d)", self.prefix, key, create_revision)
        return leadership

    async def _confirm(self, key: str, create_revision: int, lease_id: int) -> Leadership:
        """The trap check: a successful wait means nothing if our own lease is gone."""
        if not self._session.alive():
            raise LeaseLost(f"lease {lease_id:x} lost while campaigning")
        kv = await self._etcd.get(key)
        if kv is None or kv.create_revision != create_revision or kv.lease != lease_id:
            raise LeaseLost(f"campaign key {key} vanished while campaigning")
        return Leadership(
            key=key,
            create_revision=create_revision,
            lease_id=lease_id,
            value=self.value,
            session=self._session,
        )

    async def _wait_predecessors(self, max_create_revision: int) -> None:
        """Go ``waitDeletes``: wait until no key under the prefix predates ours."""
        scan_prefix = self.prefix + "/"
        while True:
            self._check_session()
            kvs, revision = await _range_sorted(
                self._etcd,
                scan_prefix,
                order="DESCEND",
                limit=1,
                max_create_revision=max_create_revision,
            )
            if not kvs:
                return
            await self._wait_delete(kvs[0], revision)

    def _check_session(self) -> None:
        if self._session.lost.is_set():
            raise LeaseLost(f"session lost while campaigning: {self._session.lost_reason}")

    async def _wait_delete(self, predecessor: KeyValue, revision: int) -> None:
        """Return once ``predecessor`` is probably deleted; the caller re-checks by ranging.

        The watch gives a prompt answer; a ``get`` every ``poll_interval`` covers a watch that
        fails silently or is slow, and keeps the session check frequent. Correctness never
        depends on the watch: the caller's range decides.
        """
        key = predecessor.key
        watch = WatchStream(self._etcd.base_url, key, revision + 1, tls=self._etcd.tls)
        try:
            while True:
                self._check_session()
                try:
                    async with asyncio.timeout(self._poll_interval):
                        async for batch in watch:
                            if any(ev.deleted and ev.kv.key == key for ev in batch.events):
                                return
                except TimeoutError:
                    pass
                current = await self._etcd.get(key)
                if current is None or current.create_revision != predecessor.create_revision:
                    return
        except (Compacted, WatchCanceled) as exc:
            log.debug("election watch on %s ended: %s; re-ranging", key, exc)
        except Unavailable as exc:
            # a broken watch must not become a busy loop; the range after it decides
            log.debug("election watch on %s failed: %s; re-ranging", key, exc)
            await asyncio.sleep(self._poll_interval)
        finally:
            watch.close()

    async def _abandon(self) -> None:
        """Delete our candidate key after a failed or cancelled campaign (bounded)."""
        if not self._key:
            return
        try:
            async with asyncio.timeout(self._abandon_timeout):
                await self._delete_own_key()
        except (Unavailable, LeaseLost, TimeoutError) as exc:
            log.warning("could not remove candidate key %s (lease will expire): %s", self._key, exc)
        self._key, self._create_revision = "", 0

    async def _delete_own_key(self) -> bool:
        result = await self._etcd.txn(
            [Compare.created_at(self._key, self._create_revision)],
            [Delete(self._key, category="election")],
        )
        return result.succeeded

    async def proclaim(self, value: str) -> None:
        """Change the value of our key without losing its term (Go ``Proclaim``).

        Raises:
            NotLeader: our key is gone or was recreated.
        """
        if not self._key:
            raise NotLeader("not campaigning")
        result = await self._etcd.txn(
            [Compare.created_at(self._key, self._create_revision)],
            [Put(self._key, value.encode(), lease=self._session.lease_id, category="election")],
        )
        if not result.succeeded:
            raise NotLeader(f"election key {self._key} lost")
        self.value = value

    async def resign(self) -> None:
        """Give up leadership (or candidacy): delete our key, fenced by its create revision."""
        if not self._key:
            return
        key = self._key
        try:
            await self._delete_own_key()
        finally:
            self._key, self._create_revision = "", 0
            self.leadership = None
        log.info("resigned %s", key)

    async def observe_leader(self) -> KeyValue | None:
        """The current leader under this election's prefix, or None."""
        return await observe_leader(self._etcd, self.prefix)
