"""The event loop a scheduler process runs on (handlers/app/eventloop.py, SCHEDULER_EVENT_LOOP)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from handlers.app.eventloop import loop_factory, run
from handlers.settings.config import load_settings
from handlers.settings.reader import ConfigError


def test_the_setting_defaults_to_uvloop_and_names_a_bad_value() -> None:
    assert load_settings({}).event_loop == "uvloop"
    assert load_settings({"SCHEDULER_EVENT_LOOP": " AsyncIO "}).event_loop == "asyncio"
    with pytest.raises(ConfigError, match="SCHEDULER_EVENT_LOOP: 'trio' is not"):
        load_settings({"SCHEDULER_EVENT_LOOP": "trio"})


@pytest.mark.parametrize("name", ["uvloop", "asyncio"])
def test_run_gives_the_loop_asked_for(name: str) -> None:
    async def loop_module() -> str:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    module = run(loop_module, name)
    if name == "uvloop":
        assert module.startswith("uvloop"), module
    else:
        assert module.startswith("asyncio"), module
        assert loop_factory(name) == (None, "asyncio")


def test_grpc_aio_serves_and_calls_on_uvloop() -> None:
    """grpc.aio's poller wakes the loop through a socket; a unary and a streaming call work."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def main() -> tuple[int, int]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            await servicer.set("svc", health_pb2.HealthCheckResponse.SERVING)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                answer = await stub.Check(health_pb2.HealthCheckRequest(service="svc"),
                                          timeout=5)
                watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=5)
                first = await watch.read()
                await servicer.set("svc", health_pb2.HealthCheckResponse.NOT_SERVING)
                second = await watch.read()
                watch.cancel()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                return answer.status, second.status
        finally:
            await server.stop(None)

    assert run(main, "uvloop") == (health_pb2.HealthCheckResponse.SERVING,
                                   health_pb2.HealthCheckResponse.NOT_SERVING)


def test_dev_refuses_a_bad_event_loop_before_starting_anything() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", "dev", "--nodes", "0"],
        env={"SCHEDULER_EVENT_LOOP": "trio", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60, check=False, cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 2
    assert "SCHEDULER_EVENT_LOOP: 'trio' is not" in proc.stderr
