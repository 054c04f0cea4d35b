"""Scenario ``failover``: kill -9 (or pause) the leader, again and again, and time the takeover.

Replicas are replicas of one shard (SCHEDULER_HA_MODE=failover). Each round: find the leader
through /health, remember every standby's ``persys_scheduler_reconcile_cycles_total``, SIGKILL
the leader, and poll the standbys until one reports leader=true and its cycle counter moved: that
span is one failover (leader killed -> first reconcile by the new leader). The killed replica is
then started again on its old ports, so every round has the same number of standbys.

With ``--fault pause`` the leader is SIGSTOPped instead and stays stopped past its lease; once a
standby leads and has reconciled, every other replica is SIGSTOPped for a quarter of the lease
TTL (shorter than their lease, so the successor keeps leading) and the old leader is resumed
alone: every etcd write the bench's own watch sees in that revision window is the old leader's,
and is counted as ``stale_leader_writes``, except what any standby writes for itself: puts under
a live lease (campaign keys, its DNS records) and its mode supervisor's SchedulerModeChanged.
The others are then resumed; the old leader stays as a standby.

``double_applies`` is what the simulated agents counted: applies carrying an
``x-persys-leader-term`` older than the newest term they had already seen. With ``--fault kill``
``stale_leader_writes`` is null: after a SIGKILL nothing can write, so a count would say nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from typing import Any

from eventsource.watch import WatchEvent
from ops.benchlib.etcdwatch import WriteCounter, event_type, key_group
from ops.benchlib.httpget import HttpError, get_json, http_get
from ops.benchlib.promtext import MetricsSnapshot
from ops.benchlib.quantiles import percentile
from ops.benchlib.scenario import PEAK_RSS, BenchContext, Outcome, Scenario
from ops.devstack.etcdapi import etcd_revision

FIGURES = ("kills", "failover_p50_s", "failover_p99_s", "stale_leader_writes", "double_applies",
           PEAK_RSS)
CYCLES = "persys_scheduler_reconcile_cycles_total"
#: Event records every replica writes for itself, leader or not (docs/events.md): the mode
#: supervisor probes etcd on every replica and records its own mode changes.
PER_REPLICA_EVENTS = frozenset({"SchedulerModeChanged"})
#: Key groups of records each replica keeps for itself under its own instance id, leader or not:
#: its CoreDNS (SkyDNS) records, which it deletes and writes again when its lease is lost.
PER_REPLICA_GROUPS = ("/skydns/",)
POLL_S = 0.02


async def _leader(ctx: BenchContext, timeout: float) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        # exactly one: a resumed old leader may still say leader=true until it steps down
        leaders = [i for i, health in enumerate(await ctx.stack.health())
                   if health.get("leader") == "true"]
        if len(leaders) == 1:
            return leaders[0]
        if loop.time() > deadline:
            raise RuntimeError(f"{len(leaders)} replicas report leader=true, not one")
        await asyncio.sleep(0.05)


async def _takeover(ctx: BenchContext, leader: int, before: dict[int, float], since: float,
                    limit_s: float, round_: int) -> int:
    """The standby that reports leader=true and whose cycle counter moved past ``before``."""
    # only the standbys are asked: a stopped leader would hold every poll for its timeout
    standbys = [i for i in range(len(ctx.stack.metrics_addrs)) if i != leader]
    while True:
        if time.monotonic() - since > limit_s:
            raise RuntimeError(f"round {round_}: no standby took over")
        for i, (health, snap) in zip(standbys, await asyncio.gather(
                *(_observe(ctx.stack.metrics_addrs[i]) for i in standbys)), strict=True):
            if snap is None or health.get("leader") != "true":
                continue
            if snap.total(CYCLES) > before.get(i, 0.0):
                return i
        await asyncio.sleep(POLL_S)


async def _observe(addr: str) -> tuple[dict[str, Any], MetricsSnapshot | None]:
    """``/health`` and ``/metrics`` of one replica (empty and None when it does not answer)."""
    try:
        health = await get_json(addr, "/health", timeout=2.0)
        body = await http_get(addr, "/metrics", timeout=5.0)
    except (OSError, HttpError):
        return {}, None
    return health, MetricsSnapshot.parse(body.decode("utf-8", errors="replace"))


def _signal(ctx: BenchContext, index: int, signum: signal.Signals) -> None:
    os.kill(ctx.stack.schedulers[index].pid, signum)


async def _revision(ctx: BenchContext) -> int:
    return await asyncio.to_thread(etcd_revision, ctx.stack.etcd_url)


async def _paused_round(ctx: BenchContext, leader: int, before: dict[int, float],
                        ttl: float, round_: int, tally: _Stale) -> tuple[float, int]:
    """SIGSTOP the leader past its lease; once a standby leads and reconciled, stop every
    other replica for a window shorter than their lease, resume the old leader alone and
    count what it writes in that window (the bench's etcd watch sees every writer, and only
    the old leader runs); then resume the others."""
    stack = ctx.stack
    watch = WriteCounter(stack.etcd_url, stack.etcd_root, on_event=tally.seen)
    await watch.start()
    try:
        paused_at = time.monotonic()
        _signal(ctx, leader, signal.SIGSTOP)
        try:
            successor = await _takeover(ctx, leader, before, paused_at, ttl + 30, round_)
            elapsed = time.monotonic() - paused_at
            others = [i for i in range(len(stack.schedulers)) if i != leader]
            window = max(0.5, ttl / 4)
            for i in others:
                _signal(ctx, i, signal.SIGSTOP)
            try:
                counted = sum(tally.counted.values())
                tally.begin(await _revision(ctx))
                _signal(ctx, leader, signal.SIGCONT)
                await asyncio.sleep(window)
                tally.end(await _revision(ctx))
            finally:
                for i in others:
                    _signal(ctx, i, signal.SIGCONT)
        finally:
            _signal(ctx, leader, signal.SIGCONT)  # whatever failed, never leave it stopped
        await watch.stop()
        stale = sum(tally.counted.values()) - counted
        if stale:
            ctx.log(f"failover: round {round_ + 1}: the resumed scheduler-{leader} wrote {stale} "
                    "key(s) while it ran alone")
    finally:
        await watch.close()
    if watch.error:
        tally.errors.append(watch.error)
    tally.windows.append(window)
    return elapsed, successor


def _describe_event(kind: str, value: bytes) -> str:
    try:
        details = json.loads(value).get("details") or {}
    except (ValueError, AttributeError):
        return kind
    if not isinstance(details, dict) or "from" not in details:
        return kind
    return f"{kind} {details.get('from')} -> {details.get('to')}"


class _Stale:
    """Writes inside the windows where only a resumed old leader ran, by key group."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.low = self.high = 0
        self.counted: Counter[str] = Counter()
        self.leased: Counter[str] = Counter()
        self.keys: list[str] = []
        #: event records (outbox puts) among the counted writes, by type
        self.event_types: Counter[str] = Counter()
        #: event records of PER_REPLICA_EVENTS (not counted), with their from -> to
        self.per_replica: Counter[str] = Counter()
        self.windows: list[float] = []
        self.errors: list[str] = []

    def begin(self, revision: int) -> None:
        self.low, self.high = revision, 0

    def end(self, revision: int) -> None:
        self.high = revision

    def seen(self, event: WatchEvent) -> None:
        rev = event.kv.mod_revision
        if not self.low or rev <= self.low or (self.high and rev > self.high):
            return
        group = key_group(event.kv.key, self.root)
        if group in PER_REPLICA_GROUPS:
            self.leased[f"{group} ({'deletes' if event.deleted else 'puts'})"] += 1
            return
        if not event.deleted and event.kv.lease:
            # attached to a lease alive at the write, so not the expired one of the old
            # leadership: a new session's campaign keys and per-replica records (DNS)
            self.leased[group] += 1
            return
        if "outbox" in group and not event.deleted:
            kind = event_type(event.kv.value)
            if kind in PER_REPLICA_EVENTS:
                self.per_replica[_describe_event(kind, event.kv.value)] += 1
                return
            self.event_types[kind] += 1
        self.counted[group] += 1
        if len(self.keys) < 5:
            self.keys.append(("delete " if event.deleted else "put ") + event.kv.key)


