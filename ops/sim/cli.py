"""``persys-scheduler sim``: the command-line contract of a simulated fleet.

Apart from the fleet because this is the process around it (wired into ``persys-scheduler sim``
by ops/cli.py, and ``python -m ops.sim``): the options and their validation, the PEM files of
``--tls``, the open-file limit, the signals that stop it, the JSON ready/stopped lines a parent
process reads, and the periodic one-line summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
from pathlib import Path

from ops.sim.config import NodeBehaviour, SimTls
from ops.sim.fleet import Fleet
from ops.sim.node import HOST
from ops.sim.stats import StatsServer

logger = logging.getLogger(__name__)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {value}")
    return value


def _read_tls(paths: list[str] | None) -> SimTls | None:
    if paths is None:
        return None
    try:
        ca, cert, key = (Path(p).read_bytes() for p in paths)
    except OSError as exc:
        raise SystemExit(f"sim: --tls: {exc}") from None
    return SimTls(ca=ca, cert=cert, key=key)


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``sim`` options to ``parser`` (read back by :func:`run_sim`)."""
    parser.add_argument(
        "--scheduler", required=True, metavar="HOST:PORT[,HOST:PORT...]",
        help="the scheduler's gRPC address; several spread the nodes over the replicas"
    )
    parser.add_argument("--nodes", type=_positive_int, default=20, help="nodes (default 20)")
    parser.add_argument(
        "--apply-latency",
        type=_non_negative_float,
        default=0.2,
        metavar="SECONDS",
        help="delay before an applied workload runs (default 0.2)",
    )
    parser.add_argument(
        "--failure-rate",
        type=_probability,
        default=0.0,
        help="probability that an apply ends FAILED (default 0)",
    )
    parser.add_argument(
        "--slow-answer",
        type=_non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="extra delay on every agent RPC (default 0)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="override the interval the scheduler answers at registration",
    )
    parser.add_argument(
        "--first-index",
        type=_positive_int,
        default=1,
        metavar="I",
        help="index of the first node id (default 1); processes with disjoint ranges are one fleet",
    )
    parser.add_argument("--prefix", default="sim-node-", help="node id prefix (default sim-node-)")
    parser.add_argument(
        "--tls", nargs=3, default=None, metavar=("CA", "CERT", "KEY"),
        help="PEM files for mTLS both ways, as a Go agent has (its certificate must name "
             "127.0.0.1); default: plaintext, for a scheduler started with -insecure",
    )
    parser.add_argument(
        "--cpu", type=_positive_int, default=8000, help="millicores per node (default 8000)"
    )
    parser.add_argument(
        "--memory", type=_positive_int, default=16384, help="MiB per node (default 16384)"
    )
    parser.add_argument(
        "--concurrency",
        type=_positive_int,
        default=None,
        help="control RPCs in flight at most (default: one per node, like real agents)",
    )
    parser.add_argument(
        "--control-channels",
        type=_positive_int,
        default=1,
        help="connections to the scheduler (default 1)",
    )
    parser.add_argument(
        "--no-usage",
        action="store_true",
        help="leave per-workload usage snapshots out of heartbeats",
    )
    parser.add_argument(
        "--stats-port",
        type=_non_negative_int,
        default=0,
        help="serve GET /stats as JSON on 127.0.0.1:PORT (default 0: off)",
    )
    parser.add_argument(
        "--report-every",
        type=_non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="log a one-line summary this often (default 10; 0: never)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for jitter and failures")
    parser.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("PERSYS_OTLP_ENDPOINT", ""),
        metavar="HOST:PORT|URL",
        help="export the agents' server spans over OTLP/HTTP, under the scheduler's spans "
             "(default $PERSYS_OTLP_ENDPOINT, the Go agent's variable; empty: off)",
    )


def _raise_fd_limit(nodes: int) -> None:
    """Raise the soft open-file limit towards the hard one if the fleet may need it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * nodes + 256
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        logger.info("sim: raised the open-file soft limit from %d to %d", soft, target)


async def run_sim(args: argparse.Namespace) -> int:
    """Run a fleet until SIGINT/SIGTERM, then stop it cleanly; return the exit code.

    Prints one JSON line when the fleet is serving (``{"event": "sim_ready", ...}``) and one
    with the final statistics when it stopped (``{"event": "sim_stopped", "stats": ...}``).
    """
    behaviour = NodeBehaviour(
        apply_latency_s=args.apply_latency,
        failure_rate=args.failure_rate,
        slow_answer_s=args.slow_answer,
        cpu_millicores=args.cpu,
        memory_mb=args.memory,
        report_usage=not args.no_usage,
    )
    _raise_fd_limit(args.nodes)
    fleet = Fleet(
        args.scheduler,
        count=args.nodes,
        first=args.first_index,
        prefix=args.prefix,
        behaviour=behaviour,
        heartbeat_interval_s=args.heartbeat_interval,
        concurrency=args.concurrency,
        control_channels=args.control_channels,
        seed=args.seed,
        tls=_read_tls(args.tls),
        otlp_endpoint=args.otlp_endpoint,
    )
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stopping.set)
    stats_server: StatsServer | None = None
    try:
        await fleet.start()
        stats_port = 0
        if args.stats_port:
            stats_server = StatsServer(fleet)
            stats_port = await stats_server.start(args.stats_port)
        ports = [n.port for n in fleet.nodes]
        ready = {
            "event": "sim_ready",
            "nodes": len(ports),
            "ports": [min(ports), max(ports)],
            "start_s": round(fleet.start_s, 3),
            "stats_url": f"http://{HOST}:{stats_port}/stats" if stats_port else None,
        }
        print(json.dumps(ready), flush=True)
        while not stopping.is_set():
            if args.report_every <= 0:
                await stopping.wait()
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(args.report_every):
                    await stopping.wait()
            s = fleet.stats()
            logger.info(
                "sim: %d/%d registered, %d workloads held, %d applies, %d over capacity, "
                "%d double applies, %d wrong-node refusals",
                s["registered"],
                s["nodes"],
                s["workloads_held"],
                s["applies"],
                s["over_capacity_nodes"],
                s["double_applies"],
                s["wrong_node_refused"],
            )
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
        if stats_server is not None:
            await stats_server.close()
        final = fleet.stats()  # before stopping: "alive" and "registered" still mean something
        await fleet.stop()
    print(json.dumps({"event": "sim_stopped", "stats": final}), flush=True)
    return 0
