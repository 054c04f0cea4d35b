"""Many simulated nodes in one process: building, starting and stopping a fleet.

Apart from the nodes and their control loop because this is the process-level job: node ids
and index ranges (several simulator processes with disjoint ranges make one fleet), the
per-node behaviour overrides, starting the servers in batches while the first batches already
register, stopping every task and server in order, the open-file limit a fleet needs, and the
JSON statistics the benchmark and ``GET /stats`` read.
"""

from __future__ import annotations

import asyncio
import logging
import random
import resource
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ops.sim.clock import DueHeap
from ops.sim.config import NodeBehaviour, SimTls
from ops.sim.control import ControlLoop
from ops.sim.counters import FleetCounters
from ops.sim.node import SimNode
from ops.sim.tracing import SimTracing

logger = logging.getLogger(__name__)


class Fleet:
    """N simulated nodes registering and heartbeating against one scheduler address.

    The control loop of each node follows the Go agent: RegisterNode, one Heartbeat right away,
    then one per interval (the scheduler's ``heartbeat_interval_seconds``, 10 s if 0, unless
    ``heartbeat_interval_s`` overrides it). A rejected or failed registration is retried after
    1 s, doubling to 30 s. A failed heartbeat re-registers at once after a good one, with the
    same backoff otherwise. Only after the first registration is the next heartbeat spread
    uniformly over one interval, so that a fleet started at once does not beat in lockstep.

    Args:
        scheduler: ``host:port`` of the scheduler's AgentControl service.
        count: number of nodes; ids are ``f"{prefix}{i:05d}"`` for i = first..first+count-1.
        first: the first node's index; several simulator processes with disjoint ranges make
            one fleet (its nodes are spread over the scheduler addresses by index, so the
            spread is the same as one process's).
        behaviour: shared by every node without an entry in ``behaviours``.
        behaviours: per-node overrides, by node id.
        heartbeat_interval_s: overrides the interval RegisterNode answers (tests).
        concurrency: control RPCs (register, heartbeat) in flight at most; None: one per node.
            With fewer, a slow scheduler stretches the fleet's heartbeat intervals (at 5,000
            nodes, 200 workers and 0.7 s answers give 300 heartbeats/s of the 500 due, and
            leases expired that real agents would have renewed).
        control_channels: channels (TCP connections) to the scheduler, shared round-robin.
        start_batch: servers started together.
        rpc_timeout_s: deadline of each control RPC.
        seed: seeds jitter and failure draws.
        tls: mTLS for the nodes' servers and the channels to the scheduler (None: plaintext).
        otlp_endpoint: export the nodes' server spans there (OTLP/HTTP, ``host:port`` or a
            URL; "" exports nothing), under the scheduler's spans (``ops.sim.tracing``).
    """

    def __init__(
        self,
        scheduler: str,
        *,
        count: int = 20,
        first: int = 1,
        prefix: str = "sim-node-",
        behaviour: NodeBehaviour | None = None,
        behaviours: Mapping[str, NodeBehaviour] | None = None,
        heartbeat_interval_s: float | None = None,
        concurrency: int | None = None,
        control_channels: int = 1,
        start_batch: int = 250,
        rpc_timeout_s: float = 10.0,
        seed: int | None = None,
        tls: SimTls | None = None,
        otlp_endpoint: str = "",
    ) -> None:
        if concurrency is None:
            concurrency = count
        if min(count, first, concurrency, control_channels, start_batch) < 1:
            raise ValueError(
                "count, first, concurrency, control_channels and start_batch must be >= 1")
        if heartbeat_interval_s is not None and heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        self.scheduler = scheduler
        #: "host:port[,host:port...]": each node keeps to one address (as an agent configured
        #: with one scheduler address does); nodes are spread over them round-robin
        addresses = [a.strip() for a in scheduler.split(",") if a.strip()]
        if not addresses:
            raise ValueError("scheduler: at least one HOST:PORT is required")
        control_channels = max(control_channels, len(addresses))
        self.counters = FleetCounters()
        self._clock = DueHeap(self.counters)
        self._rng = random.Random(seed)
        self._start_batch = start_batch
        self._control = ControlLoop(
            addresses,
            clock=self._clock,
            counters=self.counters,
            rng=self._rng,
            channels=control_channels,
            concurrency=concurrency,
            rpc_timeout_s=rpc_timeout_s,
            heartbeat_interval_s=heartbeat_interval_s,
            tls=tls,
        )
        default = behaviour if behaviour is not None else NodeBehaviour()
        overrides = behaviours or {}
        self.tracing = SimTracing(otlp_endpoint)
        interceptors = self.tracing.interceptors()
        nodes: list[SimNode] = []
        for i in range(first, first + count):
            node_id = f"{prefix}{i:05d}"
            node = SimNode(
                node_id,
                overrides.get(node_id, default),
                clock=self._clock,
                counters=self.counters,
                rng=self._rng,
                on_restart=self._on_restart,
                tls=tls,
                interceptors=interceptors,
            )
            node.control.slot = i % control_channels
            nodes.append(node)
        self._nodes = tuple(nodes)
        self._by_id = {n.node_id: n for n in nodes}
        self._started = False
        self._stopped = False
        #: Seconds start() took (servers up, registration scheduled).
        self.start_s = 0.0

    @property
    def nodes(self) -> tuple[SimNode, ...]:
        return self._nodes

    def node(self, node_id: str) -> SimNode:
        """The node with this id (KeyError if there is none)."""
        return self._by_id[node_id]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every server (in batches) and begin registering; return without waiting for
        registrations (see :meth:`wait_registered`). On failure everything started is stopped."""
        if self._started:
            raise RuntimeError("fleet already started")
        self._started = True
        loop = asyncio.get_running_loop()
        began = loop.time()
        self._warn_fd_limit()
        try:
            await self._start_all(loop)
        except BaseException:
            await self.stop()
            raise
        self.start_s = loop.time() - began
        logger.info("sim: %d nodes serving after %.2fs", len(self._nodes), self.start_s)

    async def _start_all(self, loop: asyncio.AbstractEventLoop) -> None:
        self._clock.start()
        self._control.open(loop)
        for i in range(0, len(self._nodes), self._start_batch):
            batch = self._nodes[i : i + self._start_batch]
            results = await asyncio.gather(*(n.start() for n in batch), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            # Register each batch at once: registration overlaps the start of the next batch.
            for node in batch:
                self._control.schedule(node, 0.0)

    async def stop(self) -> None:
        """Stop heartbeating, every server and the scheduler channels; await every task."""
        if self._stopped:
            return
        self._stopped = True
        await self._clock.stop()
        await self._control.stop_workers()
        for i in range(0, len(self._nodes), self._start_batch):
            await asyncio.gather(*(n.close() for n in self._nodes[i : i + self._start_batch]))
        await self._control.close_channels()
        await self.tracing.aclose()

    async def wait_registered(self) -> None:
        """Return once every running node is registered (wrap it in ``asyncio.timeout``)."""
        await self._control.wait_registered(self._nodes)

    def hold_control(self, held: bool) -> None:
        """Postpone every register and heartbeat while ``held`` (a control plane gone quiet).

        For tests whose injected state a heartbeat would repair before they observe it; the
        agents keep serving AgentService meanwhile.
        """
        self._control.hold(held)

    def _on_restart(self, node: SimNode) -> None:
        if self._started and not self._stopped:
            self._control.schedule(node, 0.0)

    def _warn_fd_limit(self) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = 2 * len(self._nodes) + 64
        if soft != resource.RLIM_INFINITY and soft < need:
            logger.warning(
                "sim: open-file limit %d is below the ~%d a %d-node fleet needs once a "
                "scheduler connects to every node (one listening socket + one connection each)",
                soft,
                need,
                len(self._nodes),
            )

    # -- statistics --------------------------------------------------------------------------

    def stats(self, *, per_node: bool = False) -> dict[str, Any]:
        """A JSON-ready snapshot of the fleet and its counters."""
        c = self.counters
        states: Counter[str] = Counter()
        over: list[str] = []
        registered = alive = 0
        for node in self._nodes:
            states.update(node.states())
            if node.over_capacity():
                over.append(node.node_id)
            if node.alive:
                alive += 1
                if node.control.registered:
                    registered += 1
        out: dict[str, Any] = {
            "nodes": len(self._nodes),
            "alive": alive,
            "registered": registered,
            "workloads_held": sum(states.values()),
            "workloads_by_state": dict(states),
            "rpcs": dict(c.rpcs),
            "applies": c.applies,
            "double_applies": c.double_applies,
            "double_applies_node_scope": c.double_applies_node_scope,
            "wrong_node_refused": c.wrong_node_refused,
            "max_term_seen": c.max_term_seen,
            "applies_by_term": {str(t): n for t, n in sorted(c.applies_by_term.items())},
            "over_capacity_nodes": len(over),
            "over_capacity_node_ids": over[:50],
            "control": dict(c.control),
            "internal_errors": c.internal_errors,
            "timers_pending": len(self._clock),
            "timer_lag_max_s": round(self._clock.max_lag_s, 4),
            "start_s": round(self.start_s, 3),
        }
        if per_node:
            out["per_node"] = {n.node_id: n.held for n in self._nodes}
        return out
