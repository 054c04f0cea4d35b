"""Heartbeat: renew the node's liveness, turn a NotReady node Ready, and record what its agent
reports about its workloads.

Apart because a heartbeat is the fleet's most frequent call and writes only news: the node
record only on a NotReady -> Ready transition, and workload states only when they differ from
the stored status, and only for workloads assigned to the reporting node (one node's agent
cannot change another node's workloads). The time of the heartbeat and the usage snapshots go
to ``handlers.nodes.usage``, not etcd.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from eventsource.clock import Clock
from eventsource.commit import Change, Committer
from eventsource.errors import Conflict, StoreError
from eventsource.events import Event, rfc3339
from eventsource.metrics import Metrics
from eventsource.records import Node, WorkloadStatus
from handlers.cluster.modes import ModeState
from handlers.identity.authz import Caller, refuse_heartbeat
from handlers.nodes.leases import LivenessLeases
from handlers.nodes.recovery import held_by_dials
from handlers.nodes.reports import (
    LOG_TAIL_BYTES,
    agent_message,
    agent_reason,
    already_logged,
    is_empty_reason,
    map_agent_state,
    older_than_apply,
    same_reason,
    usage_dict,
)
from handlers.nodes.statuses import DRAINING, READY, STICKY_STATUSES
from handlers.nodes.usage import UsageSink
from handlers.settings.config import Settings
from handlers.writes.cas import NotFound, StateWriter
from projections.cluster import ClusterProjection
from proto.persys.control.v1 import control_pb2

log = logging.getLogger("persys.nodes")


@dataclass(frozen=True, slots=True)
class HeartbeatOutcome:
    known: bool
    drain: bool = False
    lease_expires_at: Any = None
    #: why the caller's certificate may not speak for this node (handlers/identity/authz.py)
    refused: str = ""


class Heartbeats:
    """The Heartbeat command."""

    def __init__(self, *, cluster: ClusterProjection, committer: Committer, writer: StateWriter,
                 leases: LivenessLeases, usage: UsageSink, mode: ModeState, clock: Clock,
                 settings: Settings, metrics: Metrics) -> None:
        self.cluster = cluster
        self.committer = committer
        self.writer = writer
        self.leases = leases
        self.usage = usage
        self.mode = mode
        self.clock = clock
        self.settings = settings
        self.metrics = metrics

    async def heartbeat(self, req: control_pb2.HeartbeatRequest,
                        caller: Caller | None = None) -> HeartbeatOutcome:
        node_id = req.node_id.strip()
        self.metrics.heartbeats.inc()
        # a miss is checked against etcd: the registration may have been committed a moment
        # ago, here or on another replica, and "unknown" would make the agent register again
        try:
            item = await self.cluster.nodes.get_fresh(node_id)
        except StoreError:  # etcd unreachable: answer from what this replica knows
            item = self.cluster.nodes.get(node_id)
        if item is None:
            return HeartbeatOutcome(known=False)
        if caller is not None:
            refusal = refuse_heartbeat(caller, self.settings.node_binding, node_id=node_id,
                                       registered_host=item.value.ip_address,
                                       agent_names=self.settings.agent_cert_names)
            if refusal is not None:
                self.metrics.calls_refused.labels("Heartbeat").inc()
                log.warning("heartbeat refused by certificate node_id=%s caller=%s",
                            node_id, caller.describe())
                return HeartbeatOutcome(True, refused=refusal)
        now = self.clock.now()
        # NodeView.last_heartbeat, kept outside etcd (handlers.nodes.usage): also while degraded,
        # since the heartbeat did arrive
        used = ((req.usage.cpu_used_millicores, req.usage.memory_used_mb)
                if req.HasField("usage") else None)
        self.usage.heartbeat(node_id, now, used)
        lease_until = now + timedelta(seconds=self.settings.node_lease_ttl_s)
        if not self.mode.writable:
            # keep the fleet as it is: an etcd blip must not make agents stop their workloads
            return HeartbeatOutcome(True, drain=False, lease_expires_at=lease_until)
        try:
            change = Change(kind="liveness")
            await self.leases.ensure_alive(node_id, change)
            if not change.is_empty():
                await self.committer.commit(change)
        except (Conflict, StoreError) as exc:
            log.warning("liveness not renewed node_id=%s: %s", node_id, exc)
        node = item.value
        if node.status not in (READY, *STICKY_STATUSES) and node.status != "" \
                and not held_by_dials(node):
            # a node marked for unanswered dials returns only by answered dials
            # (handlers/nodes/recovery.py): its heartbeats alone would make it flap
            await self._mark_ready(node_id, node.status, now)
        await self._apply_statuses(node_id, req, now)
        drain = self.cluster.nodes.get(node_id) is not None and (
            self.cluster.nodes.get(node_id).value.status == DRAINING  # type: ignore[union-attr]
        )
        return HeartbeatOutcome(True, drain=drain, lease_expires_at=lease_until)

    async def _mark_ready(self, node_id: str, old_status: str, now: Any) -> None:
        stamp = rfc3339(now)

        def mutate(node: Node) -> list[Event] | None:
            if node.status in (READY, *STICKY_STATUSES) or held_by_dials(node):
                return None
            previous = node.status
            node.status = READY
            node.status_reason = f"status transition {previous} -> Ready via heartbeat"
            node.status_updated_by = "heartbeat"
            node.status_updated_at = stamp
            node.last_heartbeat = stamp
            return [Event(type="NodeReady", node_id=node_id, reason=node.status_reason,
                          details={"source": "heartbeat"}, timestamp=now)]

        try:
            await self.writer.update_node(node_id, mutate)
        except (NotFound, Conflict, StoreError) as exc:
            log.warning("node not marked ready node_id=%s: %s", node_id, exc)

    async def _apply_statuses(self, node_id: str, req: control_pb2.HeartbeatRequest,
                              now: Any) -> None:
        stamp = rfc3339(now)
        usages: dict[str, dict[str, Any]] = {}
        revisions: dict[str, str] = {}
        changed: list[tuple[str, str, control_pb2.WorkloadStatus]] = []
        for ws in req.workload_statuses:
            wid = ws.workload_id
            item = self.cluster.statuses.get(wid)
            if item is None or item.value.node_id != node_id:
                continue  # unknown, or not this node's: never act for another node
            if ws.HasField("usage"):
                usages[wid] = usage_dict(ws.usage)
            state = map_agent_state(ws.state)
            current = item.value
            if current.status == "RetryPending" and state == "Failed":
                continue  # the retry budget already decided what follows this failure
            message = agent_message(ws)
            reason = agent_reason(ws)
            new_reason = reason is not None and not same_reason(
                current.status_info.reason, reason)
            if current.status in ("Deleting", "Deleted") or (
                current.status == state and not message and not new_reason
            ):
                continue
            if current.status in ("Scheduled", "Updating") and older_than_apply(ws, current):
                continue  # what ran before the apply in flight: not its outcome
            if current.status == state and message and already_logged(current.logs, message) \
                    and not new_reason:
                continue
            changed.append((wid, state, ws))
        if changed:
            # concurrently: different keys, so they can share a transaction (group commit),
            # and a heartbeat waits for the slowest write, not for the sum of them
            await asyncio.gather(*(self._update_workload_state(wid, node_id, state, ws, stamp)
                                   for wid, state, ws in changed))
        for u in req.workload_usage:
            # agents report each snapshot twice (here and in its status): convert it once
            if u.workload_id in usages:
                continue
            item = self.cluster.statuses.get(u.workload_id)
            if item is not None and item.value.node_id == node_id:  # never for another node
                usages[u.workload_id] = usage_dict(u)
        for wid in usages:
            spec = self.cluster.specs.get(wid)
            if spec is not None:
                revisions[wid] = spec.value.revision_id
        if usages:
            self.usage.offer(node_id, usages, revisions, stamp)

    async def _update_workload_state(self, workload_id: str, node_id: str, state: str,
                                     ws: control_pb2.WorkloadStatus, stamp: str) -> None:
        message = agent_message(ws)

        def mutate(status: WorkloadStatus) -> list[Event] | None:
            if status.node_id != node_id or status.status in ("Deleting", "Deleted"):
                return None
            changed = False
            # the Go version's UpdateWorkloadRuntimeDetails: the agent's reason detail, kept in
            # statusInfo.reason (WorkloadView.reason); a fresh copy per attempt
            reason = agent_reason(ws)
            if reason is not None and not same_reason(status.status_info.reason, reason):
                status.status_info.reason = None if is_empty_reason(reason) else reason
                changed = True
            if status.status != state:
                status.status = state
                status.status_info.actual_state = state
                status.status_info.last_updated = stamp
                changed = True
            if message and not already_logged(status.logs, message):
                line = f"[{stamp}] {message}\n"
                status.logs = (status.logs + line)[-LOG_TAIL_BYTES:]
                changed = True
            if state == "Failed" and message:
                status.metadata["last_runtime_error"] = message
            return [] if changed else None

        try:
            await self.writer.update_status(workload_id, mutate, kind="heartbeat")
        except (NotFound, Conflict, StoreError) as exc:
            log.info("workload state not recorded workload_id=%s: %s", workload_id, exc)
