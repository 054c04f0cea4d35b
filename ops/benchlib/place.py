"""Scenario ``place``: W workloads applied by C concurrent clients across the replicas' API.

Figures (docs/benchmark.md): committed placements per second of wall time, client-side apply
latency, the placement function's own p99 (from the scheduler's histogram), etcd transactions per
placement (from the scheduler's counters), nodes over capacity (from what the simulated agents
hold once every committed placement has reached its node) and the rejected count.
"""

from __future__ import annotations

import asyncio

from ops.benchlib.etcdwatch import WriteCounter, describe_categories
from ops.benchlib.procs import CpuMeter
from ops.benchlib.promtext import MetricsSnapshot
from ops.benchlib.quantiles import bucket_quantile, percentile
from ops.benchlib.scenario import (
    PEAK_RSS,
    BenchContext,
    Outcome,
    Scenario,
    scheduler_cpu_ms_per,
)
from ops.devstack.etcdapi import EtcdError, etcd_revision

FIGURES = (
    "placements_per_s",
    "apply_latency_p50_ms",
    "apply_latency_p99_ms",
    "decision_p99_ms",
    "etcd_txns_per_placement",
    "nodes_over_capacity",
    "rejected",
    "etcd_writes_per_placement",
    "scheduler_cpu_ms_per_placement",
    PEAK_RSS,
)
DECISION = "persys_scheduler_placement_decision_seconds"
TXNS = "persys_scheduler_etcd_txns_total"
#: transactions actually sent; with group commit one request carries several of the above
REQUESTS = "persys_scheduler_etcd_txn_requests_total"


async def _revision(ctx: BenchContext) -> int | None:
    if not ctx.stack.etcd_url:
        return None
    try:
        return await asyncio.to_thread(etcd_revision, ctx.stack.etcd_url)
    except (OSError, EtcdError):
        return None


async def run(ctx: BenchContext) -> Outcome:
    out = Outcome.empty(FIGURES)
    stack = ctx.stack
    workloads = ctx.args.workloads
    before = await stack.scrape_merged()
    held_before = int((await stack.fleet_stats()).get("workloads_held", 0))
    rev_before = await _revision(ctx)
    watch = WriteCounter(stack.etcd_url, stack.etcd_root) if stack.etcd_url else None
    if watch is not None:
        await watch.start()
    cpu = CpuMeter(stack.process_pids())
    cpu.start()
    try:
        report = await ctx.create_workloads(workloads, label="place")
    finally:
        cpu.stop()
        if watch is not None:
            await watch.stop()
    after = await stack.scrape_merged()
    rev_after = await _revision(ctx)
    committed = len(report.committed)

    out.figures["placements_per_s"] = round(committed / report.wall_s, 1) if report.wall_s else 0
    p50, p99 = percentile(report.latencies_s, 0.5), percentile(report.latencies_s, 0.99)
    if p50 is None or p99 is None:
        out.null("apply_latency_p50_ms", "no ApplyWorkload call succeeded")
        out.null("apply_latency_p99_ms", "no ApplyWorkload call succeeded")
    else:
        out.figures["apply_latency_p50_ms"] = round(p50 * 1000, 2)
        out.figures["apply_latency_p99_ms"] = round(p99 * 1000, 2)
    out.figures["rejected"] = report.rejected_count
    if report.rejected:
        out.notes["rejected"] = report.describe_rejections()
    out.notes["cpu"] = f"during the applies: {cpu.describe()}"
    scheduler_cpu_ms_per(out, "scheduler_cpu_ms_per_placement", cpu, committed,
                         "committed placements")

    _decision(out, before, after)
    _txns(out, before, after, committed, rev_before, rev_after)
    _writes(out, watch, committed)
    await _capacity(ctx, out, held_before + committed)
    return out


