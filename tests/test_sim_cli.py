"""The ``persys-scheduler sim`` contract (ops/sim/cli.py): its options, and a run that stops
cleanly on SIGTERM after printing its ready and stopped lines."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal

import pytest

from ops.sim.cli import add_sim_arguments, run_sim
from tests.fixtures.fakecontrol import start_control
from tests.fixtures.waiting import wait_for


def test_sim_arguments_defaults_and_validation() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(["--scheduler", "127.0.0.1:50051"])
    assert args.nodes == 20
    assert args.apply_latency == 0.2
    assert args.failure_rate == 0.0
    assert args.heartbeat_interval is None
    assert args.prefix == "sim-node-"
    assert args.first_index == 1
    assert (args.cpu, args.memory) == (8000, 16384)
    assert args.stats_port == 0
    assert args.seed is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduler", "x:1", "--failure-rate", "1.5"])
    with pytest.raises(SystemExit):
        parser.parse_args([])


async def test_run_sim_stops_cleanly_on_sigterm(capsys: pytest.CaptureFixture[str]) -> None:
    before = asyncio.all_tasks()
    fake, control_server, address = await start_control()
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(
        [
            "--scheduler",
            address,
            "--nodes",
            "2",
            "--prefix",
            "cli-",
            "--heartbeat-interval",
            "0.05",
            "--report-every",
            "0.05",
            "--seed",
            "3",
        ]
    )
    runner = asyncio.get_running_loop().create_task(run_sim(args))
    output: list[str] = []

    def ready() -> bool:
        output.append(capsys.readouterr().out)
        return '"sim_ready"' in "".join(output)

    try:
        await wait_for(ready, message="sim_ready line")
        await wait_for(lambda: len(set(fake.registered_ids())) == 2, message="cli registered")
        os.kill(os.getpid(), signal.SIGTERM)  # run_sim's handler is installed before sim_ready
        async with asyncio.timeout(10):
            assert await runner == 0
    finally:
        if not runner.done():
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await control_server.stop(0)
    output.append(capsys.readouterr().out)
    lines = [json.loads(line) for line in "".join(output).splitlines() if line.startswith("{")]
    assert lines[0]["event"] == "sim_ready"
    assert lines[0]["nodes"] == 2
    assert lines[-1]["event"] == "sim_stopped"
    assert lines[-1]["stats"]["nodes"] == 2
    assert set(fake.registered_ids()) == {"cli-00001", "cli-00002"}
    assert asyncio.all_tasks() - before == set()
