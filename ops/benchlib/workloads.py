"""The workloads the bench applies: small containers with seeded, varied requests.

Why varied: identical requests let a placement function get away with a trivial fit check;
a few sizes exercise the resource accounting that ``nodes_over_capacity`` audits. The mean
request (about 110 millicores, 150 MiB) keeps the default ratio of 20 workloads per node at
about a quarter of a simulated node (8,000 millicores, 16 GiB), so a correct scheduler rejects
nothing; a denser ratio shows up as ``rejected`` with INSUFFICIENT_RESOURCES.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

from proto.persys.control.v1 import control_pb2

CPU_CHOICES_M = (50, 100, 100, 200)
MEMORY_CHOICES_MB = (64, 128, 128, 256)
IMAGE = "registry.local/bench/pause:1"


def run_prefix() -> str:
    """A prefix unique to one bench run, so runs against a shared scheduler never collide."""
    return f"bench-{uuid.uuid4().hex[:6]}"


def workload_id(prefix: str, index: int) -> str:
    return f"{prefix}-{index:06d}"


def apply_requests(prefix: str, count: int, *, seed: int | None) -> Iterator[
        control_pb2.ApplyWorkloadRequest]:
    """``count`` ApplyWorkload requests, built lazily (100,000 messages need not sit in memory
    before the first is sent)."""
    rng = random.Random(seed)
    for i in range(count):
        spec = control_pb2.WorkloadSpec(
            type="container",
            resources=control_pb2.ResourceRequirements(
                cpu_millicores=rng.choice(CPU_CHOICES_M),
                memory_mb=rng.choice(MEMORY_CHOICES_MB),
            ),
            container=control_pb2.ContainerSpec(image=IMAGE),
        )
        yield control_pb2.ApplyWorkloadRequest(workload_id=workload_id(prefix, i), spec=spec)
