"""Where an event's commit-to-delivery time went, for the ``events`` scenario's notes.

Why: the figure the scenario targets (decision to a watcher's receipt) sums several stages
and the disk under etcd and Redis. When it misses, the reader needs to know which stage grew:
the SetNodeLabel call (decision, etcd commit, answer), the relay (decision to the stream
append), the hand-over to the watcher's gRPC stream, or fsyncs that stalled etcd (and Redis,
whose ``appendfsync always`` waits on the same disk). Every part is read from the outside:
the client's own timings, the target's ``/metrics`` and etcd's ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ops.benchlib.promtext import MetricsSnapshot
from ops.benchlib.quantiles import bucket_quantile, percentile

RELAY = "persys_scheduler_event_relay_delay_seconds"
DELIVERY = "persys_scheduler_event_delivery_delay_seconds"
FSYNC = "etcd_disk_wal_fsync_duration_seconds"
#: an fsync slower than this holds every commit behind it for longer than the delivery target
SLOW_FSYNC_S = 0.064


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value * 1000:.1f}"


def _histogram(delta: MetricsSnapshot, family: str) -> str | None:
    buckets = delta.buckets(family)
    p50, _ = bucket_quantile(buckets, 0.5)
    p99, caveat = bucket_quantile(buckets, 0.99)
    if p50 is None:
        return None
    return f"p50 {_ms(p50)} p99 {_ms(p99)} ms" + (" (p99 above the largest bucket)"
                                                    if caveat else "")


def describe_stages(call_latencies_s: Sequence[float], before: MetricsSnapshot | None,
                    after: MetricsSnapshot | None) -> str:
    """One line: each stage's p50/p99, or why a stage could not be measured."""
    parts = []
    if call_latencies_s:
        parts.append("SetNodeLabel as the client saw it (decide, commit, answer) "
                     f"p50 {_ms(percentile(call_latencies_s, 0.5))} "
                     f"p99 {_ms(percentile(call_latencies_s, 0.99))} ms")
    if before is None or after is None:
        parts.append("relay and hand-over stages unknown (no /metrics; pass --metrics)")
        return "; ".join(parts)
    delta = after.minus(before)
    for family, what in ((RELAY, "decision to stream append (relay)"),
                         (DELIVERY, "decision to hand-over to the watcher's stream")):
        if not after.exports(f"{family}_bucket"):
            parts.append(f"{what}: the target exports no {family}")
            continue
        text = _histogram(delta, family)
        parts.append(f"{what} {text}" if text else f"{what}: nothing observed")
    return "; ".join(parts) + " (scheduler histograms, interpolated within buckets)"


def describe_storage(before: MetricsSnapshot | None, after: MetricsSnapshot | None,
                     data_dir: str) -> str | None:
    """etcd's WAL fsyncs during the run: how many, their p99, and how many were slow."""
    if before is None or after is None or not after.exports(f"{FSYNC}_bucket"):
        return None
    buckets = after.minus(before).buckets(FSYNC)
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    within = max((count for bound, count in buckets if bound <= SLOW_FSYNC_S), default=0.0)
    p99, _ = bucket_quantile(buckets, 0.99)
    return (f"etcd WAL fsyncs during the run: {total:.0f}, p99 {_ms(p99)} ms, "
            f"{total - within:.0f} over {SLOW_FSYNC_S * 1000:.0f} ms (etcd's histogram; "
            f"etcd and Redis data under {data_dir}: a disk whose fsyncs stall shows here, "
            "and TMPDIR=/dev/shm takes the disk out of the measurement)")