async def run(ctx: BenchContext) -> Outcome:
    out = Outcome.empty(FIGURES)
    stack = ctx.stack
    fault = getattr(ctx.args, "fault", "kill")
    if len(stack.schedulers) < 2:
        raise RuntimeError("failover needs --replicas 2 or more")
    report = await ctx.create_workloads(min(ctx.args.workloads, 20 * ctx.args.nodes))
    await ctx.wait_running(len(report.committed), timeout=ctx.running_timeout(
        len(report.committed)))
    ttl = float(ctx.args.lease_ttl)
    durations: list[float] = []
    tally = _Stale(stack.etcd_root)
    for round_ in range(ctx.args.kills):
        leader = await _leader(ctx, timeout=ttl + 30)
        snapshots = await stack.scrape()
        before = {i: (s.total(CYCLES) if s is not None else 0.0)
                  for i, s in enumerate(snapshots) if i != leader}
        if fault == "pause":
            elapsed, successor = await _paused_round(ctx, leader, before, ttl, round_, tally)
            verb = "paused (SIGSTOP)"
        else:
            ctx.peak_rss.sample({f"scheduler-{leader}": stack.schedulers[leader].pid})
            killed_at = time.monotonic()
            stack.schedulers[leader].proc.kill()
            stack.schedulers[leader].proc.wait()
            successor = await _takeover(ctx, leader, before, killed_at, ttl + 30, round_)
            elapsed = time.monotonic() - killed_at
            verb = "killed"
        durations.append(elapsed)
        ctx.log(f"failover: round {round_ + 1}: scheduler-{leader} {verb} -> "
                f"scheduler-{successor} reconciled after {elapsed:.2f}s (TTL {ttl:g}s)")
        if fault != "pause":
            await stack.restart_scheduler(leader)
    stats = await stack.fleet_stats()
    out.figures["kills"] = len(durations)
    out.figures["failover_p50_s"] = round(percentile(durations, 0.5) or 0.0, 3)
    out.figures["failover_p99_s"] = round(percentile(durations, 0.99) or 0.0, 3)
    if fault == "pause":
        _stale_figure(out, tally)
    else:
        out.null("stale_leader_writes", "not measured with --fault kill: a SIGKILLed leader "
                 "cannot write; --fault pause (the old leader stopped past its lease, then "
                 "resumed) measures it")
    out.figures["double_applies"] = int(stats.get("double_applies", 0))
    out.notes["failover_p50_s"] = (f"fault {fault}; lease TTL {ttl:g}s; the floor is about "
                                   "TTL + 0.5s minus the time since the last keepalive")
    return out


