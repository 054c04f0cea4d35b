"""The registration/heartbeat client loop of every node of a fleet, as a Go agent runs it.

Apart from the fleet (``ops.sim.fleet``) because this is the one part that talks to the
scheduler: the channels to its ``AgentControl`` service, a fixed pool of worker tasks that take
one due control action (register or heartbeat) of one node at a time, and the Go agent's rules
for what comes next (backoff after a rejection, re-registration after a failed heartbeat or an
expired lease, the first heartbeat spread over one interval). Each node has at most one action
scheduled on the fleet's timer, queued or in flight.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import grpc

from ops.sim.clock import DueHeap, cancel_and_wait
from ops.sim.config import SimTls
from ops.sim.counters import FleetCounters
from ops.sim.node import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    REGISTER_BACKOFF_START_S,
    ControlState,
    SimNode,
)
from proto.persys.control.v1 import control_pb2_grpc

logger = logging.getLogger(__name__)

REGISTER_BACKOFF_MAX_S = 30.0
#: how often a held node checks whether its control loop may go on
HOLD_RECHECK_S = 0.5
#: The Go agent re-registers when no heartbeat answer refreshed its lease for this long.
AGENT_LEASE_S = 180.0


class ControlLoop:
    """Registers and heartbeats the nodes of one fleet over ``channels`` shared channels.

    Args:
        addresses: the scheduler's ``host:port`` addresses; channel ``i`` goes to address
            ``i % len(addresses)`` and a node uses the channel of its ``control.slot``.
        channels: how many channels (TCP connections) to open.
        concurrency: worker tasks, i.e. control RPCs in flight at most.
        rpc_timeout_s: deadline of each control RPC.
        heartbeat_interval_s: overrides the interval RegisterNode answers (None: use it).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        clock: DueHeap,
        counters: FleetCounters,
        rng: random.Random,
        channels: int,
        concurrency: int,
        rpc_timeout_s: float,
        heartbeat_interval_s: float | None,
        tls: SimTls | None,
    ) -> None:
        self._addresses = list(addresses)
        self._clock = clock
        self._counters = counters
        self._rng = rng
        self._channel_count = channels
        self._concurrency = concurrency
        self._rpc_timeout_s = rpc_timeout_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._tls = tls
        self._queue: asyncio.Queue[tuple[SimNode, int]] = asyncio.Queue()
        self._channels: list[Any] = []
        self._stubs: list[control_pb2_grpc.AgentControlStub] = []
        self._workers: list[asyncio.Task[None]] = []
        #: Set whenever a node registers (wakes wait_registered).
        self._registrations = asyncio.Event()
        #: while set, no node registers or heartbeats (tests that need the agents silent)
        self._held = False

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Open the channels to the scheduler and start the worker tasks."""
        for index in range(self._channel_count):
            address = self._addresses[index % len(self._addresses)]
            options = (("grpc.use_local_subchannel_pool", 1),)
            channel = (grpc.aio.secure_channel(address, self._tls.channel_credentials(),
                                               options=options)
                       if self._tls is not None
                       else grpc.aio.insecure_channel(address, options=options))
            self._channels.append(channel)
            stub = control_pb2_grpc.AgentControlStub(channel)  # type: ignore[no-untyped-call]
            self._stubs.append(stub)
        self._workers = [
            loop.create_task(self._worker(), name=f"sim-control-{i}")
            for i in range(self._concurrency)
        ]

    async def stop_workers(self) -> None:
        """Cancel and await the worker tasks (control RPCs in flight are abandoned)."""
        workers, self._workers = self._workers, []
        await cancel_and_wait(workers)

    async def close_channels(self) -> None:
        channels, self._channels = self._channels, []
        self._stubs = []
        for channel in channels:
            await channel.close()

    async def wait_registered(self, nodes: Iterable[SimNode]) -> None:
        """Return once every running node of ``nodes`` is registered."""
        while any(n.alive and not n.control.registered for n in nodes):
            self._registrations.clear()
            await self._registrations.wait()

    def hold(self, held: bool) -> None:
        """Postpone every register and heartbeat while ``held``."""
        self._held = held

    # -- scheduling --------------------------------------------------------------------------

    def schedule(self, node: SimNode, delay: float) -> None:
        """Run ``node``'s next control step after ``delay`` seconds (void if it restarts)."""
        self._clock.call_later(delay, partial(self._enqueue, node, node.control.gen))

    def _enqueue(self, node: SimNode, gen: int) -> None:
        if node.control.gen == gen and node.alive:
            self._queue.put_nowait((node, gen))

    async def _worker(self) -> None:
        while True:
            node, gen = await self._queue.get()
            if node.control.gen != gen or not node.alive:
                continue
            if self._held:
                self.schedule(node, HOLD_RECHECK_S)
                continue
            try:
                delay = await self._control_step(node, gen)
            except Exception:
                logger.exception("sim: control step failed for %s", node.node_id)
                self._counters.internal_errors += 1
                delay = REGISTER_BACKOFF_MAX_S
            if delay is not None and node.control.gen == gen:
                self.schedule(node, delay)

    # -- one step ----------------------------------------------------------------------------

    def _backoff(self, ctl: ControlState) -> float:
        delay = ctl.backoff_s
        ctl.backoff_s = min(delay * 2, REGISTER_BACKOFF_MAX_S)
        return delay

    async def _control_step(self, node: SimNode, gen: int) -> float | None:
        """Register if needed, then heartbeat; return the delay until the node's next step, or
        None when the node crashed or restarted meanwhile (its new generation is scheduled)."""
        ctl = node.control
        loop = asyncio.get_running_loop()
        stub = self._stubs[ctl.slot]
        counts = self._counters.control
        if not ctl.registered or loop.time() >= ctl.lease_deadline:
            ctl.registered = False
            accepted = False
            interval = 0
            try:
                answer = await stub.RegisterNode(
                    node.register_request(), timeout=self._rpc_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                counts["register_errors"] += 1
                counts[f"register_errors_{exc.code().name}"] += 1
                logger.debug("sim: RegisterNode %s failed: %s", node.node_id, exc.code())
            else:
                accepted = answer.accepted
                interval = answer.heartbeat_interval_seconds
                if not accepted:
                    counts["register_rejected"] += 1
                    logger.debug("sim: RegisterNode %s rejected: %s", node.node_id, answer.reason)
            if ctl.gen != gen:
                return None
            if not accepted:
                return self._backoff(ctl)
            counts["register_ok"] += 1
            ctl.registered = True
            self._registrations.set()
            ctl.heartbeat_ok = False
            ctl.interval_s = self._heartbeat_interval_s or float(
                interval or DEFAULT_HEARTBEAT_INTERVAL_S
            )
            ctl.lease_deadline = loop.time() + AGENT_LEASE_S
        try:
            reply = await stub.Heartbeat(node.heartbeat_request(), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            counts["heartbeat_errors"] += 1
            counts[f"heartbeat_errors_{exc.code().name}"] += 1
            logger.debug("sim: Heartbeat %s failed: %s", node.node_id, exc.code())
            if ctl.gen != gen:
                return None
            ctl.registered = False
            if ctl.heartbeat_ok:
                ctl.heartbeat_ok = False
                return 0.0
            return self._backoff(ctl)
        if ctl.gen != gen:
            return None
        counts["heartbeats_ok"] += 1
        if not reply.acknowledged:
            counts["heartbeats_unacknowledged"] += 1
        if reply.drain_node:
            counts["drain_requested"] += 1
        ctl.heartbeat_ok = True
        ctl.backoff_s = REGISTER_BACKOFF_START_S
        ctl.lease_deadline = loop.time() + AGENT_LEASE_S
        if ctl.first:
            ctl.first = False
            return self._rng.uniform(0.0, ctl.interval_s)
        return ctl.interval_s
