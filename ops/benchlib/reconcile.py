"""Scenario ``reconcile``: the steady state of N nodes x W workloads.

The workloads are created through the API (``--clients`` in flight) and the scenario waits
until the agents run them and the scheduler counts them Running. Then, with no API call, it
watches ``--cycles`` reconcile cycles per replica:

* cycle times are exact, not bucket estimates: ``/metrics`` is scraped every second, and when a
  replica's ``reconcile_cycles_total`` moved by one, the cycle took the delta of
  ``reconcile_cycle_seconds_sum`` (a scrape costs the scheduler a few ms of CPU: every 0.2 s
  it was 2-5% of the samples of a profile of the window it measures);
* per-cycle agent RPCs and etcd writes are the scheduler's counter deltas from the scrape that
  saw the first observed cycle end to the scrape that saw the last one end (cycle boundaries,
  give or take what the next cycle did before the scrape: at most a second of it at each end,
  spread over ``--cycles`` cycles);
* etcd writes per second come from the bench's own watch over the whole quiet window (any
  writer: heartbeat-driven status and node updates, and the cycles' writes if any);
* RSS is read from /proc once the state is loaded.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ops.benchlib.etcdwatch import (
    WriteCounter,
    count_prefix,
    describe_categories,
    write_category,
)
from ops.benchlib.procs import CpuMeter, rss_mib
from ops.benchlib.promtext import MetricsSnapshot
from ops.benchlib.quantiles import percentile
from ops.benchlib.scenario import PEAK_RSS, BenchContext, Outcome, Scenario

FIGURES = (
    "cycle_time_p50_ms",
    "cycle_time_p99_ms",
    "agent_rpcs_per_cycle",
    "etcd_writes_per_cycle",
    "heartbeat_etcd_writes_per_s",
    "scheduler_rss_mib",
    PEAK_RSS,
)


@dataclass(frozen=True)
class Names:
    """The metric names one exporter uses for the reconcile figures."""

    exporter: str
    cycles: str
    #: the cycle-duration histogram (``_sum`` and ``_count`` are read)
    cycle_seconds: str
    rpcs: str
    rpc_label: str
    writes: str

    @property
    def cycle_sum(self) -> str:
        return f"{self.cycle_seconds}_sum"

    @property
    def cycle_count(self) -> str:
        return f"{self.cycle_seconds}_count"


#: This implementation's names; it also exports GO_NAMES.
OURS = Names("this implementation", "persys_scheduler_reconcile_cycles_total",
             "persys_scheduler_reconcile_cycle_seconds", "persys_scheduler_agent_rpcs_total",
             "method", "persys_scheduler_etcd_writes_total")
#: The Go persys-scheduler's names (docs/compatibility.md, "Metrics").
GO_NAMES = Names("the Go scheduler", "persys_scheduler_reconciliation_cycles_total",
                 "persys_scheduler_reconciliation_cycle_duration_seconds",
                 "persys_scheduler_agent_rpc_requests_total", "rpc",
                 "persys_scheduler_state_store_writes_total")
PHASES = "persys_scheduler_reconcile_phase_seconds_total"
HEARTBEATS = "persys_scheduler_heartbeats_total"
SCRAPE_EVERY_S = 1.0
#: How long the bench waits for a cycle to end before it has seen any (a slow target's first
#: cycle after its start took over 34 s); a cycle still running then is reported censored.
FIRST_CYCLE_WAIT_S = 90.0
#: How long (plus 5 ms per created workload) the relay may take to drain the outbox.
OUTBOX_SETTLE_S = 60.0
CYCLE_KEYS = ("cycle_time_p50_ms", "cycle_time_p99_ms", "agent_rpcs_per_cycle",
              "etcd_writes_per_cycle")


@dataclass
class _Replica:
    """One replica's cycles as the scrapes saw them."""

    last: MetricsSnapshot | None
    #: Snapshot at the end of the first cycle seen (the boundary); None until then.
    base: MetricsSnapshot | None = None
    end: MetricsSnapshot | None = None
    cycles: int = 0
    durations_s: list[float] = field(default_factory=list)
    #: Scrapes in which more than one cycle completed (their durations are averages).
    merged: int = 0
    names: Names = OURS

    def feed(self, snap: MetricsSnapshot | None, wanted: int) -> bool:
        """Take a new scrape; return True when a cycle ended in it."""
        if snap is None:  # a failed scrape: the next good one covers the gap
            return False
        prev, self.last = self.last, snap
        if prev is None or self.end is not None:
            return False
        n_ = self.names
        done = snap.total(n_.cycles) - prev.total(n_.cycles)
        if done <= 0:
            return False
        if self.base is None:
            self.base = snap
            return True
        n = int(done)
        spent = snap.total(n_.cycle_sum) - prev.total(n_.cycle_sum)
        observed = snap.total(n_.cycle_count) - prev.total(n_.cycle_count)
        if observed >= 1:
            self.durations_s.extend([spent / observed] * n)
            if observed > 1:
                self.merged += 1
        self.cycles += n
        if self.cycles >= wanted:
            self.end = snap
        return True


