"""Scenario ``failover``: kill -9 the leader, again and again, and time the takeover.

Replicas are replicas of one shard (SCHEDULER_HA_MODE=failover). Each round: find the leader
through /health, remember every standby's ``persys_scheduler_reconcile_cycles_total``, SIGKILL
the leader, and poll the standbys until one reports leader=true and its cycle counter moved: that
span is one failover (leader killed -> first reconcile by the new leader). The killed replica is
then started again on its old ports, so every round has the same number of standbys.

``double_applies`` is what the simulated agents counted: applies carrying an
``x-persys-leader-term`` older than the newest term they had already seen. ``stale_leader_writes``
is reported as null: after a SIGKILL nothing can write, so a count would say nothing; the
SIGSTOP variant, where the old leader lives on past its lease, is measured by tests/test_ha.py,
which counts its writes and applies after the successor's election.
"""

from __future__ import annotations

import asyncio
import time

from ops.benchlib.quantiles import percentile
from ops.benchlib.scenario import BenchContext, Outcome, Scenario

FIGURES = ("kills", "failover_p50_s", "failover_p99_s", "stale_leader_writes", "double_applies")
CYCLES = "persys_scheduler_reconcile_cycles_total"
POLL_S = 0.02


async def _leader(ctx: BenchContext, timeout: float) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for i, health in enumerate(await ctx.stack.health()):
            if health.get("leader") == "true":
                return i
        if loop.time() > deadline:
            raise RuntimeError("no leader")
        await asyncio.sleep(0.05)


async def run(ctx: BenchContext) -> Outcome:
    out = Outcome.empty(FIGURES)
    stack = ctx.stack
    if len(stack.schedulers) < 2:
        raise RuntimeError("failover needs --replicas 2 or more")
    report = await ctx.create_workloads(min(ctx.args.workloads, 20 * ctx.args.nodes))
    await ctx.wait_running(len(report.committed), timeout=ctx.running_timeout(
        len(report.committed)))
    ttl = float(ctx.args.lease_ttl)
    durations: list[float] = []
    for round_ in range(ctx.args.kills):
        leader = await _leader(ctx, timeout=ttl + 30)
        snapshots = await stack.scrape()
        before = {i: (s.total(CYCLES) if s is not None else 0.0)
                  for i, s in enumerate(snapshots) if i != leader}
        killed_at = time.monotonic()
        stack.schedulers[leader].proc.kill()
        stack.schedulers[leader].proc.wait()
        successor = None
        while successor is None:
            if time.monotonic() - killed_at > ttl + 30:
                raise RuntimeError(f"round {round_}: no standby took over")
            healths = await stack.health()
            snapshots = await stack.scrape()
            for i, health in enumerate(healths):
                snap = snapshots[i] if i < len(snapshots) else None
                if i == leader or snap is None or health.get("leader") != "true":
                    continue
                if snap.total(CYCLES) > before.get(i, 0.0):
                    successor = i
            await asyncio.sleep(POLL_S)
        elapsed = time.monotonic() - killed_at
        durations.append(elapsed)
        ctx.log(f"failover: round {round_ + 1}: scheduler-{leader} killed -> "
                f"scheduler-{successor} reconciled after {elapsed:.2f}s (TTL {ttl:g}s)")
        await stack.restart_scheduler(leader)
    stats = await stack.fleet_stats()
    out.figures["kills"] = len(durations)
    out.figures["failover_p50_s"] = round(percentile(durations, 0.5) or 0.0, 3)
    out.figures["failover_p99_s"] = round(percentile(durations, 0.99) or 0.0, 3)
    out.null("stale_leader_writes", "not measured here: a SIGKILLed leader cannot write; "
             "the SIGSTOP case (an old leader living on past its lease) is measured by "
             "tests/test_ha.py, which counts its writes and applies after the successor's "
             "election")
    out.figures["double_applies"] = int(stats.get("double_applies", 0))
    out.notes["failover_p50_s"] = (f"lease TTL {ttl:g}s; the floor is about TTL + 0.5s minus "
                                   "the time since the last keepalive")
    return out


SCENARIO = Scenario(name="failover", summary="kill -9 the leader; time until a standby "
                    "reconciles", figures=FIGURES, run=run, ha="failover",
                    kills_processes=True, min_replicas=2)
