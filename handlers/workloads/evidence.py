"""Evidence that an agent no longer holds a workload: before its state is removed.

Why apart: a delete is final only on evidence. An agent that answers a delete may still be
stopping the container or VM, and "not found" in an error's text may be about anything else
(Docker's "network persys-net not found"). So the dispatcher asks: ``gone`` reads the agent's
own answer (GetWorkloadStatus NOT_FOUND, or absent from its listing), and ``wait_gone`` asks
again every ``poll_s`` until it is gone, the agent stops answering, or ``wait_s`` passed,
as the Go scheduler did (``SCHEDULER_AGENT_STATUS_POLL_INTERVAL``,
``SCHEDULER_AGENT_DELETE_TIMEOUT``), so a deleted workload reads ``Deleting`` until then.
"""

from __future__ import annotations

import asyncio
import logging

from google.protobuf.message import DecodeError

from eventsource.clock import Clock
from handlers.agents.pool import AgentError, AgentPool
from proto.persys.agent.v1 import agent_pb2

log = logging.getLogger("persys.dispatch")


class AgentEvidence:
    def __init__(self, pool: AgentPool, *, clock: Clock, wait_s: float = 60.0,
                 poll_s: float = 1.0) -> None:
        self.pool = pool
        self.clock = clock
        self.wait_s = wait_s
        self.poll_s = poll_s

    async def gone(self, node_id: str, endpoint: str, workload_id: str) -> bool:
        """Whether the agent no longer holds the workload, on evidence only.

        ``GetWorkloadStatus`` answering ``NOT_FOUND`` is evidence. A Go agent answers a missing
        workload with a plain error (code UNKNOWN), so any other answer that is an error is
        checked against its ``ListWorkloads``: not listed means gone. An answer with a status
        (GetWorkloadStatus includes applies still in flight, which ListWorkloads does not),
        or an agent that does not answer, is not.
        """
        try:
            await self.pool.status(node_id, endpoint, workload_id)
            return False
        except AgentError as exc:
            if exc.not_found:
                return True
            if exc.unreachable:
                return False
        try:
            raw = await self.pool.list_workloads_raw(node_id, endpoint)
            listing = agent_pb2.ListWorkloadsResponse.FromString(raw)
        except (AgentError, DecodeError) as exc:
            log.info("agent listing not read workload_id=%s node_id=%s: %s", workload_id,
                     node_id, exc)
            return False
        return all(w.id != workload_id for w in listing.workloads)

    async def wait_gone(self, node_id: str, endpoint: str, workload_id: str) -> bool:
        """After a delete the agent accepted: ask until it is gone (True), or until the agent
        stops answering or ``wait_s`` passed (False: the state is removed anyway, as in Go,
        and the reconcile loop's drift check removes a copy left behind)."""
        deadline = self.clock.monotonic() + self.wait_s
        while True:
            try:
                await self.pool.status(node_id, endpoint, workload_id)
            except AgentError as exc:
                if exc.not_found:
                    return True
                if exc.unreachable:
                    return False
                if await self.gone(node_id, endpoint, workload_id):
                    return True
            if self.clock.monotonic() + self.poll_s > deadline:
                log.warning("agent still holds a deleted workload after %.0fs workload_id=%s "
                            "node_id=%s: its state is removed anyway", self.wait_s,
                            workload_id, node_id)
                return False
            await asyncio.sleep(self.poll_s)