async def run(ctx: BenchContext) -> Outcome:
    out = Outcome.empty(FIGURES)
    report = await ctx.create_workloads(ctx.args.workloads)
    created = len(report.committed)
    if report.rejected:
        out.notes["create"] = (f"{report.rejected_count} of {ctx.args.workloads} rejected: "
                               + report.describe_rejections())
    missing = await ctx.wait_running(created, timeout=ctx.running_timeout(created))
    if missing:
        out.notes["steady"] = "not steady before the window: " + missing
    await _settle_outbox(ctx, out, created)
    ctx.log(f"steady state: {created} workloads; observing {ctx.args.cycles} reconcile cycles")

    _rss(ctx, out)
    await _observe(ctx, out)
    return out


async def _settle_outbox(ctx: BenchContext, out: Outcome, created: int) -> None:
    """Let the event relay drain the outbox the creation burst filled (this implementation
    commits events as ``<root>/persys/scheduler/outbox/`` keys; a target without them has
    none), so that the quiet window measures the steady state and not a relay catching up."""
    url = ctx.stack.etcd_url
    if not url:
        return
    prefix = f"{ctx.stack.etcd_root}/persys/scheduler/outbox/"
    loop = asyncio.get_running_loop()
    began = loop.time()
    deadline = began + OUTBOX_SETTLE_S + created / 200.0
    try:
        first = left = await asyncio.to_thread(count_prefix, url, prefix)
        while left and loop.time() < deadline:
            await asyncio.sleep(1.0)
            left = await asyncio.to_thread(count_prefix, url, prefix)
    except (OSError, ValueError) as exc:
        out.notes["relay"] = f"could not count the outbox: {exc!r}"
        return
    if not first:
        return
    took = loop.time() - began
    if left:
        out.notes["relay"] = (f"the outbox still held {left} events {took:.0f}s after steady "
                              f"state (from {first}): the relay lags; its writes are in the "
                              "window")
    else:
        out.notes["relay"] = f"the relay drained {first} outbox events in {took:.1f}s first"


def _rss(ctx: BenchContext, out: Outcome) -> None:
    key = "scheduler_rss_mib"
    pids = ctx.stack.scheduler_pids
    if not pids:
        out.null(key, "the bench did not start the scheduler; pass --scheduler-pid to measure it")
        return
    sizes = {name: rss_mib(pid) for name, pid in pids.items()}
    known = {n: s for n, s in sizes.items() if s is not None}
    if not known:
        out.null(key, "could not read VmRSS from /proc")
        return
    out.figures[key] = round(max(known.values()), 1)
    if len(known) > 1:
        out.note(key, "the largest replica; " + ", ".join(f"{n} {s:.0f} MiB"
                                                          for n, s in known.items()))


