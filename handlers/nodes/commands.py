"""Node commands: RegisterNode, Heartbeat and the operator controls.

Liveness without a write per heartbeat: each node has an etcd lease attached to
``/persys/scheduler/alive/<node>``. A heartbeat, on whichever replica receives it, renews that
lease (a keepalive is not a Raft write; about every other heartbeat, see
``handlers.nodes.liveness``, and many heartbeats' renewals share one gateway call, see
``eventsource.keepalives``); when it expires etcd deletes the key and the leader's node monitor
sees the delete. The node record is rewritten only when something in it changes
(registration data, a NotReady -> Ready transition, an operator action); the time of the last
heartbeat, which GetNode and ListNodes show, is kept in Redis and in memory
(``handlers.nodes.usage``). Workload states reported in heartbeats are written only when they
differ from the stored status, and only for workloads assigned to the reporting node: one node's
agent cannot change another node's workloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, timedelta
from typing import Any

from eventsource.clock import Clock
from eventsource.commit import Change, Committer, retry_on_conflict
from eventsource.errors import Conflict, LeaseLost, StoreError
from eventsource.etcd import BULK, AsyncEtcd, Compare, Delete, Put
from eventsource.events import Event, parse_rfc3339, rfc3339
from eventsource.keepalives import KeepaliveBatcher
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.records import (
    Node,
    ReasonInfo,
    Resources,
    Taint,
    WorkloadStatus,
    copy_record,
    encode,
)
from handlers.cluster.modes import ModeState
from handlers.identity.authz import Caller, moves_node, refuse_heartbeat, refuse_registration
from handlers.nodes.liveness import RenewalLog, lease_ttl
from handlers.nodes.usage import UsageSink
from handlers.placement.decision import canonical_driver, canonical_type
from handlers.settings.config import Settings
from handlers.specs.validation import LABELS_MAX, InvalidSpec, check_labels, validate_id
from handlers.workloads.relocation import Relocator
from handlers.writes.cas import NotFound, StateWriter
from projections.cluster import ClusterProjection
from proto.persys.control.v1 import control_pb2

log = logging.getLogger("persys.nodes")

#: bound on the status record's log tail (the Go version grew it forever, bug I3)
LOG_TAIL_BYTES = 4096
READY = "Ready"
NOT_READY = "NotReady"
DRAINING = "Draining"
STICKY_STATUSES = frozenset({DRAINING, "Drained"})
#: an agent's status message is kept to this many characters: the status record is rewritten
#: (and watched by every replica) whenever a message is new, and a record has a size limit
MESSAGE_MAX_CHARS = 1024
#: a usage snapshot's free-text fields (its type and source): one agent must not be able to
#: grow the usage keys and the meter stream without bound
USAGE_TEXT_MAX_CHARS = 64
#: a ReasonDetail's code (the Go agent's metadata ``failure_reason``, e.g. "ImagePullFailed")
REASON_CODE_MAX_CHARS = 128
#: the host of a node's grpc_endpoint (a DNS name is at most 253)
HOST_MAX_CHARS = 253
#: storage drivers a node may declare, and the length of one name
DRIVERS_MAX, DRIVER_MAX_CHARS = 32, 64
#: taints a node may carry (as many as labels)
TAINTS_MAX = LABELS_MAX
#: a message already among the last this many characters of the log tail is not new
RECENT_LOG_CHARS = 512


def agent_message(ws: control_pb2.WorkloadStatus) -> str:
    """The agent's message as recorded: bounded, so that a long one is recognised as already
    recorded (a crash loop repeats it every heartbeat) and never outgrows the record."""
    message = ws.message
    return message if len(message) <= MESSAGE_MAX_CHARS else message[:MESSAGE_MAX_CHARS] + "…"


def already_logged(logs: str, message: str) -> bool:
    return message in logs[-(RECENT_LOG_CHARS + len(message)):]


def agent_reason(ws: control_pb2.WorkloadStatus) -> ReasonInfo | None:
    """The agent's ReasonDetail as ``statusInfo.reason`` stores it (times RFC3339, text
    bounded); None when the status carries none. An all-empty detail is returned as such: it
    says the workload has no reason now."""
    if not ws.HasField("reason"):
        return None
    r = ws.reason
    message = r.message if len(r.message) <= MESSAGE_MAX_CHARS else (
        r.message[:MESSAGE_MAX_CHARS] + "…")
    return ReasonInfo(
        code=r.code[:REASON_CODE_MAX_CHARS], message=message, retryable=r.retryable,
        last_transition=_time_text(r, "last_transition"),
        next_retry_at=_time_text(r, "next_retry_at"))


def _is_empty(reason: ReasonInfo) -> bool:
    return not (reason.code or reason.message or reason.retryable or reason.next_retry_at)


def same_reason(stored: ReasonInfo | None, reported: ReasonInfo) -> bool:
    """Whether ``reported`` says what ``stored`` says. ``last_transition`` is left out: the Go
    agent stamps it from the workload's update time (or now, when it has none), so it can move
    on every heartbeat while the reason stays the same; the stored one says when it began."""
    if stored is None or _is_empty(stored):
        return _is_empty(reported)
    return (stored.code, stored.message, stored.retryable, stored.next_retry_at) == (
        reported.code, reported.message, reported.retryable, reported.next_retry_at)


@dataclass(frozen=True, slots=True)
class RegisterOutcome:
    accepted: bool
    reason: str
    interval_s: int = 0
    lease_expires_at: Any = None


@dataclass(frozen=True, slots=True)
class HeartbeatOutcome:
    known: bool
    drain: bool = False
    lease_expires_at: Any = None
    #: why the caller's certificate may not speak for this node (handlers/authz)
    refused: str = ""


class _Refused(Exception):
    """The caller's certificate may not register this node."""


