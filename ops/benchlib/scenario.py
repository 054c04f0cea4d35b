"""The scenario contract, and the context every scenario runs in.

Why a contract: docs/benchmark.md fixes each scenario's figure keys; a scenario declares them,
returns a value (or None with a reason) for each, and the runner checks the set, so a later scenario
(``failover``, ``events``) is one module plus one line in ``ops.benchlib.registry``.

The context also holds the steps several scenarios share: creating workloads through the API
and waiting until the fleet and the scheduler both say they run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from ops.benchlib.clients import ApiClients, ApplyReport
from ops.benchlib.procs import CpuMeter, peak_rss_mib
from ops.benchlib.stack import Stack
from ops.benchlib.workloads import apply_requests
from proto.persys.control.v1 import control_pb2

Figure = float | int | None

#: The figure every scenario reports (filled in by the runner, ``ops.bench``).
PEAK_RSS = "scheduler_peak_rss_mib"
#: How the bench names scheduler processes in ``Stack.scheduler_pids`` and ``CpuMeter``.
SCHEDULER_PREFIX = "scheduler-"
NO_PID = ("the bench does not know the scheduler's process id (it did not start it): pass "
          "--scheduler-pid PID")


@dataclass
class Outcome:
    """A scenario's figures (every declared key) and notes (figure or topic -> why/what)."""

    figures: dict[str, Figure]
    notes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def empty(cls, keys: tuple[str, ...]) -> Outcome:
        return cls(figures=dict.fromkeys(keys))

    def null(self, key: str, why: str) -> None:
        """Record that ``key`` cannot be provided, and why."""
        self.figures[key] = None
        self.notes[key] = why

    def censor(self, key: str, bound: float, unit: str, why: str) -> None:
        """``key`` was still running when the bench stopped waiting: its value is the lower
        bound ``bound``, its note starts with "censored: more than", and ``notes["censored"]``
        lists every censored figure (a reader must not take the bound for a measurement)."""
        self.figures[key] = bound
        self.notes[key] = f"censored: more than {bound:g} {unit} ({why})" + (
            f"; {self.notes[key]}" if key in self.notes else "")
        listed = [k for k in self.notes.get("censored", "").split(", ") if k]
        self.notes["censored"] = ", ".join([*listed, key]) if key not in listed else \
            ", ".join(listed)

    def note(self, key: str, text: str) -> None:
        """Add to the note of ``key`` (several reasons may apply)."""
        self.notes[key] = f"{self.notes[key]}; {text}" if key in self.notes else text


class MissingRpcs(RuntimeError):
    """The target answered UNIMPLEMENTED for RPCs the scenario needs: it cannot be measured
    (the runner exits non-zero naming them, never with figures that only look measured)."""

    def __init__(self, scenario: str, rpcs: list[str]) -> None:
        self.scenario = scenario
        self.rpcs = sorted(set(rpcs))
        super().__init__(f"{scenario} needs {', '.join(self.rpcs)}, which the target does not "
                         "implement (answered UNIMPLEMENTED)")


async def require_event_rpcs(scenario: str, stub: Any) -> None:
    """Raise MissingRpcs when the target answers ListEvents or WatchEvents UNIMPLEMENTED
    (read-only probes: the newest event, and a watch held open for a second)."""
    missing: list[str] = []
    try:
        await stub.ListEvents(control_pb2.ListEventsRequest(limit=1), timeout=30)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            missing.append("ListEvents")
    call = stub.WatchEvents(control_pb2.WatchEventsRequest(node_id="bench-probe"))
    try:
        async with asyncio.timeout(1.0):
            await call.read()
    except TimeoutError:
        pass  # open and quiet: implemented
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            missing.append("WatchEvents")
    finally:
        call.cancel()
    if missing:
        raise MissingRpcs(scenario, missing)


@dataclass(frozen=True)
class Scenario:
    """One named scenario of docs/benchmark.md."""

    name: str
    summary: str
    figures: tuple[str, ...]
    run: Callable[[BenchContext], Awaitable[Outcome]]
    #: "shards": replicas are active-active shards; "failover": replicas of one shard.
    ha: str = "shards"
    #: The fleet must live in the bench process (the scenario acts on agents directly).
    fleet_in_process: bool = False
    #: Kills scheduler processes: refused against a scheduler the bench did not start.
    kills_processes: bool = False
    #: Applies ``--workloads`` workloads (the report's "workloads" is 0 otherwise).
    uses_workloads: bool = True
    #: The fewest scheduler processes it can measure anything with; also its default.
    min_replicas: int = 1


