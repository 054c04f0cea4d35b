"""The agent connection pool against a real gRPC server on loopback."""

from __future__ import annotations

import grpc

from eventsource.metrics import Metrics
from handlers.agents import AgentPool
from proto.persys.agent.v1 import agent_pb2

BIG_MIB = 12


async def test_a_large_listing_arrives_without_bandwidth_probing() -> None:
    """Agent channels run without BDP probing (small calls cost less CPU); flow control must
    still carry an answer far larger than its initial 64 KiB window."""
    response = agent_pb2.ListWorkloadsResponse(workloads=[
        agent_pb2.WorkloadStatus(id=f"w-{i:06d}", message="x" * 1024)
        for i in range(BIG_MIB * 1024)])
    body = response.SerializeToString()

    async def list_workloads(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return body

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "persys.agent.v1.AgentService",
        {"ListWorkloads": grpc.unary_unary_rpc_method_handler(list_workloads)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = AgentPool(Metrics(), instance_id="test", rpc_timeout=20.0, tls=None)
    try:
        for _ in range(2):  # a second call reuses the pooled channel
            raw = await pool.list_workloads_raw("node-1", f"127.0.0.1:{port}")
            assert len(raw) > BIG_MIB * 1024 * 1024
            assert raw == body
    finally:
        await pool.close()
        await server.stop(None)
