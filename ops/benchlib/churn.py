"""Scenario ``churn``: 10% of the running workloads vanish from their agents.

Why the fleet runs inside the bench here: killing workloads is an act on the agents, and the
simulator process exposes only read-only ``GET /stats`` (no kill endpoint), so this scenario
uses ``ops.sim.fleet.Fleet`` in process and calls ``SimNode.kill_workloads``, the same simulated
crash the simulator's own tests use. The scheduler still runs in its own process and is
observed only through the agents and its exported metrics.

``recovery_s`` runs from the kill until every killed workload is Running again on some agent;
``agent_rpcs_during_recovery`` is what the agents counted over the same span.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from typing import Any

from ops.benchlib.scenario import PEAK_RSS, BenchContext, Outcome, Scenario

FIGURES = ("killed", "recovery_s", "agent_rpcs_during_recovery", PEAK_RSS)
CYCLES = "persys_scheduler_reconcile_cycles_total"
KILL_FRACTION = 0.10
POLL_S = 0.2
GUARD_MARGIN_S = 1.0
#: A full scan over every agent (workloads may be re-placed elsewhere) every this many polls.
FULL_SCAN_EVERY = 10


def recovery_timeout(ctx: BenchContext) -> float:
    """``--recovery-timeout``, or a few reconcile intervals plus a heartbeat interval."""
    if ctx.args.recovery_timeout is not None:
        return float(ctx.args.recovery_timeout)
    return max(20.0, 3 * float(ctx.args.reconcile_interval) + float(ctx.args.heartbeat_interval))


def _rpc_total(fleet: Any) -> Counter[str]:
    return Counter(fleet.counters.rpcs)


def _running_anywhere(fleet: Any, remaining: set[str]) -> set[str]:
    """Which of ``remaining`` run on any agent: one pass over what the agents hold. (Asking
    every node about every remaining workload was 50 million lookups per scan at 5,000 nodes
    and 10,000 kills: seconds of the loop the in-process agents answer on, which made their
    ListWorkloads miss the scheduler's deadline.)"""
    found: set[str] = set()
    for node in fleet.nodes:
        found.update(wid for wid in node.running_ids() if wid in remaining)
    return found


async def _outwait_guard(ctx: BenchContext, out: Outcome, last_apply: float) -> None:
    """Kill only once the scheduler's re-apply guard no longer covers the last apply: a
    workload that vanishes right after its apply may be an apply still settling, which the
    scheduler rightly does not re-send; a crash in steady state is what churn measures."""
    guard = float(ctx.args.reapply_guard)
    wait = last_apply + guard + GUARD_MARGIN_S - time.monotonic()
    if wait > 0:
        ctx.log(f"churn: waiting {wait:.0f}s for the re-apply guard ({guard:g}s) to elapse")
        await asyncio.sleep(wait)
    out.note("recovery_s", f"killed at least {guard:g}s (the re-apply guard, "
             "SCHEDULER_REAPPLY_GUARD) after the last apply")


async def run(ctx: BenchContext) -> Outcome:
    out = Outcome.empty(FIGURES)
    fleet = ctx.stack.fleet
    if fleet is None:
        raise RuntimeError("churn needs the fleet in the bench process")
    report = await ctx.create_workloads(ctx.args.workloads)
    created = len(report.committed)
    if report.rejected:
        out.notes["create"] = (f"{report.rejected_count} of {ctx.args.workloads} rejected: "
                               + report.describe_rejections())
    missing = await ctx.wait_running(created, timeout=ctx.running_timeout(created))
    if missing:
        out.notes["steady"] = "not steady before the kill: " + missing
    await _outwait_guard(ctx, out, report.ended_at)

    rng = random.Random(ctx.args.seed)
    mine = set(report.committed)
    held = [(node, wid) for node in fleet.nodes for wid in node.workload_ids()
            if wid in mine and node.workload_state(wid) == "Running"]
    victims = rng.sample(held, max(1, round(KILL_FRACTION * len(held)))) if held else []
    by_node: defaultdict[Any, list[str]] = defaultdict(list)
    for node, wid in victims:
        by_node[node].append(wid)
    before = await ctx.stack.scrape_merged()
    rpcs0 = _rpc_total(fleet)
    loop = asyncio.get_running_loop()
    began = loop.time()
    killed = sum(node.kill_workloads(wids) for node, wids in by_node.items())
    out.figures["killed"] = killed
    ctx.log(f"churn: killed {killed} of {len(held)} running workloads; waiting for recovery")

    home = {wid: node for node, wid in victims}
    remaining = set(home)
    timeout = recovery_timeout(ctx)
    polls = 0
    while remaining and loop.time() - began < timeout:
        await asyncio.sleep(POLL_S)
        polls += 1
        if polls % FULL_SCAN_EVERY == 0:
            remaining -= _running_anywhere(fleet, remaining)
        else:
            remaining -= {w for w in remaining if home[w].workload_state(w) == "Running"}
    elapsed = loop.time() - began
    rpcs = _rpc_total(fleet) - rpcs0
    after = await ctx.stack.scrape_merged()
    out.figures["agent_rpcs_during_recovery"] = sum(rpcs.values())
    methods = ", ".join(f"{m} {n}" for m, n in rpcs.most_common()) or "none"
    if not victims:
        out.null("recovery_s", "no running workload to kill")
    elif remaining:
        cycles = ""
        if before is not None and after is not None and after.exports(CYCLES):
            cycles = (f"; {CYCLES} advanced by "
                      f"{after.total(CYCLES) - before.total(CYCLES):.0f} meanwhile")
        out.censor("recovery_s", round(elapsed, 2), "s",
                   f"{len(victims) - len(remaining)} of {len(victims)} killed workloads ran "
                   f"again within the {timeout:g}s waited (--recovery-timeout){cycles}")
        out.note("agent_rpcs_during_recovery", f"counted over the {elapsed:.1f}s waited")
    else:
        out.figures["recovery_s"] = round(elapsed, 2)
        out.note("recovery_s", f"polled every {POLL_S}s on the original node (a full scan of all "
                 f"nodes every {POLL_S * FULL_SCAN_EVERY:g}s for re-placed ones)")
    out.note("agent_rpcs_during_recovery", f"as counted by the agents: {methods}")
    return out


SCENARIO = Scenario(
    name="churn",
    summary="10% of workloads killed on the agents: time until all run again",
    figures=FIGURES,
    run=run,
    ha="shards",
    fleet_in_process=True,
)
