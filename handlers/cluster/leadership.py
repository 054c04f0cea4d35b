"""Leadership of this replica's shard, and the scope that leader-only work runs in.

The election is the Go version's (``eventsource.election``) under ``/persys/scheduler/leader``
or ``/persys/scheduler/leader/shard-<i>``. While this replica leads:

* every leader-only etcd write carries the fence (a compare on our election key's create
  revision and lease), installed on the committer;
* every leader-only agent RPC is preceded by the renew-deadline check (``guard``) and carries
  ``x-persys-leader-term``;
* the loops run as APScheduler jobs whose work is started inside the leadership task group,
  which is cancelled and awaited the moment leadership is lost, before anything else happens.

Leadership ends when the session's lease is lost, when the renew deadline (monotonic time since
the *send* of the last successful keepalive) passes, or on shutdown; the replica then
re-campaigns after a short backoff with a new session (never re-granting a lost lease).
"""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from eventsource.clock import Clock
from eventsource.commit import Change, Committer
from eventsource.election import Election, Leadership, Session
from eventsource.errors import Conflict, LeaseLost, NotLeader, StoreError
from eventsource.etcd import SESSION, AsyncEtcd, Compare, Put
from eventsource.events import Event
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.stream.clients import reraise_swallowed_cancel
from handlers.cluster.topology import Topology, TopologyMismatch, settle_topology

log = logging.getLogger("persys.leader")


#: node ids whose ownership ``LeaderGate.owns`` remembers before it starts over
OWNERSHIP_MEMO_MAX = 65_536
#: how often a leader checks that its election key is still its own (at most)
KEY_CHECK_S = 1.0
#: a change of wall clock minus monotonic clock larger than this is a clock step
CLOCK_STEP_S = 1.0


def owns_node(node_id: str, *, active_active: bool, shard_count: int, shard_index: int) -> bool:
    """Shard ownership as the Go version: crc32(node id) mod count == index."""
    if not active_active or shard_count <= 1:
        return True
    return zlib.crc32(node_id.strip().encode()) % shard_count == shard_index


@dataclass(frozen=True, slots=True)
class Loop:
    name: str
    interval_s: float
    body: Callable[[], Awaitable[None]]


#: how often a replica whose shard settings differ from the cluster's checks again
TOPOLOGY_RETRY_S = 10.0


