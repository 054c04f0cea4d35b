"""What the leader loops need of the scheduler: its parts, named as a Protocol.

Why a Protocol: the composition root (``handlers.app.server.Scheduler``) builds the loops and
hands itself over; naming only the parts the loops use keeps this package from importing the
composition root above it, and shows what a loop may touch.
"""

from __future__ import annotations

from typing import Protocol

from opentelemetry.trace import Tracer

from eventsource.clock import Clock
from eventsource.commit import Committer
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from handlers.agents.pool import AgentPool
from handlers.cluster.leadership import LeaderGate
from handlers.cluster.modes import ModeState
from handlers.settings.config import Settings
from handlers.workloads.commands import WorkloadCommands
from handlers.workloads.dispatch import Dispatcher
from handlers.workloads.relocation import Relocator
from handlers.writes.cas import StateWriter
from projections.cluster import ClusterProjection


class SchedulerParts(Protocol):
    """The scheduler's parts a leader loop reads (``Scheduler`` has every one)."""

    settings: Settings
    clock: Clock
    metrics: Metrics
    layout: KeyLayout
    mode: ModeState
    cluster: ClusterProjection
    committer: Committer
    writer: StateWriter
    leader: LeaderGate
    agents: AgentPool
    dispatcher: Dispatcher
    workloads: WorkloadCommands
    relocator: Relocator
    #: None when traces are not exported
    tracer: Tracer | None
