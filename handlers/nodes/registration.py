"""RegisterNode: record (or re-record) a node and its agent endpoint, keep its liveness key
leased, and publish its DNS record, in one CAS transaction.

Apart because registration is the node's one full rewrite: it validates what the agent
declares, binds the node to the caller's certificate (``SCHEDULER_NODE_BINDING``), and
rewrites the record only when something in it changed (the time of the last heartbeat, which
GetNode and ListNodes show, is kept in Redis and in memory, ``handlers.nodes.usage``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from eventsource.clock import Clock
from eventsource.commit import Change, Committer, retry_on_conflict
from eventsource.errors import Conflict, StoreError
from eventsource.etcd import Compare, Delete, Put
from eventsource.events import Event, rfc3339
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.records import Node, Resources, copy_record, encode
from handlers.cluster.modes import ModeState
from handlers.identity.authz import (
    Caller,
    NodeBinding,
    moves_node,
    refuse_crowded_host,
    refuse_registration,
)
from handlers.nodes.leases import LivenessLeases
from handlers.nodes.statuses import NOT_READY, READY, STICKY_STATUSES
from handlers.nodes.usage import UsageSink
from handlers.placement.decision import canonical_driver, canonical_type
from handlers.settings.config import Settings
from handlers.specs.fields import (
    LABELS_MAX,
    InvalidSpec,
    check_labels,
    validate_host,
    validate_id,
)
from projections.cluster import ClusterProjection, HostIndex
from proto.persys.control.v1 import control_pb2

log = logging.getLogger("persys.nodes")

#: storage drivers a node may declare, and the length of one name
DRIVERS_MAX, DRIVER_MAX_CHARS = 32, 64


@dataclass(frozen=True, slots=True)
class RegisterOutcome:
    accepted: bool
    reason: str
    interval_s: int = 0
    lease_expires_at: Any = None


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


class Registration:
    """The RegisterNode command."""

    def __init__(self, *, cluster: ClusterProjection, committer: Committer,
                 leases: LivenessLeases, usage: UsageSink, mode: ModeState, clock: Clock,
                 layout: KeyLayout, settings: Settings, metrics: Metrics) -> None:
        self.cluster = cluster
        self.committer = committer
        self.leases = leases
        self.usage = usage
        self.mode = mode
        self.clock = clock
        self.layout = layout
        self.settings = settings
        self.metrics = metrics
        self._host_locks = [asyncio.Lock() for _ in range(64)]

    async def _host_claim(self, host: str) -> tuple[str, int]:
        """The host's claim key and its mod revision, with the projections caught up to it.

        Why read etcd: the claim is only read when a node joins a host (its first
        registration, or after it was lost), so it has no projection; this replica's
        projections must then show what the claim's last writer committed with it (the node
        and its liveness key), or the live count would miss it.
        """
        key = self.layout.host_claim(HostIndex.key(host))
        found = await self.committer.etcd.get(key)
        revision = found.mod_revision if found is not None else 0
        if revision:
            await self.cluster.wait_for(revision, which=("nodes", "alive"), timeout=2.0)
        return key, revision

    def _live_at(self, host: str) -> list[str]:
        """The live nodes (alive, not NotReady) whose agent endpoint is at ``host``."""
        out = []
        for other in self.cluster.hosts.at(host):
            item = self.cluster.nodes.get(other)
            if item is not None and item.value.status != NOT_READY \
                    and self.cluster.alive.get(other) is not None:
                out.append(other)
        return out

    async def register(self, req: control_pb2.RegisterNodeRequest,
                       caller: Caller | None = None) -> RegisterOutcome:
        """``caller``: the client certificate's identity under mTLS (None without TLS); the
        node must be bound to it (``SCHEDULER_NODE_BINDING``)."""
        try:
            node_id = validate_id("node_id", req.node_id)
            endpoint = req.grpc_endpoint.strip()
            host, sep, port_text = endpoint.rpartition(":")
            if not sep or not host or not port_text.isascii() \
                    or not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise InvalidSpec("grpc_endpoint", "required as host:port")
            validate_host("grpc_endpoint", host)
            caps = req.capabilities
            if caps.cpu_total_millicores < 0:
                raise InvalidSpec("capabilities.cpu_total_millicores", "must not be negative")
            if caps.memory_total_mb < 0:
                raise InvalidSpec("capabilities.memory_total_mb", "must not be negative")
            if caps.cpu_total_millicores > self.settings.node_max_cpu_millicores:
                raise InvalidSpec("capabilities.cpu_total_millicores",
                                  f"{caps.cpu_total_millicores} is more than the "
                                  f"{self.settings.node_max_cpu_millicores} a node may claim "
                                  "(SCHEDULER_NODE_MAX_CPU_MILLICORES)")
            if caps.memory_total_mb > self.settings.node_max_memory_mb:
                raise InvalidSpec("capabilities.memory_total_mb",
                                  f"{caps.memory_total_mb} is more than the "
                                  f"{self.settings.node_max_memory_mb} a node may claim "
                                  "(SCHEDULER_NODE_MAX_MEMORY_MB)")
            check_labels("labels", dict(req.labels))
        except InvalidSpec as exc:
            return RegisterOutcome(False, str(exc))
        if not self.mode.writable:
            return RegisterOutcome(False, f"scheduler {self.mode.mode} mode: {self.mode.reason}")
        now = self.clock.now()
        stamp = rfc3339(now)

        async def attempt(n: int) -> bool:
            claim = None
            if caller is not None and self.settings.node_binding is NodeBinding.ENDPOINT \
                    and node_id not in self._live_at(host):
                claim = await self._host_claim(host)
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
                if refusal is None:
                    refusal = refuse_crowded_host(
                        self.settings.node_binding, node_id=node_id, host=host,
                        live_at_host=self._live_at(host), limit=self.settings.nodes_per_host)
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
            if previous is not None and not joined and (
                    previous.total_cpu != node.total_cpu
                    or previous.total_memory != node.total_memory):
                change.events.append(Event(
                    type="NodeCapacityChanged", node_id=node_id,
                    reason="the agent declared another capacity",
                    details={"cpu_millicores": str(caps.cpu_total_millicores),
                             "memory_mb": str(caps.memory_total_mb),
                             "previous_cpu_millicores": str(round(previous.total_cpu * 1000)),
                             "previous_memory_mb": str(previous.total_memory)},
                    timestamp=now))
            if joined:
                change.events.append(Event(
                    type="NodeJoined", node_id=node_id,
                    reason="node registered" if previous is None else "node re-registered",
                    details={"status": node.status, "agent_endpoint": endpoint,
                             "scheduler_shard": self.settings.shard_key},
                    timestamp=now))
            if claim is not None:
                # another replica adding a node to this host at once loses this compare and
                # decides again on the nodes that joined it (the live count above)
                change.compares.append(Compare.mod(claim[0], claim[1]))
                change.puts.append(Put(claim[0], node_id.encode(), category="node"))
            await self.leases.ensure_alive(node_id, change)
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
            # registrations at one host take turns here, so two new node ids cannot both find
            # the host free (one replica; each attempt waits until its commit is projected)
            turn: contextlib.AbstractAsyncContextManager[Any] = (
                self._host_locks[hash(HostIndex.key(host)) % len(self._host_locks)]
                if caller is not None and self.settings.node_binding is NodeBinding.ENDPOINT
                else contextlib.nullcontext())
            async with turn:
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