def _decision(out: Outcome, before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> None:
    key = "decision_p99_ms"
    if before is None or after is None:
        out.null(key, "no /metrics to read (pass --metrics HOST:PORT)")
        return
    if not after.exports(f"{DECISION}_bucket"):
        out.null(key, f"the target exports no {DECISION} histogram")
        return
    value, caveat = bucket_quantile(after.minus(before).buckets(DECISION), 0.99)
    if value is None:
        out.null(key, f"{DECISION} recorded nothing during the run")
        return
    out.figures[key] = round(value * 1000, 3)
    out.note(key, "estimated from histogram buckets (linear within the bucket)")
    if caveat:
        out.note(key, caveat)


def _txns(out: Outcome, before: MetricsSnapshot | None, after: MetricsSnapshot | None,
          committed: int, rev_before: int | None, rev_after: int | None) -> None:
    key = "etcd_txns_per_placement"
    revisions = ""
    if rev_before is not None and rev_after is not None:
        revisions = (f"etcd revision advanced by {rev_after - rev_before} "
                     "(every committed write transaction, any writer)")
    if committed == 0:
        out.null(key, "no placement was committed")
        return
    if before is None or after is None or not after.exports(TXNS):
        if rev_before is not None and rev_after is not None:
            out.figures[key] = round((rev_after - rev_before) / committed, 3)
            out.note(key, f"the target exports no {TXNS}: counted from the etcd revision; "
                     + revisions)
        else:
            out.null(key, f"neither {TXNS} nor an etcd endpoint (--etcd) to count from")
        return
    delta = after.minus(before)
    total = delta.total(TXNS)
    kinds = delta.by_label(TXNS, "kind")
    conflicts = delta.total(TXNS, result="conflict")
    parts = [f"{kind} {n / committed:.3f}" for kind, n in sorted(kinds.items(), key=lambda kv:
                                                                   -kv[1]) if n]
    if after.exports(REQUESTS):
        # what etcd was sent: a grouped request (nested sub-transactions) counts once
        requests = delta.total(REQUESTS)
        out.figures[key] = round(requests / committed, 3)
        grouped = delta.total(REQUESTS, shape="group")
        out.note(key, f"transaction requests sent per placement ({grouped:.0f} of "
                 f"{requests:.0f} grouped several changes); the changes they carried, by kind, "
                 f"per placement: " + ", ".join(parts)
                 + f" (total {total / committed:.3f}); conflicts {conflicts:.0f}")
    else:
        out.figures[key] = round(total / committed, 3)
        out.note(key, "all kinds and results during the applies, per placement: "
                 + ", ".join(parts) + f"; conflicts {conflicts:.0f}")
    if revisions:
        out.note(key, revisions)


def _writes(out: Outcome, watch: WriteCounter | None, committed: int) -> None:
    """Keys written per placement as the bench's own etcd watch saw them: counted the same way
    whatever the target, so this (not ``etcd_txns_per_placement``) compares schedulers."""
    key = "etcd_writes_per_placement"
    if watch is None:
        out.null(key, "no etcd endpoint to watch (pass --etcd URL, and --etcd-root if set)")
        return
    if committed == 0:
        out.null(key, "no placement was committed")
        return
    if watch.error:
        out.note(key, watch.error)
    out.figures[key] = round(watch.writes / committed, 3)
    out.note(key, f"{watch.writes} keys written ({watch.puts} puts, {watch.deletes} deletes) "
             f"during the applies, any writer, from the bench's own watch of the key root; "
             f"per placement by category: {describe_categories(watch.by_group, committed)}")


async def _capacity(ctx: BenchContext, out: Outcome, expected_held: int) -> None:
    """Wait until the agents hold every committed placement, then read their over-capacity
    count (a PENDING apply already counts against a node's capacity)."""
    key = "nodes_over_capacity"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30.0 + expected_held / 500.0
    stats = await ctx.stack.fleet_stats()
    while int(stats.get("workloads_held", 0)) < expected_held and loop.time() < deadline:
        await asyncio.sleep(0.5)
        stats = await ctx.stack.fleet_stats()
    held = int(stats.get("workloads_held", 0))
    out.figures[key] = int(stats.get("over_capacity_nodes", 0))
    if held < expected_held:
        out.note(key, f"only {held} of {expected_held} committed placements had reached their "
                 "nodes when counted")
    if out.figures[key]:
        ids = ", ".join(stats.get("over_capacity_node_ids", [])[:5])
        out.note(key, f"over capacity: {ids}")


SCENARIO = Scenario(
    name="place",
    summary="W workloads applied by C concurrent clients; committed placements/s",
    figures=FIGURES,
    run=run,
    ha="shards",
)
