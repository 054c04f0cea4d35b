"""DeleteWorkload: mark the workload Deleted in one CAS transaction, then ask its agent to
remove it; the dispatcher finalises the records once the agent confirms.

Apart from the apply commands because a delete only rewrites the spec and status (the
allocation is released at finalisation), and ApplyWorkload with the Deleted desired state
comes here too.
"""

from __future__ import annotations

from eventsource.clock import Clock
from eventsource.commit import Change, Committer, retry_on_conflict
from eventsource.errors import Conflict
from eventsource.etcd import Compare, Put
from eventsource.events import rfc3339
from eventsource.keys import KeyLayout
from eventsource.records import WorkloadStatus, copy_record, encode
from handlers.cluster.modes import ModeState
from handlers.workloads.dispatch import Dispatcher
from handlers.workloads.outcome import Outcome, catch_up, refused_while_frozen
from projections.cluster import ClusterProjection


class DeleteCommand:
    """The DeleteWorkload command."""

    def __init__(self, *, cluster: ClusterProjection, committer: Committer,
                 dispatcher: Dispatcher, mode: ModeState, clock: Clock,
                 layout: KeyLayout) -> None:
        self.cluster = cluster
        self.committer = committer
        self.dispatcher = dispatcher
        self.mode = mode
        self.clock = clock
        self.layout = layout

    async def run(self, workload_id: str) -> Outcome:
        frozen = refused_while_frozen(self.mode)
        if frozen is not None:
            return frozen

        async def attempt(n: int) -> Outcome:
            spec_item = self.cluster.specs.get(workload_id)
            status_item = self.cluster.statuses.get(workload_id)
            if spec_item is None:
                return Outcome(False, "", f"workload {workload_id} not found")
            spec = copy_record(spec_item.value)
            status = copy_record(status_item.value) if status_item else WorkloadStatus(
                id=workload_id)
            if spec.desired_state == "Deleted" and status.status == "Deleting":
                self.dispatcher.delete(workload_id, status.node_id)
                return Outcome(True, message="delete already in progress")
            spec.desired_state = "Deleted"
            status.status = "Deleting"
            status.metadata["last_action"] = "MarkedDeleted"
            status.status_info.last_updated = rfc3339(self.clock.now())
            change = Change(
                kind="workload",
                compares=[Compare.mod(self.layout.spec(workload_id), spec_item.mod_revision),
                          Compare.mod(self.layout.status(workload_id),
                                      status_item.mod_revision if status_item else 0)],
                puts=[Put(self.layout.spec(workload_id), encode(spec), category="spec"),
                      Put(self.layout.status(workload_id), encode(status), category="status")],
            )
            try:
                committed = await self.committer.commit(change)
            except Conflict as exc:
                await catch_up(self.cluster, exc)
                raise
            self.dispatcher.delete(workload_id, status.node_id, after=committed.revision)
            return Outcome(True, message="delete requested", revision=committed.revision)

        return await retry_on_conflict(attempt)
