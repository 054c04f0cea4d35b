"""The composition root: settings -> objects -> owned tasks; and the shutdown order.

Everything the process runs is built here and passed down (no module-level clients, caches or
registries). Every long-running task is started through ``TaskOwner`` and cancelled and awaited at
shutdown, in this order: stop accepting RPCs -> stop leader loops and the relay -> revoke leases
-> stop projections and the tailer -> close agent channels -> close Redis -> close etcd ->
flush the traces (when exported, ``handlers.app.tracing``).

Beside it: the owned tasks (``tasks``), the gRPC server's life from bind to stop
(``grpc_endpoint``), the errors a start fails with (``start_errors``), and the run of one
replica as a process (``serve``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from eventsource.clock import Clock, SystemClock
from eventsource.commit import Committer
from eventsource.errors import StoreError
from eventsource.etcd import AsyncEtcd
from eventsource.keepalives import KeepaliveBatcher
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.racing import race
from eventsource.stream.eventlog import RedisEventLog
from eventsource.stream.tailer import StreamTailer
from handlers.agents.pool import AgentPool, TlsFiles
from handlers.api.events import EventService
from handlers.api.explain import PlacementExplainer
from handlers.api.http import HttpEndpoint
from handlers.api.servicer import ControlServicer
from handlers.app.grpc_endpoint import GrpcEndpoint
from handlers.app.looplag import GcPauses, probe_loop_lag
from handlers.app.redis_clients import RedisClients
from handlers.app.start_errors import StartError, listen_error
from handlers.app.tasks import TaskOwner
from handlers.app.tracing import Tracing
from handlers.cluster.certificates import build_cert_manager
from handlers.cluster.dns import DnsRegistration, advertise_ip
from handlers.cluster.leadership import LeaderGate
from handlers.cluster.modes import DEGRADED, ModeState
from handlers.cluster.supervisor import ModeSupervisor
from handlers.cluster.topology import TopologyMismatch, settle_topology
from handlers.nodes.commands import NodeCommands
from handlers.nodes.usage import UsageSink, heartbeat_key_prefix
from handlers.placement.batcher import PlacementBatcher
from handlers.placement.placer import Placer
from handlers.reconcile.registration import register_loops
from handlers.settings.config import Settings
from handlers.storage.buckets.build import build_buckets
from handlers.storage.disks import DiskCommands
from handlers.workloads.commands import WorkloadCommands
from handlers.workloads.dispatch import Dispatcher
from handlers.workloads.pending import PendingPolicy
from handlers.workloads.persistence import managed_volumes_of
from handlers.writes.cas import StateWriter
from projections.cluster import ClusterProjection

log = logging.getLogger("persys.server")

#: How long a start waits for the projections to load from etcd before it gives up.
READY_TIMEOUT_S = 60.0


def _version() -> str:
    try:
        return version("persys-scheduler")
    except PackageNotFoundError:  # not installed (a source tree): no version on the spans
        return ""


async def _unless_stopped(stop: asyncio.Event | None, work: Coroutine[Any, Any, Any]) -> bool:
    """Await ``work``; False, with ``work`` cancelled, when ``stop`` is set first."""
    if stop is None:
        await work
        return True
    finished, _ = await race(work, stop)
    return finished


class Scheduler:
    """One scheduler replica."""

    def __init__(self, settings: Settings, *, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self.metrics = Metrics()
        #: trace export (off without an endpoint: then ``tracer`` is None everywhere)
        self.tracing = Tracing(settings, version=_version())
        self.tracer = self.tracing.tracer
        self.layout = KeyLayout(settings.etcd_root)
        self.etcd = AsyncEtcd(settings.etcd_endpoints, timeout=settings.etcd_timeout_s,
                              max_workers=16, tls=settings.etcd_tls)
        self.mode = ModeState(self.clock.now())
        self.cluster = ClusterProjection(self.etcd, self.layout, self.metrics)
        self.committer = Committer(self.etcd, self.layout, self.metrics,
                                   outbox_enabled=settings.events_enabled, tracer=self.tracer)
        self.writer = StateWriter(self.cluster, self.committer, self.layout)
        self.placer = Placer(self.cluster, self.clock, self.metrics,
                             reservation_ttl=settings.reservation_ttl_s,
                             lane=(settings.shard_index, settings.shard_count)
                             if settings.active_active else (0, 1), tracer=self.tracer)
        tls = None
        if settings.agent_tls_enabled:
            tls = TlsFiles(settings.tls_ca, settings.tls_cert, settings.tls_key)
        self.leader = LeaderGate(
            self.etcd, self.layout, self.committer, self.metrics, self.clock,
            instance_id=settings.instance_id, active_active=settings.active_active,
            shard_count=settings.shard_count, shard_index=settings.shard_index,
            lease_ttl_s=settings.leader_lease_ttl_s,
            renew_deadline_s=settings.leader_renew_deadline_s,
        )
        self.certs = build_cert_manager(settings, os.environ, self.metrics)
        self.agents = AgentPool(self.metrics, instance_id=settings.instance_id,
                                rpc_timeout=settings.agent_rpc_timeout_s, tls=tls,
                                leader_term=lambda: self.leader.term, guard=self.leader.guard,
                                delete_timeout=settings.agent_delete_timeout_s,
                                cert_rotator=self.certs.force_rotate if self.certs else None,
                                interceptors=self.tracing.client_interceptors())
        self.dispatcher = Dispatcher(pool=self.agents, cluster=self.cluster,
                                     committer=self.committer, writer=self.writer,
                                     clock=self.clock, layout=self.layout,
                                     concurrency=settings.reconcile_concurrency,
                                     apply_timeout=settings.agent_apply_timeout_s,
                                     vm_apply_timeout=settings.agent_vm_apply_timeout_s,
                                     delete_confirm_s=settings.agent_delete_timeout_s,
                                     delete_poll_s=settings.agent_status_poll_interval_s)
        self.batcher = PlacementBatcher(self.committer, self.cluster, self.layout,
                                        tracer=self.tracer)
        self.workloads = WorkloadCommands(cluster=self.cluster, committer=self.committer,
                                          writer=self.writer, placer=self.placer,
                                          dispatcher=self.dispatcher, batcher=self.batcher,
                                          mode=self.mode,
                                          clock=self.clock, layout=self.layout,
                                          pending=PendingPolicy(
                                              store=settings.unplaceable == "pending",
                                              max_pending=settings.pending_max))
        self.relocator = self.workloads.relocator
        # REDIS_ADDR or the master Sentinel names; telemetry gets its own connections: it
        # must never take the ones events need
        self.redis_clients = (RedisClients(settings, self.metrics) if settings.events_enabled
                              else None)
        self.redis = self.redis_clients.events if self.redis_clients else None
        self.usage_redis = self.redis_clients.usage if self.redis_clients else None
        self.usage = UsageSink(self.usage_redis, meter_stream=settings.meter_stream,
                               meter_maxlen=settings.meter_stream_maxlen,
                               meter_enabled=settings.meter_stream_enabled,
                               heartbeat_prefix=heartbeat_key_prefix(settings.etcd_root))
        self.keepalives = KeepaliveBatcher(self.etcd, metrics=self.metrics)
        self.nodes = NodeCommands(etcd=self.etcd, cluster=self.cluster, committer=self.committer,
                                  writer=self.writer, relocator=self.relocator, usage=self.usage,
                                  mode=self.mode, clock=self.clock, layout=self.layout,
                                  settings=settings, metrics=self.metrics,
                                  keepalives=self.keepalives)
        self.event_log: RedisEventLog | None = None
        self.tailer: StreamTailer | None = None
        self.events: EventService | None = None
        if self.redis is not None and self.redis_clients is not None:
            self.event_log = RedisEventLog(self.redis, settings.event_stream)
            self.tailer = self.redis_clients.tailer(settings.event_stream)
            self.events = EventService(
                self.event_log, self.tailer,
                observe_delay=self.metrics.event_delivery_delay.observe,
                wall_clock=lambda: self.clock.now().timestamp(),
                catch_up_s=self.redis_clients.catch_up_s)
        self.relay: Any = None
        self.supervisor = ModeSupervisor(self.etcd, self.layout, self.committer, self.mode,
                                         self.clock, allow_empty_state=settings.allow_empty_state,
                                         instance_id=settings.instance_id,
                                         on_revision=self.cluster.report_lag)
        self.servicer = ControlServicer(settings=settings, cluster=self.cluster, nodes=self.nodes,
                                        workloads=self.workloads, usage=self.usage,
                                        events=self.events, mode=self.mode,
                                        metrics=self.metrics,
                                        disks=DiskCommands(
                                            self.etcd, self.committer, self.layout, self.clock,
                                            volume_users=self._volume_users,
                                            node_exists=lambda node_id: self.cluster.nodes.get(
                                                node_id) is not None),
                                        buckets=build_buckets(os.environ),
                                        explainer=PlacementExplainer(self.cluster, self.placer))
        self.http = HttpEndpoint(self.metrics.registry, self.health)
        self.tasks = TaskOwner()
        self.gc_pauses = GcPauses(self.metrics.gc_pause)
        self.grpc = GrpcEndpoint(settings, self.metrics, self.servicer,
                                 tracing=self.tracing.server_interceptors())
        self.dns: DnsRegistration | None = None
        register_loops(self)

    @property
    def grpc_port(self) -> int:
        """The gRPC port taken (the system's choice for ``GRPC_PORT=0``); 0 before."""
        return self.grpc.port

    def _volume_users(self, driver: str, name: str) -> list[str]:
        """The workloads whose specs hold a managed volume ``name`` of ``driver``."""
        return [wid for wid, item in self.cluster.specs.items.items()
                if any(isinstance(v, dict) and v.get("name") == name
                       and (v.get("driver") or "local") == driver
                       for v in managed_volumes_of(item.value))]

    def health(self) -> dict[str, str]:
        s = self.settings
        relay_status = getattr(self.relay, "status", "off") if self.relay is not None else "off"
        return {
            "status": "ok",
            "mode": self.mode.mode,
            "reason": self.mode.reason,
            "modeChangedAt": self.mode.changed_at.isoformat(),
            "instanceId": s.instance_id,
            "haMode": s.ha_mode,
            "shardIndex": str(s.shard_index),
            "shardCount": str(s.shard_count),
            "leader": str(self.leader.is_leader).lower(),
            "relay": str(relay_status),
        }

    async def start(self, stop: asyncio.Event | None = None, *,
                    ready_timeout: float = READY_TIMEOUT_S) -> None:
        """Start projections, background tasks, the gRPC server and the HTTP endpoint.

        With Vault certificates, the first one is issued before anything else (retried until it
        is). ``stop`` set while the start waits (for Vault, for etcd) ends it early, with
        nothing serving; the caller then calls ``stop()`` as after any start.

        The gRPC and HTTP ports are taken first, before any election (leader, relay) or DNS
        record, and served only once the replica is ready.

        Raises:
            ListenError: a port could not be had (the message names the setting).
            StartError: the projections did not load from etcd within ``ready_timeout``.
        """
        if self.certs is not None:
            if not await self.certs.ensure(stop=stop):
                return
            self.tasks.start("certs", self.certs.run)
        await self._open_listeners()
        started = False
        try:
            started = await self._start_listening(stop, ready_timeout)
        finally:
            if not started:
                await self.grpc.close_unstarted()

    async def _start_listening(self, stop: asyncio.Event | None, ready_timeout: float) -> bool:
        """The rest of ``start`` once the ports are taken; False when ``stop`` ended it."""
        self.tasks.start("projections", self.cluster.run)
        # the mode is known before anything can write: a cluster that must start in recovery
        # (marker, no state) must not take a registration first
        if not await _unless_stopped(stop, self._first_mode_probe()):
            return False
        self.tasks.start("mode-supervisor", self.supervisor.run)
        if self.redis_clients is not None and self.redis_clients.master is not None:
            self.tasks.start("redis-master", self.redis_clients.run)
        if self.tailer is not None:
            await self.tailer.start()
        if self.event_log is not None and self.settings.relay_enabled:
            self.relay = self._build_relay()
            if self.relay is not None:
                self.tasks.start("relay", self.relay.run)
        try:
            if not await _unless_stopped(stop, self._projections_ready(ready_timeout)):
                return False
        except TimeoutError:
            raise StartError(self._not_ready(ready_timeout)) from None
        await self._check_topology()
        self.tasks.start("leader", self.leader.run)
        if self.usage_redis is not None:  # without Redis there is nothing to write usage to
            self.tasks.start("usage", self.usage.run)
        self.tasks.start("loop-lag", lambda: probe_loop_lag(self.metrics.event_loop_lag))
        self.gc_pauses.install()
        await self.grpc.serve()
        await self.http.start_serving()
        if self.settings.dns_enabled:
            port = self.settings.advertise_port
            if not port or port == self.settings.grpc_port:
                port = self.grpc_port
            self.dns = DnsRegistration(
                self.etcd, self.layout, domain=self.settings.domain,
                instance_id=self.settings.instance_id,
                host=advertise_ip(self.settings.advertise_ip), port=port,
                ttl_s=self.settings.dns_lease_ttl_s)
            self.tasks.start("dns", self.dns.run)
        log.info("scheduler started instance_id=%s grpc_port=%d metrics_port=%d",
                 self.settings.instance_id, self.grpc_port, self.http.port)
        return True

    async def _check_topology(self) -> None:
        """Fail the start when replicas campaign with other shard settings (an unanswered
        check decides nothing: every campaign checks again)."""
        try:
            await settle_topology(self.etcd, self.layout, self.leader.topology)
        except TopologyMismatch as exc:
            raise StartError(f"shard settings: {exc}") from None
        except StoreError as exc:
            log.warning("shard topology not checked at start (%s); each campaign checks it",
                        exc)

    async def _open_listeners(self) -> None:
        """Take the gRPC and HTTP ports, serving neither yet."""
        s = self.settings
        self.grpc.bind()
        host = s.metrics_addr or s.grpc_addr
        try:
            await self.http.start(host, s.metrics_port, serving=False)
        except OSError as exc:  # socket.gaierror too
            await self.grpc.close_unstarted()
            raise listen_error("metrics endpoint", host, s.metrics_port, exc,
                               host_var="SCHEDULER_METRICS_ADDR" if s.metrics_addr
                               else "PERSYS_GRPC_ADDR", port_var="METRICS_PORT") from None

    async def _first_mode_probe(self) -> None:
        try:
            await self.supervisor.tick()
        except StoreError as exc:
            log.warning("first mode probe failed: %s", exc)

    async def _projections_ready(self, timeout: float) -> None:
        """``cluster.wait_ready`` that can be cancelled quietly: its ``gather`` inside
        ``wait_for``, once cancelled, holds a CancelledError nobody retrieves, which asyncio
        then logs with a traceback."""
        waiters = [asyncio.ensure_future(p.ready.wait()) for p in self.cluster.projections]
        try:
            _, pending = await asyncio.wait(waiters, timeout=timeout)
        finally:
            for waiter in waiters:
                waiter.cancel()
        if pending:
            raise TimeoutError

    def _not_ready(self, timeout: float) -> str:
        endpoints = ",".join(self.settings.etcd_endpoints)
        why = f": {self.mode.reason.rstrip(': ')}" if self.mode.mode == DEGRADED else ""
        return (f"the cluster state did not load from etcd at {endpoints} (ETCD_ENDPOINTS) "
                f"within {timeout:g}s{why}")

    def _build_relay(self) -> Any:
        try:
            from eventsource.relay.lifecycle import Relay
        except ImportError:
            log.warning("event relay not available: events stay in the etcd outbox")
            return None
        assert self.event_log is not None
        assert self.redis_clients is not None
        relay_log, master = self.redis_clients.relay_log(self.event_log)
        return Relay(
            etcd=self.etcd, layout=self.layout, log=relay_log, metrics=self.metrics,
            clock=self.clock, max_entries=self.settings.redis_event_max_entries,
            ttl_ms=int(self.settings.redis_event_ttl_s * 1000),
            outbox_max=self.settings.event_outbox_max, instance_id=self.settings.instance_id,
            lease_ttl=self.settings.leader_lease_ttl_s,
            renew_deadline=self.settings.leader_renew_deadline_s,
            master=master, replicas=self.redis_clients.replica_wait(), tracer=self.tracer,
        )

    async def stop(self) -> None:
        """The shutdown order of the module docstring; every step has a deadline."""

        async def step(name: str, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> None:
            try:
                await asyncio.wait_for(coro, timeout)
            except TimeoutError:
                log.warning("shutdown step %s did not finish within %.0fs; going on", name,
                          timeout)

        self.gc_pauses.remove()
        if self.grpc.server is not None:
            await step("grpc", self.grpc.stop())
        await step("step-down", self.leader.step_down())
        await self.tasks.stop("leader", "relay", "dns")
        if self.dns is not None:
            await step("dns", self.dns.deregister())
        if self.relay is not None and hasattr(self.relay, "aclose"):
            await step("relay", self.relay.aclose())
        await step("batcher", self.batcher.aclose())
        await step("keepalives", self.keepalives.aclose())
        await step("dispatcher", self.dispatcher.aclose())
        await self.tasks.stop()
        if self.tailer is not None:
            await step("tailer", self.tailer.aclose())
        await step("agents", self.agents.close())
        if self.certs is not None:
            await step("certs", self.certs.aclose())
        if self.redis_clients is not None:
            await step("redis", self.redis_clients.aclose())
        if self.servicer.buckets is not None:
            await step("buckets", self.servicer.buckets.aclose())
        await step("http", self.http.stop())
        await step("committer", self.committer.aclose())
        self.etcd.close()
        # last: the spans of everything above are flushed (a deadline of its own)
        await self.tracing.aclose()
