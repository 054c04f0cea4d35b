"""Quantiles of exact samples and of Prometheus histogram bucket deltas.

Why two: the bench times its own API calls (exact samples), but it only sees the scheduler's
internal timings (placement decision, reconcile cycle) through cumulative histogram buckets, from
which a quantile can only be estimated the way ``histogram_quantile`` does it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``samples``; None when empty.

    Nearest-rank never invents a value that was not observed, which matters for small counts
    (three reconcile cycles: p99 is the slowest one).
    """
    if not samples:
        return None
    if not 0.0 < q <= 1.0:
        raise ValueError(f"quantile must be within (0, 1], got {q}")
    ordered = sorted(samples)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> tuple[float | None, str]:
    """Estimate the ``q`` quantile from cumulative ``(upper_bound, count)`` buckets.

    Linear interpolation inside the bucket holding the rank, as Prometheus'
    ``histogram_quantile``. Returns ``(value, caveat)``: value None when there are no
    observations; the caveat (empty when none) says when the rank fell in the ``+Inf`` bucket,
    in which case the value is the largest finite bound (a lower bound of the truth).
    """
    if not 0.0 < q <= 1.0:
        raise ValueError(f"quantile must be within (0, 1], got {q}")
    ordered = sorted(buckets, key=lambda b: b[0])
    if not ordered or ordered[-1][1] <= 0:
        return None, ""
    total = ordered[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound, (
                    f"the p{q * 100:g} rank lies above the largest finite bucket "
                    f"({prev_bound:g}); the value is a lower bound"
                )
            width = count - prev_count
            if width <= 0:
                return bound, ""
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / width, ""
        prev_bound, prev_count = bound, count
    return prev_bound, ""  # pragma: no cover - the +Inf bucket always holds the total