def _stale_figure(out: Outcome, tally: _Stale) -> None:
    key = "stale_leader_writes"
    if tally.errors:
        out.null(key, "the bench's etcd watch failed: " + "; ".join(tally.errors))
        return
    out.figures[key] = sum(tally.counted.values())
    window = min(tally.windows) if tally.windows else 0.0
    out.note(key, f"etcd writes (the bench's own watch) made by the resumed old leader after "
             f"its successor led: in each round every other replica was stopped for "
             f"{window:g}s while the old leader ran alone, so every write of that revision "
             "window is its own. Not counted: what a replica writes for itself, leader or not: "
             "puts attached to a lease, which etcd accepts only under a live lease, so not "
             "under the old leadership's expired one (a new session's campaign keys), and its "
             "own DNS records (" + ", ".join(PER_REPLICA_GROUPS) + ", puts and deletes): "
             + (", ".join(f"{g} {n}" for g, n in tally.leased.most_common()) or "none")
             + "; nor event records of an emitter every replica runs for itself, leader or "
             "not (" + ", ".join(sorted(PER_REPLICA_EVENTS)) + ", the mode supervisor's): "
             + (", ".join(f"{k} {n}" for k, n in tally.per_replica.most_common()) or "none"))
    if tally.counted:
        out.note(key, "counted, by key group: " + ", ".join(
            f"{g} {n}" for g, n in tally.counted.most_common())
            + "; first: " + ", ".join(tally.keys))
    if tally.event_types:
        out.note(key, "event records among them, by type: " + ", ".join(
            f"{t} {n}" for t, n in tally.event_types.most_common()))


SCENARIO = Scenario(name="failover", summary="kill -9 (or SIGSTOP: --fault pause) the leader; "
                    "time until a standby reconciles", figures=FIGURES, run=run, ha="failover",
                    kills_processes=True, min_replicas=2)