def normalize_types(types: Sequence[str]) -> list[str]:
    out: list[str] = []
    for t in types:
        c = canonical_type(t)
        if c and c not in out:
            out.append(c)
    return out


def normalize_drivers(drivers: Sequence[str]) -> list[str]:
    """The node's storage drivers, canonical; at most ``DRIVERS_MAX`` of ``DRIVER_MAX_CHARS``
    each (unknown names pass through, so the agent decides what it supports)."""
    out = ["local"]
    for d in drivers:
        c = canonical_driver(d)
        if len(c) > DRIVER_MAX_CHARS:
            raise InvalidSpec("capabilities.supported_storage_drivers",
                              f"a driver name longer than {DRIVER_MAX_CHARS} characters")
        if c not in out:
            out.append(c)
    if len(out) > DRIVERS_MAX:
        raise InvalidSpec("capabilities.supported_storage_drivers",
                          f"more than {DRIVERS_MAX} drivers")
    return out


def _identity(node: Node) -> bytes:
    """The node record without the fields that change on every registration."""
    clone = copy_record(node)
    clone.timestamp = ""
    clone.last_heartbeat = ""
    clone.status_updated_at = ""
    return encode(clone)


def map_agent_state(state: str) -> str:
    s = state.strip().lower()
    return {"running": "Running", "stopped": "Stopped", "failed": "Failed", "pending": "Pending"
            }.get(s, "Unknown")


