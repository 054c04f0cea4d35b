"""Scenario ``pending``: a full fleet, W pending workloads, capacity freed in bursts.

The fleet is filled to capacity (two 4,000 m workloads per simulated 8,000 m node), then
``--workloads`` more of the same size are applied: each is stored Pending. ``--cycles`` bursts
then delete ``--burst-size`` of the fill workloads at once; each frees one slot, which one
pending workload takes. Figures:

* ``freed_to_placed_p50_ms`` / ``..._p99_ms``: from a slot freed (the deleted workload's
  ``WorkloadDeleted``: its allocation released in the same transaction) to the pending
  workload's ``WorkloadScheduled`` on that node, both as they reach a WatchEvents client of
  the bench (one relay between them, so the difference is the scheduler's);
* ``scheduler_cpu_ms_per_capacity_change``: the schedulers' CPU over the bursts divided by the
  slots freed (the delete, its finalisation and the placement it triggers): flat in the number
  pending when the work per change does not grow with it;
* ``pending_stored``, ``placed_from_pending``, ``nodes_over_capacity``.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator

from ops.benchlib.procs import CpuMeter
from ops.benchlib.quantiles import percentile
from ops.benchlib.scenario import (
    PEAK_RSS,
    BenchContext,
    Outcome,
    Scenario,
    require_event_rpcs,
)
from ops.benchlib.workloads import IMAGE, workload_id
from proto.persys.control.v1 import control_pb2

FIGURES = (
    "freed_to_placed_p50_ms",
    "freed_to_placed_p99_ms",
    "scheduler_cpu_ms_per_capacity_change",
    "pending_stored",
    "placed_from_pending",
    "nodes_over_capacity",
    PEAK_RSS,
)
SLOT_CPU_M = 4000
SLOT_MEM_MB = 1024
SLOTS_PER_NODE = 2
STORED = "stored as Pending"


def _requests(prefix: str, first: int, count: int) -> Iterator[control_pb2.ApplyWorkloadRequest]:
    for i in range(first, first + count):
        yield control_pb2.ApplyWorkloadRequest(
            workload_id=workload_id(prefix, i),
            spec=control_pb2.WorkloadSpec(
                type="container", container=control_pb2.ContainerSpec(image=IMAGE),
                resources=control_pb2.ResourceRequirements(cpu_millicores=SLOT_CPU_M,
                                                           memory_mb=SLOT_MEM_MB)))


async def _events_after(ctx: BenchContext, cursor: str, kind: str) -> list[
        control_pb2.SchedulerEventView]:
    stub = ctx.api.stubs[0]
    out: list[control_pb2.SchedulerEventView] = []
    while True:
        page = (await stub.ListEvents(control_pb2.ListEventsRequest(
            type=kind, after_id=cursor, limit=5000), timeout=60)).events
        out += [e for e in page if e.type == kind]
        if len(page) < 5000:
            return out
        cursor = page[-1].id


async def run(ctx: BenchContext) -> Outcome:
    out = Outcome.empty(FIGURES)
    args = ctx.args
    fill = args.nodes * SLOTS_PER_NODE
    pending = args.workloads
    stub = ctx.api.stubs[0]
    await require_event_rpcs("pending", stub)
    ctx.log(f"fill: {fill} workloads of {SLOT_CPU_M}m on {args.nodes} nodes")
    report = await ctx.api.apply_all(_requests(ctx.prefix, 0, fill), concurrency=args.clients,
                                     total=fill, label="fill")
    if report.rejected_count:
        out.notes["fill"] = report.describe_rejections()
    ctx.log(f"pending: applying {pending} workloads that fit nowhere")
    report = await ctx.api.apply_all(_requests(ctx.prefix, fill, pending),
                                     concurrency=args.clients, total=pending, label="pending")
    stored = sum(n for reason, n in report.rejected.items() if STORED in reason)
    out.figures["pending_stored"] = stored
    if stored < pending:
        out.note("pending_stored", f"not stored: {report.describe_rejections()}")
    newest = (await stub.ListEvents(control_pb2.ListEventsRequest(limit=1), timeout=30)).events
    cursor = newest[-1].id if newest else "0-0"
    pending_ids = {workload_id(ctx.prefix, i) for i in range(fill, fill + pending)}
    bursts, size = args.cycles, args.burst_size
    freed = min(bursts * size, fill, pending)
    seen: list[tuple[float, control_pb2.SchedulerEventView]] = []
    watcher = asyncio.get_running_loop().create_task(_watch(ctx, cursor, seen),
                                                     name="bench-pending-watch")
    cpu = CpuMeter({n: p for n, p in ctx.stack.process_pids().items()
                    if n.startswith("scheduler")})
    cpu.start()
    placed = 0
    for burst in range(bursts):
        first = burst * size
        ids = [workload_id(ctx.prefix, i) for i in range(first, min(first + size, freed))]
        if not ids:
            break
        await asyncio.gather(*(stub.DeleteWorkload(control_pb2.DeleteWorkloadRequest(
            workload_id=w), timeout=60) for w in ids))
        want = placed + len(ids)
        deadline = asyncio.get_running_loop().time() + 60.0
        while placed < want and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
            events = await _events_after(ctx, cursor, "WorkloadScheduled")
            placed = len({e.workload_id for e in events if e.workload_id in pending_ids})
        ctx.log(f"burst {burst + 1}/{bursts}: {len(ids)} freed, {placed} placed so far")
    cpu.stop()
    await asyncio.sleep(1.0)  # the watcher's last events
    watcher.cancel()
    await asyncio.wait([watcher])
    out.figures["placed_from_pending"] = placed
    used = sum(cpu.used.values())
    out.figures["scheduler_cpu_ms_per_capacity_change"] = (
        round(1000 * used / freed, 2) if freed else None)
    out.notes["cpu"] = f"over the bursts: {cpu.describe()}"
    latencies = _freed_to_placed(
        [(at, e) for at, e in seen if e.type == "WorkloadDeleted"],
        [(at, e) for at, e in seen if e.type == "WorkloadScheduled"
         and e.workload_id in pending_ids])
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    if p50 is None or p99 is None:
        out.null("freed_to_placed_p50_ms", "no freed slot was matched to a placement")
        out.null("freed_to_placed_p99_ms", "no freed slot was matched to a placement")
    else:
        out.figures["freed_to_placed_p50_ms"] = round(p50 * 1000, 1)
        out.figures["freed_to_placed_p99_ms"] = round(p99 * 1000, 1)
        out.notes["freed_to_placed_p50_ms"] = (f"{len(latencies)} slots matched to the pending "
                                               "workload placed on their node after them")
    stats = await ctx.stack.fleet_stats()
    out.figures["nodes_over_capacity"] = int(stats.get("over_capacity_nodes", 0))
    return out


async def _watch(ctx: BenchContext, cursor: str,
                 seen: list[tuple[float, control_pb2.SchedulerEventView]]) -> None:
    """Every event after ``cursor`` with the bench's time of arrival: a freed slot and the
    placement it allows reach the bench through the same relay, so the difference of their
    arrivals is the freed-to-placed time (the event stamps are decision times)."""
    clock = asyncio.get_running_loop().time
    call = ctx.api.stubs[0].WatchEvents(control_pb2.WatchEventsRequest(after_id=cursor))
    try:
        async for event in call:
            seen.append((clock(), event))
    finally:
        call.cancel()


def _freed_to_placed(deleted: list[tuple[float, control_pb2.SchedulerEventView]],
                     scheduled: list[tuple[float, control_pb2.SchedulerEventView]]
                     ) -> list[float]:
    """Per node, each freed slot paired with the next pending placement there."""
    frees: dict[str, list[float]] = defaultdict(list)
    for at, e in deleted:
        frees[e.node_id].append(at)
    out: list[float] = []
    for at, e in sorted(scheduled, key=lambda pair: pair[0]):
        slots = frees.get(e.node_id)
        if slots:
            out.append(max(0.0, at - slots.pop(0)))
    return out


SCENARIO = Scenario(
    name="pending",
    summary="a full fleet, W pending workloads, capacity freed in bursts; freed-to-placed",
    figures=FIGURES,
    run=run,
    ha="shards",
)
