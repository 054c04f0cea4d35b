"""How often a heartbeat renews its node's liveness lease.

Why: a keepalive through the etcd gateway costs about a millisecond of this process's etcd
client, which tops out near 1,100 calls per second; 5,000 nodes heartbeating every 10 s would
spend half of it on keepalives alone. So a heartbeat renews the lease only when this replica's
last renewal of it is at least a window ``W = 1.5 intervals`` old (about every other heartbeat),
and the lease is granted for ``SCHEDULER_NODE_LEASE_TTL + W``. The promise stays the same: a
node's key disappears no sooner than the TTL after its last heartbeat (at most ``W`` later),
because a skipped renewal means the last one is less than ``W`` old, so the lease still has
more than the TTL left. Times are taken before the etcd call, so etcd's own clock only adds.

Each replica remembers only its own renewals: if a node's heartbeats alternate between replicas,
each renews on its own schedule, which renews more often, never less.
"""

from __future__ import annotations

import math

#: the renewal window in heartbeat intervals: 1.5 renews about every other heartbeat and
#: tolerates half an interval of jitter
WINDOW_INTERVALS = 1.5


def window_s(heartbeat_interval_s: float) -> float:
    return WINDOW_INTERVALS * heartbeat_interval_s


def lease_ttl(node_lease_ttl_s: int, heartbeat_interval_s: int) -> int:
    """The TTL to grant: the configured one plus the renewal window."""
    return node_lease_ttl_s + math.ceil(window_s(heartbeat_interval_s))


def renewal_due(last: tuple[int, float] | None, lease_id: int, now: float,
                heartbeat_interval_s: float) -> bool:
    """Pure: must this heartbeat renew ``lease_id``, given this replica's last renewal
    ``(lease id, monotonic time)`` of it?"""
    if last is None or last[0] != lease_id:
        return True
    return now - last[1] >= window_s(heartbeat_interval_s)


class RenewalLog:
    """This replica's last renewal per node; bounded by the fleet size."""

    def __init__(self, heartbeat_interval_s: float) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self._last: dict[str, tuple[int, float]] = {}

    def due(self, node_id: str, lease_id: int, now: float) -> bool:
        return renewal_due(self._last.get(node_id), lease_id, now, self.heartbeat_interval_s)

    def renewed(self, node_id: str, lease_id: int, now: float) -> None:
        self._last[node_id] = (lease_id, now)

    def forget(self, node_id: str) -> None:
        self._last.pop(node_id, None)