class NodeCommands:
    """The node aggregate's command handlers."""

    def __init__(
        self,
        *,
        etcd: AsyncEtcd,
        cluster: ClusterProjection,
        committer: Committer,
        writer: StateWriter,
        relocator: Relocator,
        usage: UsageSink,
        mode: ModeState,
        clock: Clock,
        layout: KeyLayout,
        settings: Settings,
        metrics: Metrics,
        keepalives: KeepaliveBatcher,
    ) -> None:
        self.etcd = etcd
        self.keepalives = keepalives
        self.cluster = cluster
        self.committer = committer
        self.writer = writer
        self.relocator = relocator
        self.usage = usage
        self.mode = mode
        self.clock = clock
        self.layout = layout
        self.settings = settings
        self.metrics = metrics
        self.renewals = RenewalLog(settings.heartbeat_interval_s)

    # -- RegisterNode -----------------------------------------------------------------------
    async def register(self, req: control_pb2.RegisterNodeRequest,
                       caller: Caller | None = None) -> RegisterOutcome:
        """``caller``: the client certificate's identity under mTLS (None without TLS); the
        node must be bound to it (``SCHEDULER_NODE_BINDING``)."""
        try:
            node_id = validate_id("node_id", req.node_id)
            endpoint = req.grpc_endpoint.strip()
            host, sep, port_text = endpoint.rpartition(":")
            if not sep or not host or len(host) > HOST_MAX_CHARS or not port_text.isascii() \
                    or not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise InvalidSpec("grpc_endpoint", "required as host:port")
            caps = req.capabilities
            if caps.cpu_total_millicores < 0:
                raise InvalidSpec("capabilities.cpu_total_millicores", "must not be negative")
            if caps.memory_total_mb < 0:
                raise InvalidSpec("capabilities.memory_total_mb", "must not be negative")
            check_labels("labels", dict(req.labels))
        except InvalidSpec as exc:
            return RegisterOutcome(False, str(exc))
        if not self.mode.writable:
            return RegisterOutcome(False, f"scheduler {self.mode.mode} mode: {self.mode.reason}")
        now = self.clock.now()
        stamp = rfc3339(now)

        async def attempt(n: int) -> bool:
            item = self.cluster.nodes.get(node_id)
            previous = item.value if item else None
            if caller is not None:
                # decided on the record this attempt's CAS compares against, so a concurrent
                # registration from another host cannot slip between the check and the write
                refusal = refuse_registration(
                    caller, self.settings.node_binding, node_id=node_id, host=host,
                    registered_host=(previous.ip_address or None) if previous else None,
                    lost=previous is not None and (previous.status == NOT_READY
                                                   or self.cluster.alive.get(node_id) is None),
                    agent_names=self.settings.agent_cert_names)
                if refusal is not None:
                    raise _Refused(refusal)
            node = copy_record(previous) if previous else Node(node_id=node_id)
            # a move to another host was allowed because the node looked lost here: etcd must
            # agree at commit time (no liveness key), or the CAS fails and this is decided again
            moving = caller is not None and previous is not None and moves_node(
                caller, self.settings.node_binding, host=host,
                registered_host=previous.ip_address or None)
            node.ip_address = host.strip("[]")
            node.agent_port = int(port_text)
            node.agent_grpc_port = int(port_text)
            node.agent_endpoint = endpoint
            node.username = node.username or "agent"
            node.hostname = node.hostname or node_id
            node.os_name = node.os_name or "linux"
            node.kernel_version = node.kernel_version or "unknown"
            node.total_cpu = caps.cpu_total_millicores / 1000.0
            node.total_memory = int(caps.memory_total_mb)
            node.available_cpu = node.total_cpu
            node.available_memory = node.total_memory
            node.resources = node.resources or Resources()
            node.supported_workload_types = normalize_types(caps.supported_workload_types)
            node.supported_storage_drivers = normalize_drivers(caps.supported_storage_drivers)
            labels = dict(node.labels)
            labels.update(dict(req.labels))
            labels["scheduler_shard"] = self.settings.shard_key
            if len(labels) > LABELS_MAX + 1:  # + the scheduler's own scheduler_shard
                raise InvalidSpec("labels", f"more than {LABELS_MAX} labels together with "
                                            "those the node has; delete some first")
            node.labels = labels
            node.domain_name = f"{node_id}.{self.settings.domain}"
            joined = previous is None or previous.status == NOT_READY
            if node.status not in STICKY_STATUSES:
                if node.status != READY:
                    node.status_reason = "registered"
                    node.status_updated_by = "agent"
                    node.status_updated_at = stamp
                node.status = READY
            changed = previous is None or _identity(previous) != _identity(node) or joined
            change = Change(kind="node")
            if moving:
                change.compares.append(Compare.mod(self.layout.alive(node_id), 0))
            if changed:
                node.timestamp = stamp
                node.last_heartbeat = stamp
                change.compares.append(
                    Compare.mod(self.layout.node(node_id), item.mod_revision if item else 0))
                change.puts += [
                    Put(self.layout.node(node_id), encode(node), category="node"),
                    Put(self.layout.node_status(node_id), node.status.encode(), category="node"),
                    Put(self.layout.skydns(self.settings.agents_discovery_domain,
                                           self.settings.shard_key, node_id),
                        json.dumps({"host": node.ip_address, "ttl": 300}).encode(),
                        category="dns"),
                ]
                old_shard = previous.labels.get("scheduler_shard", "") if previous else ""
                if old_shard and old_shard != self.settings.shard_key:
                    # registered through a replica of another shard key before: its record
                    # there would stay behind, answering for this node forever
                    change.deletes.append(Delete(self.layout.skydns(
                        self.settings.agents_discovery_domain, old_shard, node_id),
                        category="dns"))
            if joined:
                change.events.append(Event(
                    type="NodeJoined", node_id=node_id,
                    reason="node registered" if previous is None else "node re-registered",
                    details={"status": node.status, "agent_endpoint": endpoint,
                             "scheduler_shard": self.settings.shard_key},
                    timestamp=now))
            await self._ensure_alive(node_id, change)
            if not change.is_empty():
                try:
                    committed = await self.committer.commit(change)
                except Conflict as exc:
                    if exc.revision:
                        await self.cluster.wait_for(exc.revision, which=("nodes", "alive"))
                    raise
                # read-your-writes: whoever places work right after the registration was
                # answered must find the node (a placement once answered "no nodes registered")
                with contextlib.suppress(StoreError):
                    await self.cluster.wait_for(committed.revision, which=("nodes", "alive"),
                                                timeout=2.0)
            return True

        try:
            await retry_on_conflict(attempt)
        except InvalidSpec as exc:  # found against the stored record (merged labels)
            return RegisterOutcome(False, str(exc))
        except _Refused as exc:
            self.metrics.calls_refused.labels("RegisterNode").inc()
            log.warning("registration refused by certificate node_id=%s caller=%s: %s",
                        node_id, caller.describe() if caller else "-", exc)
            return RegisterOutcome(False, str(exc))
        except Conflict:
            return RegisterOutcome(False, "too many concurrent updates of this node; retry")
        except StoreError as exc:
            return RegisterOutcome(False, f"registration not stored: {exc}")
        # a registration is a heartbeat too (the record is rewritten only when it changed)
        self.usage.heartbeat(node_id, now)
        return RegisterOutcome(
            True, "registered", self.settings.heartbeat_interval_s,
            now + timedelta(seconds=self.settings.node_lease_ttl_s),
        )

    async def _ensure_alive(self, node_id: str, change: Change) -> None:
        """Renew the node's liveness lease, or add a new lease + key to ``change``.

        The projection may not show a key another replica (or this one) just wrote, so a miss
        there is checked against etcd before a new lease is granted.
        """
        key = self.layout.alive(node_id)
        item = self.cluster.alive.get(node_id)
        lease, mod = (item.lease, item.mod_revision) if item is not None else (0, 0)
        if not lease:
            kv = await self.etcd.get(key)
            if kv is not None:
                lease, mod = kv.lease, kv.mod_revision
        if lease:
            now = self.clock.monotonic()
            if not self.renewals.due(node_id, lease, now):
                return
            try:
                await self.keepalives.renew(lease)
                self.renewals.renewed(node_id, lease, now)
                return
            except LeaseLost:
                self.renewals.forget(node_id)
        asked = self.clock.monotonic()
        lease = await self.etcd.lease_grant(
            lease_ttl(self.settings.node_lease_ttl_s, self.settings.heartbeat_interval_s),
            lane=BULK)
        self.renewals.renewed(node_id, lease, asked)
        change.compares.append(Compare.mod(key, mod))
        change.puts.append(Put(key, self.settings.instance_id.encode(), lease=lease,
                               category="other"))

    # -- Heartbeat --------------------------------------------------------------------------
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
        self.usage.heartbeat(node_id, now)
        lease_until = now + timedelta(seconds=self.settings.node_lease_ttl_s)
        if not self.mode.writable:
            # keep the fleet as it is: an etcd blip must not make agents stop their workloads
            return HeartbeatOutcome(True, drain=False, lease_expires_at=lease_until)
        try:
            change = Change(kind="liveness")
            await self._ensure_alive(node_id, change)
            if not change.is_empty():
                await self.committer.commit(change)
        except (Conflict, StoreError) as exc:
            log.warning("liveness not renewed node_id=%s: %s", node_id, exc)
        node = item.value
        if node.status not in (READY, *STICKY_STATUSES) and node.status != "":
            await self._mark_ready(node_id, node.status, now)
        await self._apply_statuses(node_id, req, now)
        drain = self.cluster.nodes.get(node_id) is not None and (
            self.cluster.nodes.get(node_id).value.status == DRAINING  # type: ignore[union-attr]
        )
        return HeartbeatOutcome(True, drain=drain, lease_expires_at=lease_until)

    async def _mark_ready(self, node_id: str, old_status: str, now: Any) -> None:
        stamp = rfc3339(now)

        def mutate(node: Node) -> list[Event] | None:
            if node.status in (READY, *STICKY_STATUSES):
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
                usages[wid] = _usage_dict(ws.usage)
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
            if current.status in ("Scheduled", "Updating") and _older_than_apply(ws, current):
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
                usages[u.workload_id] = _usage_dict(u)
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
                status.status_info.reason = None if _is_empty(reason) else reason
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

    # -- operator controls ------------------------------------------------------------------
    async def _control(self, node_id: str, mutate: Any) -> Node:
        node, _ = await self.writer.update_node(node_id, mutate, kind="node-control")
        return node

    async def drain(self, node_id: str, reason: str) -> tuple[Node, int]:
        now = self.clock.now()
        stamp = rfc3339(now)

        already = {"draining": False}

        def mutate(node: Node) -> list[Event] | None:
            if node.status == DRAINING:
                already["draining"] = True
                return None
            node.status = DRAINING
            node.status_reason = reason or "node drain requested"
            node.status_updated_by = "operator"
            node.status_updated_at = stamp
            return [Event(type="NodeDraining", node_id=node_id, reason=node.status_reason,
                          details={"source": "operator"}, timestamp=now)]

        node = await self._control(node_id, mutate)
        moved = 0
        for workload_id in sorted(self.cluster.workload_ids_on(node_id)):
            outcome = await self.relocator.relocate(workload_id, from_node=node_id,
                                                    event_type="Relocated",
                                                    report_skip=not already["draining"])
            moved += outcome == "moved"
        return node, moved

    async def undrain(self, node_id: str, reason: str) -> Node:
        now = self.clock.now()
        stamp = rfc3339(now)

        def mutate(node: Node) -> list[Event] | None:
            if node.status == READY:
                return None
            node.status = READY
            node.status_reason = reason or "node returned to service"
            node.status_updated_by = "operator"
            node.status_updated_at = stamp
            return [Event(type="NodeReady", node_id=node_id, reason=node.status_reason,
                          details={"source": "operator"}, timestamp=now)]

        return await self._control(node_id, mutate)

    async def taint(self, node_id: str, key: str, value: str, effect: str) -> Node:
        effect = effect or "NoSchedule"
        now = self.clock.now()

        def mutate(node: Node) -> list[Event] | None:
            for t in node.taints:
                if t.key == key and t.effect == effect:
                    if t.value == value:
                        return None
                    t.value = value
                    break
            else:
                if len(node.taints) >= TAINTS_MAX:
                    raise InvalidSpec("taint", f"the node has {TAINTS_MAX} taints already")
                node.taints.append(Taint(key=key, value=value, effect=effect))
            node.status_updated_at = rfc3339(now)
            return [Event(type="NodeTainted", node_id=node_id, reason=f"taint {key}:{effect}",
                          details={"source": "operator", "key": key, "effect": effect,
                                   "value": value}, timestamp=now)]

        return await self._control(node_id, mutate)

    async def untaint(self, node_id: str, key: str, effect: str) -> Node:
        now = self.clock.now()

        def mutate(node: Node) -> list[Event] | None:
            kept = [t for t in node.taints if not (t.key == key and (not effect
                                                                     or t.effect == effect))]
            if len(kept) == len(node.taints):
                return None
            node.taints = kept
            return [Event(type="NodeUntainted", node_id=node_id, reason=f"untaint {key}",
                          details={"source": "operator", "key": key, "effect": effect},
                          timestamp=now)]

        return await self._control(node_id, mutate)

    async def set_label(self, node_id: str, key: str, value: str) -> Node:
        now = self.clock.now()

        def mutate(node: Node) -> list[Event] | None:
            if node.labels.get(key) == value:
                return None
            if key not in node.labels and len(node.labels) > LABELS_MAX:
                raise InvalidSpec("key", f"the node has {len(node.labels)} labels already "
                                         f"(at most {LABELS_MAX} of yours)")
            node.labels[key] = value
            return [Event(type="NodeLabelSet", node_id=node_id, reason=f"label {key}={value}",
                          details={"source": "operator", "key": key, "value": value},
                          timestamp=now)]

        return await self._control(node_id, mutate)

    async def delete_label(self, node_id: str, key: str) -> Node:
        now = self.clock.now()

        def mutate(node: Node) -> list[Event] | None:
            if key not in node.labels:
                return None
            del node.labels[key]
            return [Event(type="NodeLabelDeleted", node_id=node_id, reason=f"label {key} removed",
                          details={"source": "operator", "key": key}, timestamp=now)]

        return await self._control(node_id, mutate)


