"""``--profile DIR``: sample the scheduler processes with py-spy while the scenario runs.

Why py-spy: it samples a running CPython process from outside (no hook in the scheduler, so
it works for any Python scheduler whose pid the bench knows) and writes collapsed stacks
(``frame;frame;frame count`` per line), which the bench sums into the functions that used the
most samples. It is an optional tool (``pip install py-spy``): without it, or when it cannot
attach (ptrace not permitted), the run goes on and ``notes["profile"]`` says why.

One ``py-spy record --format raw --nonblocking`` per scheduler process, from after the start
until the scenario returns (the span the figures are measured in, plus the scenario's own
set-up); SIGINT makes it write its file. ``--nonblocking`` does not pause the scheduler while a
sample is read, so the profile costs the measured process almost nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

RATE_HZ = 100
TOP = 12

#: Where a sample's CPU went, by the innermost scheduler module on its stack (first match in
#: order): the stages the placement and event paths go through. A sample with no scheduler
#: frame is grpc's own asyncio machinery or the event loop itself.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("dispatch to agents", ("handlers/workloads/dispatch", "handlers/workloads/evidence",
                            "handlers/agents/")),
    ("decision", ("handlers/placement/", "handlers/workloads/assignment")),
    ("commands", ("handlers/workloads/", "handlers/writes/", "handlers/specs/")),
    ("gRPC in (servicer, interceptors, views)", ("handlers/api/", "handlers/app/grpc",
                                                 "handlers/identity/")),
    ("heartbeats and registrations", ("handlers/nodes/", "eventsource/keepalives")),
    ("reconcile and leader loops", ("handlers/reconcile/", "handlers/cluster/")),
    ("relay", ("eventsource/relay/",)),
    ("event fan-out (stream reads, watchers)", ("eventsource/stream/", "projections/events")),
    ("watch decode and projections", ("projections/", "eventsource/watch")),
    ("commit and its JSON (etcd client)", ("eventsource/commit", "eventsource/group",
                                           "eventsource/etcd", "eventsource/lean_http",
                                           "eventsource/records", "eventsource/events")),
    ("other scheduler code", ("eventsource/", "handlers/")),
)
GRPC_ONLY = "grpc's asyncio machinery (no scheduler frame)"
LOOP_ONLY = "event loop and other libraries (no scheduler frame)"
#: uvloop's loop runs in native code, and grpc's completion queue polling and its Cython
#: frames under it show no Python frame: py-spy charges them to the loop's ``run`` call
NATIVE = "event loop, uvloop and grpc's native code (no Python frame below the loop)"
LOOP_RUNNER = "handlers/app/eventloop"


def _path_of(frame: str) -> str:
    """``name (path/to/file.py:12)`` -> ``path/to/file.py``."""
    inside = frame.rpartition(" (")[2]
    return inside.rpartition(":")[0] if ":" in inside else inside


def stage_of(frames: list[str]) -> str:
    """The stage of one stack (root first): its innermost frame in scheduler code decides."""
    saw_grpc = False
    for frame in reversed(frames):
        path = _path_of(frame).replace("\\", "/")
        if f"/{LOOP_RUNNER}" in f"/{path}":
            return NATIVE
        for stage, prefixes in STAGES:
            if any(f"/{prefix}" in f"/{path}" for prefix in prefixes):
                return stage
        if "grpc/" in path or "grpc_" in path or "cygrpc" in frame:
            saw_grpc = True
    return GRPC_ONLY if saw_grpc else LOOP_ONLY


def stage_shares(text: str) -> tuple[int, list[tuple[str, int]]]:
    """(samples, samples per stage, largest first) of py-spy's raw output."""
    counts: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        counts[stage_of(stack.split(";"))] += int(count)
    return total, counts.most_common()


def py_spy() -> str | None:
    """The py-spy executable: next to this Python's, or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


Ranked = list[tuple[str, int]]


def summarize(text: str, top: int = TOP) -> tuple[int, Ranked, Ranked]:
    """(samples, the ``top`` frames by own samples, the ``top`` by inclusive samples) of
    py-spy's raw (collapsed) output."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return total, own.most_common(top), inclusive.most_common(top)


class Profiler:
    """py-spy on each named pid; ``stop()`` returns the note for ``notes["profile"]``."""

    def __init__(self, directory: Path, pids: dict[str, int]) -> None:
        self.directory = directory
        self.pids = {n: p for n, p in pids.items() if n.startswith("scheduler-")}
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
        self.problem = ""

    def start(self) -> None:
        exe = py_spy()
        if exe is None:
            self.problem = "py-spy not found (pip install py-spy): no profile taken"
            return
        if not self.pids:
            self.problem = ("the bench does not know the scheduler's pid (--scheduler-pid): "
                            "no profile taken")
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        for name, pid in self.pids.items():
            out = self.directory / f"{name}-{pid}.txt"
            log = self.directory / f"{name}-{pid}.log"
            with log.open("wb") as err:
                proc = subprocess.Popen(
                    [exe, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", "raw",
                     "--nonblocking", "--output", str(out)],
                    stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT,
                    start_new_session=True)
            self.procs[name] = (proc, out, log)

    def stop(self) -> str:
        """Stop every py-spy (SIGINT: it writes its file), and summarize what they wrote."""
        if self.problem:
            return self.problem
        parts: list[str] = []
        for name, (proc, out, log) in self.procs.items():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if not out.exists():
                tail = log.read_text(errors="replace")[-300:].strip() if log.exists() else ""
                parts.append(f"{name}: py-spy wrote no profile ({tail or 'no output'})")
                continue
            total, own, inclusive = summarize(out.read_text(errors="replace"))
            if not total:
                parts.append(f"{name}: no samples in {out}")
                continue
            _, stages = stage_shares(out.read_text(errors="replace"))
            parts.append(
                f"{name}: {total} samples at {RATE_HZ} Hz in {out}; by stage: "
                + ", ".join(f"{stage} {100 * n / total:.1f}%" for stage, n in stages)
                + "; most own samples: "
                + ", ".join(f"{frame} {100 * n / total:.1f}%" for frame, n in own)
                + "; most inclusive: "
                + ", ".join(f"{frame} {100 * n / total:.1f}%" for frame, n in inclusive))
        return " | ".join(parts) or "no profile taken"
