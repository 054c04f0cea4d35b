"""``python -m ops.benchlib.probe HOST:PORT``: GetClusterSummary every interval, one JSON line each.

Why a process of its own: ``bench attack`` runs hostile callers in the bench's event loop (500
watchers, a writer of 100,000 resets); a probe on that loop would measure the bench's own loop
lag as the scheduler's. Here the probe has its own interpreter and its own channel, and starts
a call every ``--interval`` seconds whether or not the previous one answered (a stalled
scheduler shows as several slow probes, not as one). Each line:
``{"t": wall-clock start, "ms": latency, "code": "OK" | grpc status name}``; a call that hit
``--timeout`` has ``"code": "DEADLINE_EXCEEDED"`` and ``ms`` equal to the timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from typing import Any

import grpc

from proto.persys.control.v1 import control_pb2, control_pb2_grpc


async def _probe(address: str, interval: float, timeout: float) -> None:
    channel = grpc.aio.insecure_channel(address)
    stub: Any = control_pb2_grpc.AgentControlStub(channel)  # type: ignore[no-untyped-call]
    pending: set[asyncio.Task[None]] = set()

    async def one() -> None:
        began_wall, began = time.time(), time.perf_counter()
        try:
            await stub.GetClusterSummary(control_pb2.GetClusterSummaryRequest(), timeout=timeout)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
        ms = (time.perf_counter() - began) * 1000.0
        if code == "DEADLINE_EXCEEDED":
            ms = timeout * 1000.0
        sys.stdout.write(json.dumps({"t": began_wall, "ms": round(ms, 3), "code": code}) + "\n")
        sys.stdout.flush()

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    start = loop.time()
    i = 0
    try:
        while not stop.is_set():
            task = asyncio.create_task(one())
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, start + i * interval - loop.time()))
        if pending:  # SIGTERM: the calls in flight answer or time out, and are printed
            await asyncio.wait(pending)
    finally:
        for task in pending:
            task.cancel()
        await channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("address")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    try:
        asyncio.run(_probe(args.address, args.interval, args.timeout))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