def _older_than_apply(ws: control_pb2.WorkloadStatus, status: WorkloadStatus) -> bool:
    """Whether the agent's state changed last before the scheduler asked for the apply now in
    flight (a heartbeat built while the old revision ran, delivered after an update)."""
    requested = parse_rfc3339(str(status.metadata.get("lastApplyRequestAt", "")))
    if requested is None or not ws.HasField("last_transition"):
        return False
    try:
        # a second of slack: agents may stamp whole seconds, and clocks differ a little
        return ws.last_transition.ToDatetime(tzinfo=UTC) < requested - timedelta(seconds=1)
    except (ValueError, OverflowError, OSError):
        return False


def _usage_dict(u: control_pb2.WorkloadUsageSnapshot) -> dict[str, Any]:
    return {
        # JSON has no NaN or infinity, and Go's decoder refuses them
        "workloadId": u.workload_id, "type": u.type[:USAGE_TEXT_MAX_CHARS],
        "cpuPercent": u.cpu_percent if math.isfinite(u.cpu_percent) else 0.0,
        "memoryBytes": u.memory_bytes, "diskReadBytes": u.disk_read_bytes,
        "diskWriteBytes": u.disk_write_bytes, "netRxBytes": u.net_rx_bytes,
        "netTxBytes": u.net_tx_bytes,
        "collectedAt": _collected_at(u),
        "source": u.source[:USAGE_TEXT_MAX_CHARS],
    }


def _collected_at(u: control_pb2.WorkloadUsageSnapshot) -> str:
    """The snapshot's time, or "" when absent or not a time (a bad clock on one agent must not
    fail its whole heartbeat)."""
    return _time_text(u, "collected_at")


def _time_text(message: Any, field_name: str) -> str:
    """A Timestamp field of ``message`` as RFC3339, or "" when absent or not a time."""
    if not message.HasField(field_name):
        return ""
    try:
        return rfc3339(getattr(message, field_name).ToDatetime(tzinfo=UTC))
    except (ValueError, OverflowError, OSError):
        return ""
