"""RetryWorkload: start the workload's retry budget over and apply it again now.

Apart from ``retry`` (the retry policy the reconcile loop decides with) because this is the
caller's command: it clears what halted the workload and dispatches the apply itself.
"""

from __future__ import annotations

from eventsource.clock import Clock
from eventsource.events import Event, rfc3339
from eventsource.records import WorkloadStatus
from handlers.cluster.modes import ModeState
from handlers.workloads.dispatch import Dispatcher
from handlers.workloads.outcome import Outcome, refused_while_frozen
from handlers.workloads.records import TERMINAL_KEYS, mark_apply_requested
from handlers.workloads.retry import REAPPLY_KEYS
from handlers.writes.cas import NotFound, StateWriter
from projections.cluster import ClusterProjection


class RetryCommand:
    """The RetryWorkload command."""

    def __init__(self, *, cluster: ClusterProjection, writer: StateWriter,
                 dispatcher: Dispatcher, mode: ModeState, clock: Clock) -> None:
        self.cluster = cluster
        self.writer = writer
        self.dispatcher = dispatcher
        self.mode = mode
        self.clock = clock

    async def run(self, workload_id: str) -> Outcome:
        frozen = refused_while_frozen(self.mode)
        if frozen is not None:
            return frozen
        now = rfc3339(self.clock.now())

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            status.retry.attempts = 0
            status.retry.next_retry_at = now
            if status.retry.max_attempts <= 0:
                status.retry.max_attempts = 5
            for key in REAPPLY_KEYS + TERMINAL_KEYS:
                status.metadata.pop(key, None)
            spec_now = self.cluster.specs.get(workload_id)
            if spec_now is not None and status.node_id and (
                spec_now.value.desired_state != "Deleted"
            ):
                mark_apply_requested(status, spec_now.value, now)
            status.metadata["last_action"] = "RetryTriggered"
            if status.status in ("Failed", "RetryPending"):
                status.status = "Pending"
            return [Event(type="RetryTriggered", workload_id=workload_id, node_id=status.node_id,
                          reason="retry requested",
                          details={"attempts": "0", "next_retry_at": now},
                          timestamp=self.clock.now())]

        try:
            status, committed = await self.writer.update_status(workload_id, mutate,
                                                                kind="workload")
        except NotFound:
            return Outcome(False, "", f"workload {workload_id} not found")
        spec_item = self.cluster.specs.get(workload_id)
        if spec_item is not None and status.node_id and spec_item.value.desired_state != "Deleted":
            self.dispatcher.apply(spec_item.value, status.metadata, status.node_id,
                                  spec_item.value.desired_state,
                                  after=committed.revision if committed else 0)
        return Outcome(True, node_id=status.node_id)
