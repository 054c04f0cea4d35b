"""The workload commands as the servicer and the leader loops call them: ApplyWorkload,
DeleteWorkload and RetryWorkload, built over one set of shared parts.

Each command lives in its own module (``apply``, ``create``, ``update``, ``desired_state``,
``delete``, ``retry_command``) and validates, decides on this replica's projections, and
commits the state change with its events in one CAS transaction (``eventsource.commit``).
This module only wires them, with the ``Assigner`` and ``Relocator`` they share with the
node commands and the reconcile loop, and gives their answers read-your-writes: a command
that wrote answers once this replica's workload projections show its revision, so a
``GetWorkload`` right after a ``DeleteWorkload`` reads ``Deleting``, not the state before.
"""

from __future__ import annotations

import logging

from eventsource.clock import Clock
from eventsource.commit import Committer
from eventsource.errors import StoreError
from eventsource.keys import KeyLayout
from handlers.cluster.modes import ModeState
from handlers.placement.batcher import PlacementBatcher
from handlers.placement.placer import Placer
from handlers.specs.validation import ParsedApply
from handlers.workloads.apply import ApplyCommand
from handlers.workloads.assignment import Assigner
from handlers.workloads.create import CreateCommand
from handlers.workloads.delete import DeleteCommand
from handlers.workloads.dispatch import Dispatcher
from handlers.workloads.outcome import Outcome
from handlers.workloads.pending import PendingPolicy
from handlers.workloads.readback import ReadBack
from handlers.workloads.relocation import Relocator
from handlers.workloads.retry_command import RetryCommand
from handlers.workloads.update import UpdateCommand
from handlers.writes.cas import StateWriter
from projections.cluster import ClusterProjection

log = logging.getLogger("persys.workloads")

#: how long an answer waits for its write to reach this replica's projections; the write is
#: committed either way, so a projection that lags longer (an etcd watch reconnecting) only
#: costs the caller a read that may still show the state before it
SETTLE_TIMEOUT_S = 2.0


class WorkloadCommands:
    """The workload aggregate's command handlers."""

    def __init__(
        self,
        *,
        cluster: ClusterProjection,
        committer: Committer,
        writer: StateWriter,
        placer: Placer,
        dispatcher: Dispatcher,
        batcher: PlacementBatcher,
        mode: ModeState,
        clock: Clock,
        layout: KeyLayout,
        pending: PendingPolicy | None = None,
    ) -> None:
        self.cluster = cluster
        self.placer = placer
        self.assigner = Assigner(cluster=cluster, placer=placer, clock=clock, layout=layout)
        self.relocator = Relocator(cluster=cluster, committer=committer, writer=writer,
                                   placer=placer, assigner=self.assigner, dispatcher=dispatcher,
                                   clock=clock, layout=layout)
        readback = ReadBack(committer=committer, dispatcher=dispatcher)
        self.delete_command = DeleteCommand(cluster=cluster, committer=committer,
                                            dispatcher=dispatcher, mode=mode, clock=clock,
                                            layout=layout)
        self.retry_command = RetryCommand(cluster=cluster, writer=writer, dispatcher=dispatcher,
                                          mode=mode, clock=clock)
        create = CreateCommand(cluster=cluster, committer=committer, placer=placer,
                               assigner=self.assigner, batcher=batcher, dispatcher=dispatcher,
                               readback=readback, clock=clock, layout=layout,
                               pending=pending or PendingPolicy())
        update = UpdateCommand(cluster=cluster, committer=committer, assigner=self.assigner,
                               relocator=self.relocator, delete=self.delete_command,
                               dispatcher=dispatcher, readback=readback, clock=clock,
                               layout=layout)
        self.apply_command = ApplyCommand(cluster=cluster, committer=committer, mode=mode,
                                          create=create, update=update)

    async def apply(self, parsed: ParsedApply) -> Outcome:
        """ApplyWorkload (``apply.ApplyCommand``)."""
        return await self._settled(await self.apply_command.run(parsed))

    async def delete(self, workload_id: str) -> Outcome:
        """DeleteWorkload (``delete.DeleteCommand``)."""
        return await self._settled(await self.delete_command.run(workload_id))

    async def retry(self, workload_id: str) -> Outcome:
        """RetryWorkload (``retry_command.RetryCommand``)."""
        return await self.retry_command.run(workload_id)

    async def _settled(self, outcome: Outcome) -> Outcome:
        """The answer, once the specs and statuses projections show the revision it wrote."""
        if outcome.revision:
            try:
                await self.cluster.wait_for(outcome.revision, timeout=SETTLE_TIMEOUT_S,
                                            which=("specs", "statuses"))
            except StoreError as exc:
                log.warning("answering before the projections show revision %d: %s",
                            outcome.revision, exc)
        return outcome
