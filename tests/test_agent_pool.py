"""The agent connection pool against a real gRPC server on loopback."""

from __future__ import annotations

import grpc
import pytest

from eventsource.metrics import Metrics
from handlers.agents.codes import go_code
from handlers.agents.pool import AgentError, AgentPool
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


def test_codes_are_labelled_as_grpc_go_names_them() -> None:
    """The Go version's ``code`` labels are grpc-go's ``codes.Code.String()``."""
    assert {code.value[0]: go_code(code) for code in grpc.StatusCode} == {
        0: "OK", 1: "Canceled", 2: "Unknown", 3: "InvalidArgument", 4: "DeadlineExceeded",
        5: "NotFound", 6: "AlreadyExists", 7: "PermissionDenied", 8: "ResourceExhausted",
        9: "FailedPrecondition", 10: "Aborted", 11: "OutOfRange", 12: "Unimplemented",
        13: "Internal", 14: "Unavailable", 15: "DataLoss", 16: "Unauthenticated"}


async def test_agent_calls_are_counted_with_go_code_names_under_the_go_families() -> None:
    answers = iter([None, grpc.StatusCode.FAILED_PRECONDITION])

    async def list_workloads(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        code = next(answers)
        if code is not None:
            await context.abort(code, "not now")
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "persys.agent.v1.AgentService",
        {"ListWorkloads": grpc.unary_unary_rpc_method_handler(list_workloads)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    metrics = Metrics()
    pool = AgentPool(metrics, instance_id="test", rpc_timeout=5.0, tls=None)
    try:
        await pool.list_workloads_raw("node-1", f"127.0.0.1:{port}")
        with pytest.raises(AgentError):
            await pool.list_workloads_raw("node-1", f"127.0.0.1:{port}")
    finally:
        await pool.close()
        await server.stop(None)

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(f"persys_scheduler_{name}", labels)

    for code in ("OK", "FailedPrecondition"):
        assert value("agent_rpc_requests_total", rpc="ListWorkloads", code=code) == 1, code
        assert value("agent_rpc_duration_seconds_count", rpc="ListWorkloads", code=code) == 1
    # the project's own family keeps grpc's names (the benchmark reads it)
    assert value("agent_rpcs_total", method="ListWorkloads", code="FAILED_PRECONDITION") == 1
