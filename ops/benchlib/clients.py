"""The bench's API clients: concurrent ApplyWorkload callers and a few read calls.

Why a fixed pool of workers over one lazy iterator: bounded in-flight calls (``concurrency``)
whatever the number of workloads, no task per request, and the request messages are built as
they are sent. Worker ``i`` talks to replica ``i mod R``, which spreads the API load evenly over
active-active shards.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from proto.persys.control.v1 import control_pb2, control_pb2_grpc

_DIGITS = re.compile(r"\d+")


@dataclass
class ApplyReport:
    """What a batch of ApplyWorkload calls did, as the client saw it."""

    attempted: int = 0
    #: Workload ids answered ``success`` (committed).
    committed: list[str] = field(default_factory=list)
    #: Seconds per successful call.
    latencies_s: list[float] = field(default_factory=list)
    #: Reason -> count for every call not answered ``success`` (in-band or RPC error).
    rejected: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    #: ``time.monotonic()`` when the last call was answered.
    ended_at: float = 0.0

    @property
    def rejected_count(self) -> int:
        return sum(self.rejected.values())

    def describe_rejections(self, limit: int = 5) -> str:
        """The most frequent reasons, for a note."""
        if not self.rejected:
            return "none"
        top = self.rejected.most_common(limit)
        text = "; ".join(f"{count} x {reason}" for reason, count in top)
        others = self.rejected_count - sum(c for _, c in top)
        return text + (f"; {others} more of other kinds" if others else "")


def _reason(failure: control_pb2.FailureReason.ValueType, message: str) -> str:
    name = control_pb2.FailureReason.Name(failure) if failure else "NO_REASON"
    # node ids and numbers vary per call; group the reasons by their shape
    return f"{name}: {_DIGITS.sub('#', message)[:80]}"


class ApiClients:
    """One channel per scheduler replica, shared by every worker (HTTP/2 multiplexes)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if not addresses:
            raise ValueError("at least one scheduler address is needed")
        self.addresses = list(addresses)
        self._channels: list[Any] = [grpc.aio.insecure_channel(a) for a in self.addresses]
        self.stubs: list[control_pb2_grpc.AgentControlStub] = [
            control_pb2_grpc.AgentControlStub(c)  # type: ignore[no-untyped-call]
            for c in self._channels
        ]

    async def close(self) -> None:
        channels, self._channels = self._channels, []
        for channel in channels:
            await channel.close()

    async def summary(self, replica: int = 0, *,
                      timeout: float = 30.0) -> control_pb2.GetClusterSummaryResponse:
        reply: control_pb2.GetClusterSummaryResponse = await self.stubs[replica].GetClusterSummary(
            control_pb2.GetClusterSummaryRequest(), timeout=timeout)
        return reply

    async def apply_all(
        self,
        requests: Iterable[control_pb2.ApplyWorkloadRequest],
        *,
        concurrency: int,
        total: int,
        timeout: float = 60.0,
        progress_every_s: float = 10.0,
        label: str = "apply",
    ) -> ApplyReport:
        """Send every request with at most ``concurrency`` in flight; never raises for a failed
        call (it is counted as rejected with its reason)."""
        report = ApplyReport()
        source: Iterator[control_pb2.ApplyWorkloadRequest] = iter(requests)
        stubs = self.stubs
        perf = time.perf_counter

        async def worker(index: int) -> None:
            stub = stubs[index % len(stubs)]
            for request in source:  # a shared iterator: each request is taken exactly once
                report.attempted += 1
                began = perf()
                try:
                    reply = await stub.ApplyWorkload(request, timeout=timeout)
                except grpc.aio.AioRpcError as exc:
                    details = _DIGITS.sub("#", exc.details() or "")[:80]
                    report.rejected[f"rpc {exc.code().name}: {details}"] += 1
                    continue
                if reply.success:
                    report.latencies_s.append(perf() - began)
                    report.committed.append(request.workload_id)
                else:
                    report.rejected[_reason(reply.failure_reason, reply.error_message)] += 1

        async def progress(began: float) -> None:
            while True:
                await asyncio.sleep(progress_every_s)
                elapsed = perf() - began
                done = len(report.committed)
                print(f"bench: {label}: {report.attempted}/{total} sent, {done} committed, "
                      f"{report.rejected_count} rejected, {done / elapsed:.0f}/s",
                      file=sys.stderr, flush=True)

        began = perf()
        reporter = asyncio.get_running_loop().create_task(progress(began), name="bench-progress")
        try:
            async with asyncio.TaskGroup() as group:
                for i in range(max(1, concurrency)):
                    group.create_task(worker(i), name=f"bench-client-{i}")
        finally:
            reporter.cancel()
            # wait() does not re-raise the reporter's cancellation, so a cancellation of this
            # task itself still propagates
            await asyncio.wait([reporter])
        report.wall_s = perf() - began
        report.ended_at = time.monotonic()
        return report
