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

import grpc

from ops.benchlib.clients import ApiClients, ApplyReport
from ops.benchlib.stack import Stack
from ops.benchlib.workloads import apply_requests

Figure = float | int | None


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

    def note(self, key: str, text: str) -> None:
        """Add to the note of ``key`` (several reasons may apply)."""
        self.notes[key] = f"{self.notes[key]}; {text}" if key in self.notes else text


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
