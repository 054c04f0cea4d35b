"""Which lost nodes may have their workloads moved now: the disruption guard.

Why: a node whose liveness lease expired is usually down, and its workloads should move. When
many leases expire together the likelier cause is on our side (an overloaded control plane, or
a partition between it and the fleet), and moving everything then makes it worse: every move is
a placement, an etcd transaction and two agent RPCs, spent by a control plane already too late
with heartbeats. The 5,000-node x 100,000-workload benchmark showed it: about 1,400 leases
expired within a minute on an overloaded machine, and the relocations that followed kept it
overloaded. Kubernetes' node lifecycle controller answers the same way: evictions are
rate-limited, and stop when most of a zone looks down.

So moving a lost node's workloads ("evicting" it) needs admission:

* **Rate**: at most ``SCHEDULER_NODE_EVICTION_RATE`` nodes per second, with bursts of
  ``SCHEDULER_NODE_EVICTION_BURST`` (a token bucket), the longest-lost node first. 0 disables
  the limit.
* **Disruption**: while at least ``SCHEDULER_UNHEALTHY_NODE_THRESHOLD`` of this shard's nodes
  (and at least ``MIN_UNHEALTHY`` of them) are unavailable, no node is admitted and admissions
  already granted are withdrawn; moves resume when the fraction falls.

Marking nodes NotReady is never held: the status records what is known. Only the moves wait, and
a node that comes back meanwhile keeps its workloads. A workload whose node record is gone
(removed, not lost) is not held either. The decision is a pure function of the candidates, the
counts, the bucket and the time; ``EvictionGate`` keeps the bucket and the admitted set between
monitor ticks, in memory: a new leader starts with a full bucket, as after a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from handlers.reconcile.planner.inputs import NodeView

log = logging.getLogger(__name__)

#: fewer unavailable nodes than this is never a disruption (a two-node shard losing one is not)
MIN_UNHEALTHY = 3


@dataclass(frozen=True, slots=True)
class EvictionPolicy:
    rate_per_s: float = 1.0
    burst: int = 10
    unhealthy_threshold: float = 0.55
    min_unhealthy: int = MIN_UNHEALTHY

    @property
    def limited(self) -> bool:
        return self.rate_per_s > 0


@dataclass(frozen=True, slots=True)
class Bucket:
    tokens: float
    at: float

    def refilled(self, now: float, policy: EvictionPolicy) -> Bucket:
        elapsed = max(0.0, now - self.at)
        return Bucket(min(float(policy.burst), self.tokens + elapsed * policy.rate_per_s), now)


@dataclass(frozen=True, slots=True)
class EvictionDecision:
    #: nodes whose workloads may move now (earlier admissions that are still lost included)
    admitted: frozenset[str]
    #: admitted by this decision: their workloads are moved at once
    newly: tuple[str, ...]
    #: lost nodes with workloads that wait for admission
    waiting: tuple[str, ...]
    disrupted: bool
    bucket: Bucket


def disrupted(unavailable: int, owned: int, policy: EvictionPolicy) -> bool:
    """Do so many of the owned nodes look down that losing them is more likely our fault?"""
    # the quotient, not threshold x owned: 0.55 x 100 is 55.00000000000001 in floating point
    return (unavailable >= policy.min_unhealthy and owned > 0
            and unavailable / owned >= policy.unhealthy_threshold)


def decide_evictions(candidates: Sequence[str], admitted: AbstractSet[str], *, unavailable: int,
                     owned: int, bucket: Bucket, now: float,
                     policy: EvictionPolicy) -> EvictionDecision:
    """Admit lost nodes for eviction.

    Args:
        candidates: unavailable owned nodes that still hold workloads, longest-lost first.
        admitted: the nodes admitted before; those still candidates stay admitted for free.
        unavailable, owned: this shard's unavailable nodes (with workloads or not) and all of
            its nodes, for the disruption check.
        bucket: the token bucket as left by the previous decision.
        now: seconds on a clock that never goes back (the bucket refills with it).
    """
    refilled = bucket.refilled(now, policy)
    if disrupted(unavailable, owned, policy):
        return EvictionDecision(frozenset(), (), tuple(candidates), True, refilled)
    tokens = refilled.tokens
    keep: list[str] = []
    newly: list[str] = []
    waiting: list[str] = []
    for node_id in candidates:
        if node_id in admitted:
            keep.append(node_id)
        elif not policy.limited:
            newly.append(node_id)
        elif tokens >= 1.0:
            tokens -= 1.0
            newly.append(node_id)
        else:
            waiting.append(node_id)
    return EvictionDecision(frozenset(keep) | frozenset(newly), tuple(newly), tuple(waiting),
                            False, Bucket(tokens, now))


@dataclass(slots=True)
class EvictionGate:
    """The guard's memory between monitor ticks, and the question the reconcile loop asks."""

    policy: EvictionPolicy
    decision: EvictionDecision | None = None
    #: when each current candidate was first seen lost (admission order)
    _since: dict[str, float] = field(default_factory=dict)

    def update(self, views: Mapping[str, NodeView], holding: Iterable[str], *,
               now: float) -> EvictionDecision:
        """Decide from this shard's node views and the nodes that hold workloads.

        Args:
            views: every owned node's view.
            holding: node ids that have at least one workload assigned.
        """
        unavailable = {n for n, v in views.items() if not v.available}
        candidates = unavailable.intersection(holding)
        self._since = {n: self._since.get(n, now) for n in candidates}
        ordered = sorted(candidates, key=lambda n: (self._since[n], n))
        previous = self.decision
        decision = decide_evictions(
            ordered, previous.admitted if previous else frozenset(),
            unavailable=len(unavailable), owned=len(views),
            bucket=previous.bucket if previous else Bucket(float(self.policy.burst), now),
            now=now, policy=self.policy)
        if decision.disrupted and not (previous and previous.disrupted):
            log.warning("evictions held: disruption unavailable=%d owned=%d threshold=%.2f "
                        "(workloads of lost nodes stay assigned until the fraction falls)",
                        len(unavailable), len(views), self.policy.unhealthy_threshold)
        elif previous and previous.disrupted and not decision.disrupted:
            log.warning("evictions resumed unavailable=%d owned=%d", len(unavailable),
                        len(views))
        waited = len(previous.waiting) if previous and not previous.disrupted else 0
        if decision.waiting and not decision.disrupted and len(decision.waiting) != waited:
            log.info("evictions rate-limited waiting=%d admitted=%d rate_per_s=%g",
                     len(decision.waiting), len(decision.admitted), self.policy.rate_per_s)
        self.decision = decision
        return decision

    def allows(self, node_id: str, views: Mapping[str, NodeView]) -> bool:
        """May the workloads assigned to ``node_id`` move now?

        A node without a record (removed, not lost) always may. Before the monitor's first
        decision nothing lost is admitted: the monitor runs within seconds of leading.
        """
        if node_id not in views:
            return True
        return self.decision is not None and node_id in self.decision.admitted
