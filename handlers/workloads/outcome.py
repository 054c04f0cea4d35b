"""The in-band answer of a workload command, and the two steps every command takes around its
decision: the refusal while the control plane is frozen, and the catch-up after a lost compare.

Apart because every command (and the relocator and the reconcile loop's placement) answers
with an ``Outcome`` and re-decides the same way: the servicer turns the answer into the RPC's
response fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from eventsource.errors import Conflict
from handlers.cluster.modes import ModeState
from projections.cluster import ClusterProjection


@dataclass(frozen=True, slots=True)
class Outcome:
    """An in-band answer: ``failure`` is a FailureReason name or ''."""

    ok: bool
    failure: str = ""
    message: str = ""
    node_id: str = ""
    #: no node could take the workload (the answer may still say it was stored Pending)
    unplaced: bool = False
    #: the etcd revision that committed the change (0: nothing written); the answer waits
    #: until this replica's projections show it, so the caller's next read sees its write
    revision: int = 0


def refused_while_frozen(mode: ModeState) -> Outcome | None:
    """RUNTIME_ERROR while the control plane is frozen (not writable), else None."""
    if mode.writable:
        return None
    return Outcome(False, "RUNTIME_ERROR",
                   f"control plane frozen: scheduler {mode.mode} ({mode.reason})")


async def catch_up(cluster: ClusterProjection, exc: Conflict) -> None:
    """After a lost compare: wait until the projections show the winning write, so the next
    attempt decides on state that includes it."""
    if exc.revision:
        await cluster.wait_for(exc.revision, which=("specs", "statuses", "allocations", "nodes"))
