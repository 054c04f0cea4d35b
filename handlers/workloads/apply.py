"""ApplyWorkload: create the workload or update the one that exists, re-deciding on a lost
compare, and once more on a view as new as etcd's when no node could take it.

Apart because it only routes: the creation (``create``) and the update (``update``) each
decide on this replica's projections and commit in one CAS transaction; this module owns the
retries around them. ApplyWorkload answers once the placement is committed; the agent apply
is dispatched afterwards and its outcome shows in the workload's status and events
(docs/architecture.md, "Errors and answers").
"""

from __future__ import annotations

from eventsource.commit import Committer, retry_on_conflict
from eventsource.errors import Conflict, StoreError
from handlers.cluster.modes import ModeState
from handlers.specs.validation import ParsedApply
from handlers.workloads.create import CreateCommand
from handlers.workloads.outcome import Outcome, refused_while_frozen
from handlers.workloads.update import UpdateCommand
from projections.cluster import ClusterProjection


class ApplyCommand:
    """The ApplyWorkload command."""

    def __init__(self, *, cluster: ClusterProjection, committer: Committer, mode: ModeState,
                 create: CreateCommand, update: UpdateCommand) -> None:
        self.cluster = cluster
        self.committer = committer
        self.mode = mode
        self.create = create
        self.update = update

    async def run(self, parsed: ParsedApply) -> Outcome:
        frozen = refused_while_frozen(self.mode)
        if frozen is not None:
            return frozen

        store_pending = False

        async def attempt(n: int) -> Outcome:
            existing = self.cluster.specs.get(parsed.workload_id)
            if existing is None:
                if parsed.spec is None:
                    return Outcome(False, "INVALID_SPEC",
                                   "spec: required for a workload that does not exist")
                return await self.create.run(parsed, store_pending=store_pending)
            return await self.update.run(parsed, store_pending=store_pending)

        try:
            outcome = await retry_on_conflict(attempt, attempts=8)
            if outcome.unplaced and await self._caught_up():
                # the refusal may come from a view older than a node registered a moment ago
                # (on another replica): decide once more on a view as new as etcd's
                outcome = await retry_on_conflict(attempt, attempts=8)
            if outcome.unplaced:
                # it fits nowhere now: store it Pending (handlers.workloads.pending), deciding
                # once more in the same attempt, so a node that appeared meanwhile takes it
                store_pending = True
                outcome = await retry_on_conflict(attempt, attempts=8)
            return outcome
        except Conflict:
            return Outcome(False, "INSUFFICIENT_RESOURCES",
                           "placement kept conflicting with concurrent writers; retry")

    async def _caught_up(self) -> bool:
        """Bring the placement views up to etcd's current revision; False if they already
        were (nothing new to decide on) or etcd cannot tell."""
        try:
            revision = await self.committer.etcd.current_revision()
        except StoreError:
            return False
        if self.cluster.nodes.revision >= revision:
            return False
        try:
            await self.cluster.wait_for(revision, timeout=3.0,
                                        which=("nodes", "allocations", "alive", "specs"))
        except StoreError:
            return False
        return True