@dataclass
class BenchContext:
    """What a scenario gets: the parsed options, the running stack and API clients."""

    args: argparse.Namespace
    stack: Stack
    api: ApiClients
    #: Prefix of every workload id this run creates.
    prefix: str
    #: Peak RSS of the schedulers (``scheduler_peak_rss_mib``), sampled before kills.
    peak_rss: PeakRss = field(default_factory=lambda: PeakRss())

    def log(self, message: str) -> None:
        """Progress for the operator, on stderr (stdout ends with the JSON line)."""
        print(f"bench: {message}", file=sys.stderr, flush=True)

    async def create_workloads(self, count: int, label: str = "create") -> ApplyReport:
        """Apply ``count`` workloads with ``--clients`` callers in flight."""
        self.log(f"{label}: applying {count} workloads with {self.args.clients} clients")
        report = await self.api.apply_all(
            apply_requests(self.prefix, count, seed=self.args.seed),
            concurrency=self.args.clients, total=count, label=label)
        self.log(f"{label}: {len(report.committed)} committed, {report.rejected_count} rejected "
                 f"in {report.wall_s:.1f}s")
        return report

    async def wait_running(self, expected: int, *, timeout: float) -> str:
        """Wait until the fleet runs ``expected`` workloads (its own states) and every replica's
        GetClusterSummary counts as many Running; return '' or what was still missing."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        sim_running = sched_running = 0
        while True:
            stats = await self.stack.fleet_stats()
            sim_running = int(stats.get("workloads_by_state", {}).get("Running", 0))
            if sim_running >= expected:
                try:
                    summaries = [await self.api.summary(i) for i in range(len(self.api.stubs))]
                except grpc.aio.AioRpcError as exc:  # a busy scheduler: ask again
                    self.log(f"GetClusterSummary failed ({exc.code().name}); retrying")
                else:
                    sched_running = min(s.running_workloads for s in summaries)
                    if sched_running >= expected:
                        return ""
            if loop.time() > deadline:
                return (f"after {timeout:.0f}s the fleet ran {sim_running} and the scheduler "
                        f"counted {sched_running} Running of {expected}")
            await asyncio.sleep(1.0 if expected > 10_000 else 0.25)

    def running_timeout(self, count: int) -> float:
        """How long workloads may take to be seen Running: a couple of heartbeats plus the
        apply dispatch at a rate this machine manages."""
        return 30.0 + 3.0 * float(self.args.heartbeat_interval) + count / 200.0


def scheduler_cpu_ms_per(out: Outcome, key: str, cpu: CpuMeter, units: int, what: str) -> None:
    """``key`` = scheduler CPU milliseconds (every scheduler process, summed) measured by
    ``cpu`` per one of ``units`` (``what`` names them), or null with the reason."""
    used, missing = cpu.total(SCHEDULER_PREFIX)
    if not any(name.startswith(SCHEDULER_PREFIX) for name in cpu.names):
        out.null(key, NO_PID)
        return
    if missing:
        out.null(key, "the CPU time of " + ", ".join(missing) + " could not be read from /proc "
                 "at both ends of the measurement (exited, or another user's process)")
        return
    if units <= 0:
        out.null(key, f"no {what} to divide by")
        return
    out.figures[key] = round(1000.0 * used / units, 3)
    out.note(key, f"{used:.2f}s of scheduler CPU (user+system, all threads, every scheduler "
             f"process) over {cpu.wall_s:.1f}s wall / {units} {what}; it includes whatever "
             "else the scheduler did meanwhile (heartbeats, reconcile cycles)")


class PeakRss:
    """The largest ``VmHWM`` (peak RSS since start) of the scheduler processes, remembered
    across restarts: ``sample()`` before a process is killed, ``fill()`` at the end."""

    def __init__(self) -> None:
        self.peak: dict[str, float] = {}

    def sample(self, pids: dict[str, int]) -> None:
        for name, pid in pids.items():
            if name.startswith(SCHEDULER_PREFIX):
                value = peak_rss_mib(pid)
                if value is not None:
                    self.peak[f"{name} (pid {pid})"] = value

    def fill(self, out: Outcome, pids: dict[str, int]) -> None:
        self.sample(pids)
        schedulers = [n for n in pids if n.startswith(SCHEDULER_PREFIX)]
        if not schedulers and not self.peak:
            out.null(PEAK_RSS, NO_PID)
            return
        if not self.peak:
            out.null(PEAK_RSS, "VmHWM of " + ", ".join(schedulers) + " could not be read "
                     "from /proc/PID/status (exited, or another user's process)")
            return
        name, value = max(self.peak.items(), key=lambda kv: kv[1])
        out.figures[PEAK_RSS] = round(value, 1)
        out.note(PEAK_RSS, f"the largest VmHWM (peak resident memory since the process "
                 f"started) of {len(self.peak)} scheduler process(es): {name}; for a "
                 "scheduler the bench did not start, its peak may predate the run")
