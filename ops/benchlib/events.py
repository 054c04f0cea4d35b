"""Scenario ``events``: commit-to-delivery latency of WatchEvents under a steady event rate.

The bench generates events the way an operator would: SetNodeLabel on the simulated nodes at
``--rate`` per second, each carrying a tag (label value ``<run>-<seq>``). Each of ``--watchers``
WatchEvents clients filters on one node; events are generated round-robin over the watched
nodes, so every tagged event has exactly one watcher. With several replicas, watchers and
label calls are spread over them round-robin, as clients behind a load balancer would be.
Latency = the moment a watcher receives the event - the event's commit timestamp
(``SchedulerEventView.timestamp``); only tagged events are counted. ``events_lost`` are tagged
events a watcher never received within the drain window; ``events_duplicated`` are tagged
events received more than once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import grpc

from ops.benchlib.procs import CpuMeter
from ops.benchlib.quantiles import percentile
from ops.benchlib.scenario import (
    PEAK_RSS,
    BenchContext,
    MissingRpcs,
    Outcome,
    Scenario,
    scheduler_cpu_ms_per,
)
from ops.benchlib.stages import describe_stages, describe_storage
from proto.persys.control.v1 import control_pb2

FIGURES = ("events", "watchers", "event_latency_p50_ms", "event_latency_p99_ms",
           "events_lost", "events_duplicated", "scheduler_cpu_ms_per_event", PEAK_RSS)
DURATION_S = 10.0
DRAIN_S = 10.0


async def run(ctx: BenchContext) -> Outcome:
    out = Outcome.empty(FIGURES)
    stubs = ctx.api.stubs
    # this run's nodes only: an existing scheduler (--scheduler) may have nodes of its own
    node_ids = (await ctx.stack.own_nodes(ctx.api))[: ctx.args.watchers]
    if not node_ids:
        raise RuntimeError("events needs registered nodes")
    run_tag = uuid.uuid4().hex[:8]
    received: dict[str, list[float]] = {}
    latencies: list[float] = []
    ready = 0
    watch_calls: list[Any] = []
    all_in = asyncio.Event()
    unimplemented: set[str] = set()

    async def watch(index: int, node_id: str) -> None:
        nonlocal ready
        call = stubs[index % len(stubs)].WatchEvents(control_pb2.WatchEventsRequest(node_id=node_id,
                                                               type="NodeLabelSet"))
        watch_calls.append(call)
        first = True
        try:
            async for event in call:
                if first:
                    first = False
                value = event.details.get("value", "")
                if not value.startswith(run_tag):
                    continue
                now = time.time()
                committed = event.timestamp.seconds + event.timestamp.nanos / 1e9
                latencies.append((now - committed) * 1000.0)
                received.setdefault(value, []).append(now)
                if sent and len(received) >= len(sent):
                    all_in.set()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                unimplemented.add("WatchEvents")
            elif exc.code() != grpc.StatusCode.CANCELLED:
                ctx.log(f"events: watcher {node_id} ended: {exc.code().name} {exc.details()}")

    watchers = [asyncio.create_task(watch(i, n)) for i, n in enumerate(node_ids)]
    await asyncio.sleep(1.0)  # let every watcher subscribe before the first tagged event
    try:  # an untagged label (no watcher counts it): does the target implement SetNodeLabel?
        await stubs[0].SetNodeLabel(control_pb2.SetNodeLabelRequest(
            node_id=node_ids[0], key="bench-probe", value="probe"), timeout=30.0)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            unimplemented.add("SetNodeLabel")
    if unimplemented:
        for call in watch_calls:
            call.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        raise MissingRpcs("events", sorted(unimplemented))
    rate = float(ctx.args.rate)
    total = int(rate * DURATION_S)
    sent: list[str] = []
    ctx.log(f"events: {total} SetNodeLabel at {rate:g}/s over {len(node_ids)} watched nodes")
    scraped_before = await ctx.stack.scrape_merged()
    etcd_before = await ctx.stack.scrape_etcd()
    # which process bounds the rate: the bench itself (senders and watchers on one loop) counts
    cpu = CpuMeter(ctx.stack.process_pids())
    cpu.start()
    began = time.monotonic()
    in_flight: set[asyncio.Task[Any]] = set()

    failed: dict[str, int] = {}
    call_latencies: list[float] = []

    async def label(i: int) -> None:
        value = f"{run_tag}-{i}"
        called = time.perf_counter()
        try:
            resp = await stubs[i % len(stubs)].SetNodeLabel(control_pb2.SetNodeLabelRequest(
                node_id=node_ids[i % len(node_ids)], key="bench-tag", value=value))
        except grpc.aio.AioRpcError as exc:
            failed[exc.code().name] = failed.get(exc.code().name, 0) + 1
            return
        call_latencies.append(time.perf_counter() - called)
        if resp.accepted:
            sent.append(value)

    for i in range(total):
        due = began + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(label(i))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await asyncio.gather(*in_flight, return_exceptions=True)
    achieved = total / max(1e-9, time.monotonic() - began)
    target = len(sent)
    if len(received) < target:
        all_in.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_in.wait(), DRAIN_S)
    cpu.stop()
    scraped_after = await ctx.stack.scrape_merged()
    etcd_after = await ctx.stack.scrape_etcd()
    for call in watch_calls:
        call.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)
    out.figures["events"] = len(sent)
    out.figures["watchers"] = len(node_ids)
    if latencies:
        out.figures["event_latency_p50_ms"] = round(percentile(latencies, 0.50) or 0.0, 2)
        out.figures["event_latency_p99_ms"] = round(percentile(latencies, 0.99) or 0.0, 2)
    else:
        out.null("event_latency_p50_ms", "no tagged event was delivered")
        out.null("event_latency_p99_ms", "no tagged event was delivered")
    out.figures["events_lost"] = len(set(sent) - set(received))
    out.figures["events_duplicated"] = sum(len(v) - 1 for v in received.values() if len(v) > 1)
    out.notes["rate"] = f"asked {rate:g}/s, sent {achieved:.0f}/s (SetNodeLabel answered)"
    out.notes["cpu"] = f"while sending and draining: {cpu.describe()}"
    delivered = sum(len(v) for v in received.values())
    scheduler_cpu_ms_per(out, "scheduler_cpu_ms_per_event", cpu, delivered,
                         "tagged events delivered to watchers")
    out.notes["stages"] = describe_stages(call_latencies, scraped_before, scraped_after)
    storage = describe_storage(etcd_before, etcd_after, str(ctx.stack.workdir))
    if storage is not None:
        out.notes["storage"] = storage
    if failed:
        out.notes["events"] = "SetNodeLabel failed: " + ", ".join(
            f"{count} {code}" for code, count in sorted(failed.items()))
    out.notes["event_latency_p50_ms"] = ("delivery wall time minus the event's timestamp "
                                         "(set when the change was decided, just before commit)")
    return out


SCENARIO = Scenario(name="events", summary=__doc__.splitlines()[0] if __doc__ else "events",
                    figures=FIGURES, run=run, uses_workloads=False)