@dataclass
class _AgentSpan:
    """The agents' own RPC count between the moment every replica passed its first cycle
    boundary and the moment every replica finished; cycles per shard over the same span."""

    base: Counter[str] | None = None
    end: Counter[str] | None = None
    cycles_base: float = 0.0
    cycles_end: float = 0.0

    @staticmethod
    def _rpcs(stats: dict[str, Any]) -> Counter[str]:
        return Counter({k: int(v) for k, v in (stats.get("rpcs") or {}).items()})

    async def mark(self, ctx: BenchContext, replicas: list[_Replica]) -> None:
        cycles = sum(r.last.total(r.names.cycles) for r in replicas if r.last is not None)
        if self.base is None and all(r.base is not None for r in replicas):
            self.base = self._rpcs(await ctx.stack.fleet_stats())
            self.cycles_base = cycles / len(replicas)
        elif self.end is None and all(r.end is not None for r in replicas):
            self.end = self._rpcs(await ctx.stack.fleet_stats())
            self.cycles_end = cycles / len(replicas)

    def describe(self) -> str:
        if self.base is None or self.end is None or self.cycles_end <= self.cycles_base:
            return ""
        per_cycle = self.end - self.base
        cycles = self.cycles_end - self.cycles_base
        total = sum(per_cycle.values()) / cycles
        methods = ", ".join(f"{m} {n / cycles:g}" for m, n in per_cycle.most_common())
        return (f"the agents themselves counted {total:g} per cycle over the same "
                f"{cycles:g} cycle(s) per shard ({methods or 'none'})")


async def _observe(ctx: BenchContext, out: Outcome) -> None:
    stack = ctx.stack
    interval = float(ctx.args.reconcile_interval)
    wanted = ctx.args.cycles
    loop = asyncio.get_running_loop()
    first = await stack.scrape()
    names, used = resolve_names(first)
    if any(s is not None for s in first):
        out.notes["metrics"] = used
    replicas = [_Replica(last=s, names=names) for s in first]
    exported = any(s is not None and s.exports(names.cycles) for s in first)
    stats0 = await stack.fleet_stats()
    agents = _AgentSpan()
    watch = WriteCounter(stack.etcd_url, stack.etcd_root) if stack.etcd_url else None
    if watch is not None:
        await watch.start()
    cpu = CpuMeter(stack.process_pids())
    cpu.start()
    t0 = loop.time()
    # the first cycle end may take long (a slow target's first cycle); after it, a cycle must
    # end within two intervals plus a slow cycle's worth of time
    patience = max(2 * interval + 10.0, FIRST_CYCLE_WAIT_S)
    last_progress = t0
    try:
        while exported and any(r.end is None for r in replicas):
            if loop.time() - last_progress > patience:
                break
            await asyncio.sleep(SCRAPE_EVERY_S)
            snaps = await stack.scrape()
            ended = False
            for replica, snap in zip(replicas, snaps, strict=True):
                if replica.feed(snap, wanted):
                    ended = True
                    last_progress = loop.time()
                    # once cycles run, allow for cycles longer than the interval
                    patience = 2 * interval + 10.0 + 4 * max(
                        max(r.durations_s or [0]) for r in replicas)
            if ended:
                await agents.mark(ctx, replicas)
        if watch is not None:
            if not exported or all(r.base is None for r in replicas):
                # no cycle to wait for: still give the write-rate window a fair length
                remaining = t0 + patience - loop.time()
                if remaining > 0:
                    await asyncio.sleep(remaining)
            # every node should heartbeat at least once in the write-rate window
            remaining = t0 + float(ctx.args.heartbeat_interval) - loop.time()
            if remaining > 0:
                await asyncio.sleep(remaining)
    finally:
        cpu.stop()
        if watch is not None:
            await watch.stop()
    window_s = loop.time() - t0
    stats1 = await stack.fleet_stats()
    out.notes["cpu"] = f"during the window: {cpu.describe()}"
    _cycle_figures(out, replicas, exported, interval, window_s, agents, names,
                   since_boundary=loop.time() - last_progress)
    _write_rate(out, watch, window_s, stats0, stats1)