class LeaderGate:
    """Campaigns, holds and loses leadership; runs the leader-only loops while it leads."""

    def __init__(
        self,
        etcd: AsyncEtcd,
        layout: KeyLayout,
        committer: Committer,
        metrics: Metrics,
        clock: Clock,
        *,
        instance_id: str,
        active_active: bool,
        shard_count: int,
        shard_index: int,
        lease_ttl_s: int,
        renew_deadline_s: float,
        recampaign_backoff_s: float = 2.0,
    ) -> None:
        self.etcd = etcd
        self.layout = layout
        self.committer = committer
        self.metrics = metrics
        self.clock = clock
        self.instance_id = instance_id
        self.active_active = active_active
        self.shard_count = shard_count
        self.shard_index = shard_index
        #: node id -> owned by this shard (``owns``)
        self._owned: dict[str, bool] = {}
        self.lease_ttl_s = lease_ttl_s
        self.renew_deadline_s = renew_deadline_s
        self.recampaign_backoff_s = recampaign_backoff_s
        self.prefix = layout.leader_election(active_active=active_active, shard_index=shard_index)
        #: what every replica that campaigns must agree on (handlers/cluster/topology.py)
        self.topology = Topology("active-active" if active_active else "failover", shard_count)
        #: why this replica does not campaign ("" while it may)
        self.topology_problem = ""
        self.loops: list[Loop] = []
        self.leadership: Leadership | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: set[str] = set()
        self._jobs: AsyncIOScheduler | None = None
        self._shard_label = str(shard_index) if active_active else "all"
        #: callbacks run right after leadership is gained / lost (e.g. to reset loop state)
        self.on_gain: list[Callable[[], None]] = []
        self.on_loss: list[Callable[[], None]] = []

    # -- what others ask --------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.leadership is not None and self.renew_ok()

    @property
    def term(self) -> int | None:
        return self.leadership.term if self.leadership is not None else None

    def renew_ok(self) -> bool:
        lead = self.leadership
        return lead is not None and lead.held(self.renew_deadline_s)

    def guard(self) -> None:
        """Raise ``NotLeader`` unless this replica may act as leader right now."""
        if not self.renew_ok():
            raise NotLeader("not the leader, or the renew deadline has passed")

    def fence(self) -> list[Compare]:
        lead = self.leadership
        if lead is None:
            raise NotLeader("not the leader")
        return lead.fence()

    def owns(self, node_id: str) -> bool:
        # asked for every node several times per cycle and per monitor pass; the answer never
        # changes for a node id (the topology is fixed for the process), so it is remembered
        owned = self._owned.get(node_id)
        if owned is None:
            if len(self._owned) >= OWNERSHIP_MEMO_MAX:
                self._owned.clear()  # ids of removed nodes: start over rather than grow
            owned = self._owned[node_id] = owns_node(
                node_id, active_active=self.active_active, shard_count=self.shard_count,
                shard_index=self.shard_index)
        return owned

    def add_loop(self, name: str, interval_s: float, body: Callable[[], Awaitable[None]]) -> None:
        """Register a leader-only loop; it runs at once on gaining leadership, then per interval."""
        self.loops.append(Loop(name, interval_s, body))

    # -- the leadership task group ----------------------------------------------------------
    def spawn(self, coro: Awaitable[None], *, name: str) -> asyncio.Task[None]:
        if self.leadership is None:
            raise NotLeader("leader-only work started without leadership")

        async def wrapped() -> None:
            await coro

        task = asyncio.get_running_loop().create_task(wrapped(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _cancel_group(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_once(self, loop: Loop) -> None:
        """One cycle of ``loop`` inside the leadership group; never two at once."""
        if not self.is_leader or loop.name in self._running:
            return
        self._running.add(loop.name)
        try:
            task = self.spawn(loop.body(), name=f"leader:{loop.name}")
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                log.error("leader loop %s failed: %r", loop.name, task.exception(),
                          exc_info=task.exception())
        finally:
            self._running.discard(loop.name)

    def _start_jobs(self) -> None:
        jobs = AsyncIOScheduler(timezone=UTC)
        now = datetime.now(UTC)
        for loop in self.loops:
            jobs.add_job(self.run_once, "interval", args=[loop], seconds=loop.interval_s,
                         next_run_time=now, max_instances=1, coalesce=True,
                         misfire_grace_time=max(1, int(loop.interval_s)), id=loop.name)
        jobs.start()
        self._jobs = jobs

    async def _end_jobs(self) -> None:
        """Stop the leader loops: no new run, the cycles in flight cancelled and ended, then
        the job scheduler shut down.

        Why this order: APScheduler's shutdown cancels a job coroutine still running, and logs
        that cancellation as a failed job (an ERROR with a traceback) at every step-down, loss
        or stop that meets a cycle in flight. Once its cycle is cancelled, ``run_once`` returns
        normally."""
        jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.pause()
        await self._cancel_group()
        for _ in range(100):  # each run_once returns within a loop iteration or two
            if not self._running:
                break
            await asyncio.sleep(0)
        if jobs is not None:
            jobs.shutdown(wait=False)

    # -- the campaign loop ------------------------------------------------------------------
    async def run(self) -> None:
        """Campaign, lead, lose, repeat; returns only when cancelled."""
        while True:
            session = Session(self.etcd, ttl=self.lease_ttl_s, clock=self.clock,
                              renew_deadline=self.renew_deadline_s)
            backoff = self.recampaign_backoff_s
            try:
                guard = await settle_topology(self.etcd, self.layout, self.topology)
                self.topology_problem = ""
                await session.start()
                election = Election(self.etcd, session, self.prefix, self.instance_id,
                                    guard=[guard])
                leadership = await election.campaign()
                await self._lead(leadership, election, session)
            except TopologyMismatch as exc:
                # not a passing failure: it lasts until an operator acts, so say it loudly
                self.topology_problem = str(exc)
                backoff = max(backoff, TOPOLOGY_RETRY_S)
            except (StoreError, LeaseLost) as exc:
                log.warning("election %s: %s", self.prefix, exc)
            except Exception:
                # never let the campaign loop die: this replica must be able to lead again
                log.exception("election %s: unexpected failure; campaigning again",
                              self.prefix)
            finally:
                await self._demote()
                try:
                    await session.close()
                except StoreError as exc:
                    log.info("session close: %s", exc)
            if self.topology_problem:
                log.error("election %s: not campaigning: %s", self.prefix,
                          self.topology_problem)
            await asyncio.sleep(backoff)

    async def _lead(self, leadership: Leadership, election: Election, session: Session) -> None:
        self.leadership = leadership
        self.committer.set_fence(leadership.fence)
        self.metrics.leader.labels(self._shard_label).set(1)
        self.metrics.leader_transitions.labels(self._shard_label, "gained").inc()
        log.warning("leadership gained election_key=%s term=%d instance_id=%s",
                    leadership.key, leadership.term, self.instance_id)
        try:
            await self._record_gain(leadership)
        except (Conflict, StoreError) as exc:
            log.warning("LeaderElected not recorded: %s", exc)
        for callback in self.on_gain:
            callback()
        self._start_jobs()
        check = min(0.25, self.renew_deadline_s / 4)
        key_every = min(KEY_CHECK_S, self.renew_deadline_s / 3)
        key_checked = self.clock.monotonic()
        wall_offset = self._wall_offset()
        reason = ""
        lost = asyncio.ensure_future(session.lost.wait())
        try:
            while self.renew_ok() and not lost.done():
                reraise_swallowed_cancel()  # one an awaited call swallowed
                await asyncio.wait({lost}, timeout=check)
                offset = self._wall_offset()
                if abs(offset - wall_offset) > CLOCK_STEP_S:
                    self._wall_clock_stepped(offset - wall_offset)
                    wall_offset = offset
                if self.clock.monotonic() - key_checked >= key_every:
                    key_checked = self.clock.monotonic()
                    reason = await self._key_gone(leadership)
                    if reason:
                        break
        finally:
            lost.cancel()
        log.warning("leadership lost election_key=%s term=%d reason=%s", leadership.key,
                    leadership.term,
                    reason or session.lost_reason or "renew deadline passed")
        # stop every leader-only task before anything else, resigning included
        await self._end_jobs()
        try:
            async with asyncio.timeout(2.0):
                await election.resign()
        except (StoreError, TimeoutError) as exc:
            log.info("resign after loss: %s", exc)

    async def _key_gone(self, leadership: Leadership) -> str:
        """Why the election key no longer makes this replica leader ("" while it does).

        The lease alone is not enough: a key deleted while its lease lives (by hand, by a
        cleanup script) lets another replica win while this one, still renewing, would go on
        calling agents as leader. An unanswered check decides nothing: the renew deadline
        covers an unreachable etcd."""
        try:
            kv = await self.etcd.get(leadership.key, lane=SESSION)
        except StoreError as exc:
            log.info("election key check failed: %s", exc)
            return ""
        if kv is None:
            return "election key deleted"
        if kv.create_revision != leadership.create_revision or kv.lease != leadership.lease_id:
            return "election key replaced"
        return ""

    def _wall_offset(self) -> float:
        return self.clock.now().timestamp() - self.clock.monotonic()

    def _wall_clock_stepped(self, step_s: float) -> None:
        """APScheduler times its jobs by the wall clock: after a step back every job would
        wait out the step (no reconcile, no node monitor for that long) while this replica
        still leads; each job is made due now instead (a running cycle is not disturbed)."""
        log.warning("wall clock stepped by %+.1fs; leader loops rescheduled", step_s)
        if self._jobs is None:
            return
        now = datetime.now(UTC)
        for job in self._jobs.get_jobs():
            job.modify(next_run_time=now)

    async def step_down(self) -> None:
        """Clean shutdown while leading: record LeaderLost (fenced), then the caller resigns."""
        lead = self.leadership
        if lead is None or not self.renew_ok():
            return
        await self._end_jobs()
        try:
            async with asyncio.timeout(2.0):
                await self._record_loss(lead, reason="leader stepped down")
        except (Conflict, StoreError, TimeoutError) as exc:
            log.info("LeaderLost not recorded at step-down: %s", exc)

    # -- the leadership record: every leadership event is a fenced write -------------------
    def _event(self, kind: str, reason: str, *, instance_id: str, key: str,
               term: int) -> Event:
        return Event(type=kind, reason=reason, timestamp=self.clock.now(),
                     details={"instance_id": instance_id, "election_key": key,
                              "term": str(term)})

    async def _record_gain(self, lead: Leadership) -> None:
        """LeaderElected, and LeaderLost for a predecessor that could not say so itself.

        A leader that loses its lease must not write anything after its successor exists, so
        the successor records the predecessor's loss, in the same fenced transaction.
        """
        record_key = self.layout.leadership_record(self._shard_label)
        current = await self.etcd.get(record_key)
        events: list[Event] = []
        if current is not None:
            previous = json.loads(current.value)
            if not previous.get("lost") and int(previous.get("term", 0)) != lead.term:
                events.append(self._event(
                    "LeaderLost", "leadership lost (lease expired); recorded by the successor",
                    instance_id=str(previous.get("instanceId", "")),
                    key=str(previous.get("electionKey", "")), term=int(previous.get("term", 0))))
        events.append(self._event("LeaderElected", "leadership gained",
                                  instance_id=self.instance_id, key=lead.key, term=lead.term))
        body = {"instanceId": self.instance_id, "electionKey": lead.key, "term": lead.term,
                "lost": False}
        await self.committer.commit(Change(
            kind="leader",
            compares=[Compare.mod(record_key, current.mod_revision if current else 0)],
            puts=[Put(record_key, json.dumps(body).encode(), category="election")],
            events=events), fenced=True)

    async def _record_loss(self, lead: Leadership, *, reason: str) -> None:
        record_key = self.layout.leadership_record(self._shard_label)
        body = {"instanceId": self.instance_id, "electionKey": lead.key, "term": lead.term,
                "lost": True}
        await self.committer.commit(Change(
            kind="leader",
            puts=[Put(record_key, json.dumps(body).encode(), category="election")],
            events=[self._event("LeaderLost", reason, instance_id=self.instance_id,
                                key=lead.key, term=lead.term)]), fenced=True)

    async def _demote(self) -> None:
        """Stop all leader-only work, then drop the role (called on every exit path)."""
        lead = self.leadership
        await self._end_jobs()
        if lead is None:
            return
        self.leadership = None
        self.committer.set_fence(None)
        self.metrics.leader.labels(self._shard_label).set(0)
        self.metrics.leader_transitions.labels(self._shard_label, "lost").inc()
        for callback in self.on_loss:
            callback()
