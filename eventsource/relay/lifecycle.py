"""The ``Relay``: campaigns for the relay election, leads while it holds it, re-campaigns.

Why apart: the lifecycle is the part a process owns (``run`` as a task, ``aclose`` to stop,
``status`` and ``term`` for /health). While leading, the pump relays and the retention task
trims; both end, cancelled and awaited, as soon as the lease is lost. Store failures end a
term, never the loop; a new term campaigns with a new lease.

Under Sentinel the relay is given the pin of its log's client on the master (``master``) and
the replicas an append waits for (``replicas``); the pump uses both (``eventsource.relay.pump``).
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry.trace import Tracer

from eventsource.clock import Clock
from eventsource.election import Election, Leadership, Session
from eventsource.errors import LeaseLost, StoreError
from eventsource.etcd import AsyncEtcd
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.racing import race
from eventsource.relay.marker import MARK_INTERVAL_S, Marker
from eventsource.relay.pruning import OutboxPruner
from eventsource.relay.pump import AfterAppend, OutboxPump
from eventsource.relay.retention import trim_by_age_forever
from eventsource.relay.view import StreamView
from eventsource.stream.eventlog import RedisEventLog
from eventsource.stream.replicas import ReplicaWait
from eventsource.stream.sentinel import MasterPin

log = logging.getLogger("persys.relay")


class Relay:
    """Relays the etcd outbox to the Redis stream while it holds the relay election."""

    def __init__(
        self,
        etcd: AsyncEtcd,
        layout: KeyLayout,
        log: RedisEventLog,
        metrics: Metrics,
        clock: Clock,
        *,
        max_entries: int,
        ttl_ms: int,
        outbox_max: int,
        batch: int = 500,
        instance_id: str,
        lease_ttl: int = 15,
        renew_deadline: float | None = None,
        trim_interval: float = 5.0,
        retry_min: float = 0.5,
        retry_max: float = 5.0,
        election_poll: float = 1.0,
        mark_interval: float = MARK_INTERVAL_S,
        after_append: AfterAppend | None = None,
        master: MasterPin | None = None,
        replicas: ReplicaWait | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        if batch < 1 or outbox_max < 1:
            raise ValueError("batch and outbox_max must be positive")
        self._etcd = etcd
        self._layout = layout
        self._log = log
        self._clock = clock
        self._ttl_ms = ttl_ms
        self.instance_id = instance_id
        self._lease_ttl = lease_ttl
        self._renew_deadline = renew_deadline if renew_deadline is not None else lease_ttl * 2 / 3
        if not 0 < self._renew_deadline < lease_ttl:
            raise ValueError("renew_deadline must be between 0 and the lease TTL")
        self._trim_interval = trim_interval
        self._retry_min = retry_min
        self._retry_max = retry_max
        self._election_poll = election_poll
        self._status = "stopped"
        self._closing = asyncio.Event()
        self._done = asyncio.Event()
        self._running = False
        self._led = False
        #: the term (election key create revision) while leading, else 0
        self.term = 0
        # the parts that lead, around one view of the stream and the mark
        view = StreamView()
        self._marker = Marker(etcd, layout.relay_mark, metrics, view, batch=batch,
                              instance_id=instance_id, mark_interval=mark_interval)
        pruner = OutboxPruner(etcd, layout, metrics, view, self._marker, outbox_max=outbox_max)
        self._pump = OutboxPump(
            etcd, layout, log, metrics, clock, view, self._marker, pruner,
            batch=batch, max_entries=max_entries, renew_deadline=self._renew_deadline,
            retry_min=retry_min, retry_max=retry_max, after_append=after_append,
            master=master, replicas=replicas,
            tracer=tracer,
        )  # fmt: skip

    @property
    def status(self) -> str:
        """``leader``, ``standby`` or ``stopped`` (for /health)."""
        return self._status

    @property
    def _marking(self) -> asyncio.Task[None] | None:
        """The marker task in flight, if any (tests wait for the relay to have none)."""
        return self._marker.task

    async def run(self) -> None:
        """Campaign, relay while leading, re-campaign after a loss; returns after ``aclose``.

        Store failures (etcd, Redis, lost lease or fence) are handled here and never end the
        loop; anything else is a bug and propagates to the owner's task guard.
        """
        if self._running or self._closing.is_set():
            raise RuntimeError("relay already running or closed")
        self._running = True
        self._status = "standby"
        delay = self._retry_min
        try:
            while not self._closing.is_set():
                self._led = False
                try:
                    finished, _ = await race(self._term(), self._closing)
                except StoreError as exc:
                    log.warning("relay %s: term ended: %r", self.instance_id, exc)
                    finished = True
                if not finished:
                    break
                # a term that led ended by a loss: campaign again promptly; else back off
                delay = self._retry_min if self._led else min(delay * 2, self._retry_max)
                await race(asyncio.sleep(delay), self._closing)
        finally:
            self._status = "stopped"
            self.term = 0
            self._done.set()

    async def aclose(self) -> None:
        """Stop relaying, resign, revoke the lease, and wait for ``run()`` to return."""
        self._closing.set()
        if self._running:
            await self._done.wait()
        self._status = "stopped"

    async def _term(self) -> None:
        """One lease: campaign, lead until the lease or the leadership is lost."""
        session = Session(self._etcd, ttl=self._lease_ttl, clock=self._clock,
                          renew_deadline=self._renew_deadline)
        await session.start()
        try:
            election = Election(
                self._etcd,
                session,
                self._layout.relay_election,
                self.instance_id,
                poll_interval=self._election_poll,
            )
            lead = await election.campaign()
            self._status, self.term, self._led = "leader", lead.term, True
            log.info("relay %s leads (term %d)", self.instance_id, lead.term)
            try:
                led_to_the_end, _ = await race(self._lead(lead), session.lost)
                if not led_to_the_end:
                    raise LeaseLost(f"relay lease lost: {session.lost_reason}")
            finally:
                self._status, self.term = "standby", 0
                log.info("relay %s stopped leading", self.instance_id)
                if not session.lost.is_set():
                    try:
                        async with asyncio.timeout(2.0):
                            await election.resign()
                    except (StoreError, TimeoutError) as exc:
                        log.info("relay resign failed (the lease revoke follows): %s", exc)
        finally:
            await session.close()

    async def _lead(self, lead: Leadership) -> None:
        trim = asyncio.create_task(
            trim_by_age_forever(self._log, self._clock, ttl_ms=self._ttl_ms,
                                interval=self._trim_interval),
            name=f"relay-trim:{self.instance_id}")
        try:
            await self._pump.run(lead)
        finally:
            trim.cancel()
            await asyncio.wait({trim})
            if not trim.cancelled() and trim.exception() is not None:
                log.error("relay trim task failed", exc_info=trim.exception())