def _cycle_figures(out: Outcome, replicas: list[_Replica], exported: bool, interval: float,
                   window_s: float, agents: _AgentSpan, names: Names = OURS, *,
                   since_boundary: float = 0.0) -> None:
    if not any(r.last is not None for r in replicas):
        for key in CYCLE_KEYS:
            out.null(key, "no /metrics to read (pass --metrics HOST:PORT)")
        return
    if not exported:
        for key in CYCLE_KEYS:
            out.null(key, f"the target exports neither {OURS.cycles} nor {GO_NAMES.cycles}")
        return
    done = [r for r in replicas if r.base is not None and r.cycles > 0]
    if not done:
        started = sum(1 for r in replicas if r.base is not None)
        if not started:
            why = (f"{names.cycles} did not advance in {window_s:.0f}s (reconcile interval "
                   f"{interval:g}s): a cycle running longer than that, or no reconcile loop")
        else:
            why = (f"after the first cycle end no cycle ended within {since_boundary:.0f}s "
                   f"(reconcile interval {interval:g}s)")
        bound = since_boundary if started else window_s
        for key in ("cycle_time_p50_ms", "cycle_time_p99_ms"):
            out.censor(key, round(bound * 1000, 1), "ms", why)
        for key in ("agent_rpcs_per_cycle", "etcd_writes_per_cycle"):
            out.null(key, "no whole cycle observed: " + why)
        return
    durations = [d for r in done for d in r.durations_s]
    p50, p99 = percentile(durations, 0.5), percentile(durations, 0.99)
    if p50 is not None and p99 is not None:
        out.figures["cycle_time_p50_ms"] = round(p50 * 1000, 1)
        out.figures["cycle_time_p99_ms"] = round(p99 * 1000, 1)
        merged = sum(r.merged for r in done)
        out.note("cycle_time_p99_ms", f"{len(durations)} cycles over {len(done)} replica(s), "
                 "each timed exactly from the histogram's sum and count"
                 + (f"; {merged} scrape(s) held several cycles (averaged)" if merged else ""))
    out.note("cycle_time_p99_ms", "each cycle in order, in ms: " + "; ".join(
        f"replica {i}: " + " ".join(f"{d * 1000:.0f}" for d in r.durations_s)
        for i, r in enumerate(replicas) if r.durations_s))
    short = [i for i, r in enumerate(replicas) if r.end is None]
    if short:
        out.note("cycle_time_p99_ms", f"replica(s) {short} ran fewer cycles than asked")
    rpcs = 0.0
    writes = 0.0
    phases: dict[str, float] = {}
    by_method: Counter[str] = Counter()
    by_category: Counter[str] = Counter()
    for r in done:
        assert r.base is not None
        end = r.end or r.last
        assert end is not None
        delta = end.minus(r.base)
        rpcs += delta.total(names.rpcs) / r.cycles
        writes += delta.total(names.writes) / r.cycles
        for method, n in delta.by_label(names.rpcs, names.rpc_label).items():
            by_method[method] += round(n / r.cycles)
        for category, n in delta.by_label(names.writes, "category").items():
            by_category[category] += round(n / r.cycles)
        for phase, seconds in delta.by_label(PHASES, "phase").items():
            phases[phase] = phases.get(phase, 0.0) + seconds / r.cycles / len(done)
    if phases:
        out.note("cycle_time_p50_ms", "mean wall time per cycle by phase: " + ", ".join(
            f"{phase} {seconds * 1000:,.0f} ms"
            for phase, seconds in sorted(phases.items(), key=lambda kv: -kv[1])))
    if any(r.last is not None and r.last.exports(names.rpcs) for r in done):
        out.figures["agent_rpcs_per_cycle"] = round(rpcs, 1)
        out.note("agent_rpcs_per_cycle", "by method: " + _fmt(by_method))
    else:
        out.null("agent_rpcs_per_cycle",
                 f"the target exports neither {OURS.rpcs} nor {GO_NAMES.rpcs}")
    witness = agents.describe()
    if witness:
        out.note("agent_rpcs_per_cycle", witness)
    if any(r.last is not None and r.last.exports(names.writes) for r in done):
        out.figures["etcd_writes_per_cycle"] = round(writes, 2)
        if by_category:
            out.note("etcd_writes_per_cycle", "by category (heartbeats' included): "
                     + _fmt(by_category))
    else:
        out.null("etcd_writes_per_cycle",
                 f"the target exports neither {OURS.writes} nor {GO_NAMES.writes}")


