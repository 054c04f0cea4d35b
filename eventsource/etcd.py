"""An asyncio facade over etcd's JSON gateway, via etcd3gw.

Why it exists: etcd3gw is blocking, and its helpers hide failures. Every call here
runs on one bounded, named thread pool, has a timeout both in ``requests`` (so the thread ends) and
in asyncio, and fails over to the next endpoint of ``ETCD_ENDPOINTS`` on a transport error.
Errors are translated once into ``eventsource.errors``. The gateway's JSON quirks (int64 as
strings, proto3 defaults omitted, base64 keys) are handled here and nowhere else.

This module holds the values callers build and read (keys, compares, operations, results) and
the asyncio calls; the blocking transport under them (connections, failover, the error
translation) is ``eventsource.etcdgateway``.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from eventsource.errors import LeaseLost, Unavailable
from eventsource.etcdgateway import EtcdGateway
from eventsource.etcdtls import EtcdTls
from eventsource.keys import prefix_end

T = TypeVar("T")


def b64(data: bytes | str) -> str:
    raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd reports it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> KeyValue:
        return cls(
            # any bytes: a key under the root that is not UTF-8 (another tool's) must not
            # stop a watch; it round-trips through b64() unchanged
            key=unb64(raw.get("key")).decode("utf-8", "surrogateescape"),
            value=unb64(raw.get("value")),
            create_revision=int(raw.get("create_revision", 0)),
            mod_revision=int(raw.get("mod_revision", 0)),
            version=int(raw.get("version", 0)),
            lease=int(raw.get("lease", 0)),
        )


@dataclass(frozen=True, slots=True)
class RangeResult:
    kvs: list[KeyValue]
    revision: int
    more: bool
    count: int


# -- transaction building blocks ------------------------------------------------------------

#: etcd's default --max-txn-ops. It bounds each list of a transaction; a nested transaction
#: gets what its parent's longest list leaves (etcd's checkTxnRequest)
MAX_TXN_OPS = 128


@dataclass(frozen=True, slots=True)
class Compare:
    """One compare of a transaction. ``target`` is MOD, CREATE, VERSION or LEASE."""

    key: str
    target: str
    value: int
    result: str = "EQUAL"
    #: compare every key under ``key`` as a prefix (an empty range compares as one absent key)
    prefix: bool = False

    @classmethod
    def unchanged_since(cls, prefix: str, revision: int) -> Compare:
        """No key under ``prefix`` was created or modified after ``revision`` (deletions do not
        count): what a check made on a listing at ``revision`` needs to still hold."""
        return cls(prefix, "MOD", revision + 1, result="LESS", prefix=True)

    @classmethod
    def mod(cls, key: str, mod_revision: int) -> Compare:
        """The key is unchanged since it was read (0 = the key must not exist)."""
        return cls(key, "MOD", mod_revision)

    @classmethod
    def absent(cls, key: str) -> Compare:
        return cls(key, "CREATE", 0)

    @classmethod
    def created_at(cls, key: str, create_revision: int) -> Compare:
        return cls(key, "CREATE", create_revision)

    @classmethod
    def lease_is(cls, key: str, lease_id: int) -> Compare:
        return cls(key, "LEASE", lease_id)

    def to_json(self) -> dict[str, Any]:
        field_name = {
            "MOD": "mod_revision",
            "CREATE": "create_revision",
            "VERSION": "version",
            "LEASE": "lease",
        }[self.target]
        body = {
            "key": b64(self.key),
            "result": self.result,
            "target": self.target,
            field_name: str(self.value),
        }
        if self.prefix:
            body["range_end"] = b64(prefix_end(self.key.encode()))
        return body


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: bytes
    lease: int = 0
    #: the category label of ``persys_scheduler_etcd_writes_total``
    category: str = "other"

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": b64(self.key), "value": b64(self.value)}
        if self.lease:
            body["lease"] = str(self.lease)
        return {"request_put": body}


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False
    category: str = "other"

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": b64(self.key)}
        if self.prefix:
            body["range_end"] = b64(prefix_end(self.key.encode()))
        return {"request_delete_range": body}


@dataclass(frozen=True, slots=True)
class Get:
    key: str

    def to_json(self) -> dict[str, Any]:
        return {"request_range": {"key": b64(self.key)}}


Op = Put | Delete | Get


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: list[dict[str, Any]] = field(default_factory=list)

    def range_kvs(self, index: int) -> list[KeyValue]:
        """The key-values of the ``index``-th response if it was a range."""
        body = self.responses[index].get("response_range", {})
        return [KeyValue.from_json(kv) for kv in body.get("kvs", [])]


# -- the client ----------------------------------------------------------------------------

#: keepalives per call (a streaming body is read only up to ``etcdgateway.STREAM_BODY_MAX``
#: bytes): ``{"ID":"<up to 19 digits>"}`` plus a newline is at most 29 bytes, so
#: 16 take at most 463 (17 would fit too; the power of two leaves a margin)
KEEPALIVE_BATCH_MAX = 16


#: the lanes of :class:`AsyncEtcd` (each its own thread pool)
Lane = Literal["bulk", "session"]
BULK: Lane = "bulk"
SESSION: Lane = "session"


class AsyncEtcd(EtcdGateway):
    """etcd behind a bounded thread pool, with endpoint failover and uniform errors."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 5.0,
        max_workers: int = 16,
        tls: EtcdTls | None = None,
    ) -> None:
        super().__init__(endpoints, timeout=timeout, tls=tls)
        # Two lanes: this process's own sessions (leader, relay, DNS record) and its probe of
        # etcd's health never wait behind bulk work (a late keepalive costs leadership, a late
        # probe declares a healthy etcd down). Node liveness keepalives stay in the bulk lane:
        # a separate lane of 4 or 16 threads made them slower at 5,000 nodes (9,000-30,000
        # timeouts in minutes against 1,600 in 20 minutes shared), because every extra thread
        # contends for the GIL of a process whose event loop is already busy.
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="etcd")
        self._lanes = {
            BULK: self._executor,
            SESSION: ThreadPoolExecutor(max_workers=2, thread_name_prefix="etcd-session"),
        }
        self._pool_size = max_workers
        self._closed = False

    async def _in_lane(self, lane: Lane, what: str, call: Callable[[float], T]) -> T:
        """Run a blocking ``call(deadline)`` on a lane's pool, bounded by the client timeout
        (which includes the wait for a thread of the lane). The thread gets the same
        monotonic deadline, so it sends nothing once the caller has stopped waiting (a write
        that landed after its caller was told UNAVAILABLE)."""
        if self._closed:
            raise Unavailable("etcd client closed")
        loop = asyncio.get_running_loop()
        budget = self.timeout * len(self.endpoints)
        deadline = time.monotonic() + budget
        future = loop.run_in_executor(self._lanes[lane], call, deadline)
        try:
            # a little past the thread's own deadline: the thread's answer wins a tie.
            # asyncio.timeout, not wait_for: wait_for wakes this task through one more loop
            # iteration, and every etcd call of a command is on its latency path
            async with asyncio.timeout(budget + 1.0):
                return await future
        except TimeoutError as exc:
            raise Unavailable(f"etcd {what}: timed out after {budget + 1.0:.1f}s") from exc

    async def post(self, path: str, body: dict[str, Any], *,
                   lane: Lane = BULK) -> dict[str, Any]:
        """One gateway call on one of the lanes (see ``__init__``)."""
        return await self._in_lane(
            lane, path, lambda deadline: self._post_blocking(path, body, deadline))

    # -- key-value --------------------------------------------------------------------------
    async def get(self, key: str, *, revision: int = 0, lane: Lane = BULK) -> KeyValue | None:
        body: dict[str, Any] = {"key": b64(key)}
        if revision:
            body["revision"] = str(revision)
        result = await self.post("/kv/range", body, lane=lane)
        kvs = result.get("kvs", [])
        return KeyValue.from_json(kvs[0]) if kvs else None

    async def range_prefix(
        self,
        prefix: str,
        *,
        start: str | None = None,
        revision: int = 0,
        limit: int = 0,
        keys_only: bool = False,
        count_only: bool = False,
        lane: Lane = BULK,
    ) -> RangeResult:
        """One page of a prefix range, optionally pinned to ``revision``."""
        body: dict[str, Any] = {
            "key": b64(start if start is not None else prefix),
            "range_end": b64(prefix_end(prefix.encode())),
        }
        if revision:
            body["revision"] = str(revision)
        if limit:
            body["limit"] = str(limit)
        if keys_only:
            body["keys_only"] = True
        if count_only:
            body["count_only"] = True
        result = await self.post("/kv/range", body, lane=lane)
        header_rev = int(result.get("header", {}).get("revision", 0))
        return RangeResult(
            kvs=[KeyValue.from_json(kv) for kv in result.get("kvs", [])],
            revision=header_rev,
            more=bool(result.get("more", False)),
            count=int(result.get("count", 0)),
        )

    async def list_prefix(
        self, prefix: str, *, revision: int = 0, page_size: int = 2000
    ) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` at one revision: each page is pinned to the first's."""
        out: list[KeyValue] = []
        page = await self.range_prefix(prefix, revision=revision, limit=page_size)
        pinned = revision or page.revision
        out.extend(page.kvs)
        while page.more and page.kvs:
            start = page.kvs[-1].key + "\0"
            page = await self.range_prefix(prefix, start=start, revision=pinned, limit=page_size)
            out.extend(page.kvs)
        return out, pinned

    async def txn(
        self,
        compares: Iterable[Compare],
        success: Iterable[Op],
        failure: Iterable[Op] = (),
    ) -> TxnResult:
        body = {
            "compare": [c.to_json() for c in compares],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure],
        }
        result = await self.post("/kv/txn", body)
        return TxnResult(
            succeeded=bool(result.get("succeeded", False)),
            revision=int(result.get("header", {}).get("revision", 0)),
            responses=list(result.get("responses", [])),
        )

    async def txn_group(
        self, subs: Sequence[tuple[Sequence[Compare], Sequence[Op]]]
    ) -> tuple[int, list[bool], bool]:
        """Several independent transactions in one request; returns the revision, per entry
        of ``subs`` whether its compares held (and its ops applied), and whether the group
        was sent a second time (nested, after its flat form failed a compare).

        First as one flat transaction (all compares, all ops), when it fits etcd's operation
        limit: the gateway decodes a nested transaction's bytes once per level, which made a
        group of 14 changes cost etcd 6.0 ms of CPU nested against 4.3 ms flat. Only if a
        compare fails (rare: concurrent writers of one record) is the group sent again
        nested: an outer transaction without compares whose success branch holds one
        transaction per entry, so each succeeds or fails alone. Both shapes apply at one
        revision and evaluate every compare before any write.
        """
        compares = [c for sub_compares, _ in subs for c in sub_compares]
        ops = [op for _, sub_ops in subs for op in sub_ops]
        tried_flat = len(compares) <= MAX_TXN_OPS and len(ops) <= MAX_TXN_OPS
        if tried_flat:
            flat = await self.txn(compares, ops)
            if flat.succeeded:
                return flat.revision, [True] * len(subs), False
        body = {
            "compare": [],
            "success": [
                {"request_txn": {"compare": [c.to_json() for c in sub_compares],
                                 "success": [op.to_json() for op in sub_ops]}}
                for sub_compares, sub_ops in subs
            ],
        }
        result = await self.post("/kv/txn", body)
        responses = list(result.get("responses", []))
        if len(responses) != len(subs):
            raise Unavailable(f"etcd /kv/txn: {len(responses)} answers for {len(subs)} changes")
        outcomes = [bool(r.get("response_txn", {}).get("succeeded", False)) for r in responses]
        return int(result.get("header", {}).get("revision", 0)), outcomes, tried_flat

    async def alarms(self, *, lane: Lane = BULK) -> list[str]:
        """The cluster's active alarms (``NOSPACE``, ``CORRUPT``): while one is raised, etcd
        answers reads and refuses writes."""
        result = await self.post("/maintenance/alarm", {"action": "GET"}, lane=lane)
        return sorted({str(a.get("alarm", "")) for a in result.get("alarms", []) or []
                       if a.get("alarm") not in (None, "", "NONE")})

    async def current_revision(self, *, lane: Lane = BULK) -> int:
        result = await self.post("/kv/range", {"key": b64("\0"), "count_only": True},
                                 lane=lane)
        return int(result.get("header", {}).get("revision", 0))

    async def compact(self, revision: int) -> None:
        await self.post("/kv/compaction", {"revision": str(revision), "physical": True})

    # -- leases -----------------------------------------------------------------------------
    async def lease_grant(self, ttl: int, *, lane: Lane = SESSION) -> int:
        """A new lease, by default on this process's session lane; node liveness leases go
        on ``BULK``."""
        result = await self.post("/lease/grant", {"TTL": str(ttl)}, lane=lane)
        return int(result["ID"])

    async def lease_keepalive(self, lease_id: int, *, lane: Lane = SESSION) -> int:
        """Renew a lease; returns its TTL. A keepalive is not a Raft write."""
        result = await self.post("/lease/keepalive", {"ID": str(lease_id)}, lane=lane)
        ttl = int(result.get("result", {}).get("TTL", 0))
        if ttl <= 0:
            raise LeaseLost(f"lease {lease_id:x} expired")
        return ttl

    async def lease_keepalive_many(self, lease_ids: Sequence[int], *,
                                   lane: Lane = BULK) -> dict[int, int]:
        """Renew up to ``KEEPALIVE_BATCH_MAX`` leases in one gateway call.

        Returns the TTL etcd answered for each lease, 0 for a lease that no longer exists; a
        lease etcd did not answer is missing (the caller must not take it as expired). The
        client-side cost of a gateway call is the call, not the lease; etcd still renews each
        lease on its own."""
        if not lease_ids:
            return {}
        if len(lease_ids) > KEEPALIVE_BATCH_MAX:
            raise ValueError(f"at most {KEEPALIVE_BATCH_MAX} leases per call, got "
                             f"{len(lease_ids)}")
        requests_ = [{"ID": str(lease_id)} for lease_id in lease_ids]
        results = await self._in_lane(
            lane, "/lease/keepalive",
            lambda deadline: self._post_stream_blocking("/lease/keepalive", requests_,
                                                         deadline))
        asked = set(lease_ids)
        ttls: dict[int, int] = {}
        for result in results:
            try:
                lease_id, ttl = int(result.get("ID", 0)), int(result.get("TTL", 0))
            except (TypeError, ValueError):
                continue
            if lease_id in asked:
                ttls[lease_id] = ttl
        return ttls

    async def lease_revoke(self, lease_id: int, *, lane: Lane = SESSION) -> None:
        try:
            await self.post("/lease/revoke", {"ID": str(lease_id)}, lane=lane)
        except LeaseLost:
            return

    async def health(self) -> bool:
        try:
            await self.get("/health", lane=SESSION)
        except Unavailable:
            return False
        return True

    def close(self) -> None:
        self._closed = True
        for executor in self._lanes.values():
            executor.shutdown(wait=False, cancel_futures=True)