def _fmt(counts: Counter[str] | dict[str, float]) -> str:
    items = sorted(((k, v) for k, v in counts.items() if v), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v:g}" for k, v in items) or "none"


def _write_rate(out: Outcome, watch: WriteCounter | None, window_s: float,
                stats0: dict[str, Any], stats1: dict[str, Any]) -> None:
    key = "heartbeat_etcd_writes_per_s"
    if watch is None:
        out.null(key, "no etcd endpoint to watch (pass --etcd URL)")
        return
    if watch.error:
        out.note(key, watch.error)
    nodes = sum(n for g, n in watch.by_group.items() if write_category(g) == "node")
    out.figures[key] = round(nodes / window_s, 3) if window_s > 0 else None
    if window_s > 0:
        out.note(key, "writes to node keys (the node category) per second; every category "
                 "per second: " + describe_categories(watch.by_group, window_s, "/s"))
    beats = int((stats1.get("control") or {}).get("heartbeats_ok", 0)) - int(
        (stats0.get("control") or {}).get("heartbeats_ok", 0))
    groups = _fmt(dict(watch.by_group))
    out.note(key, f"{watch.writes} writes ({watch.puts} puts, {watch.deletes} deletes: "
             f"{groups}) in a {window_s:.1f}s window without API "
             f"calls (store revision {watch.start_revision - 1} -> {watch.end_revision}); "
             f"{beats} heartbeats answered in it"
             + (f" ({watch.writes / beats:.3f} writes per heartbeat)" if beats else "")
             + "; the cycles' own writes, if any, are included")
    if watch.event_types:
        out.note(key, "event records among them: " + _fmt(dict(watch.event_types)))


SCENARIO = Scenario(
    name="reconcile",
    summary="steady state of N nodes x W workloads: reconcile cycle time, RPCs and writes",
    figures=FIGURES,
    run=run,
    ha="shards",
)


def resolve_names(snaps: list[MetricsSnapshot | None]) -> tuple[Names, str]:
    """Per family, the first of OURS and GO_NAMES any replica exports (a family neither
    exports keeps OURS, so its figure says it is missing); and a note saying which."""
    live = [x for x in snaps if x is not None]

    def pick(attr: str, probe: str) -> Names:
        for names in (OURS, GO_NAMES):
            name = getattr(names, attr)
            if any(x.exports(name + probe) for x in live):
                return names
        return OURS

    cycles = pick("cycles", "")
    hist = pick("cycle_seconds", "_count")
    rpcs = pick("rpcs", "")
    writes = pick("writes", "")
    chosen = Names(cycles.exporter if cycles is hist else "mixed", cycles.cycles,
                   hist.cycle_seconds, rpcs.rpcs, rpcs.rpc_label, writes.writes)
    used = [n for n in (chosen.cycles, chosen.cycle_seconds, chosen.rpcs, chosen.writes)
            if any(x.exports(n) or x.exports(n + "_count") for x in live)]
    fallback = [n for n in used if n not in (OURS.cycles, OURS.cycle_seconds, OURS.rpcs,
                                             OURS.writes)]
    note = ("read " + ", ".join(used) if used else "none of the reconcile metrics is exported")
    if fallback:
        note += (" (the Go scheduler's names: this implementation's "
                 + ", ".join(sorted({OURS.cycles, OURS.cycle_seconds, OURS.rpcs, OURS.writes}
                                    - set(used))) + " not exported)")
    return chosen, note
