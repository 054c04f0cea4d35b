"""The ``persys-scheduler`` command.

    persys-scheduler serve [-insecure]      run one replica from the environment (as the Go binary)
    persys-scheduler -insecure              the same: the Go binary's bare form
    persys-scheduler dev [--nodes N] ...    private etcd + Redis + scheduler + simulated nodes
    persys-scheduler sim --scheduler H:P    a simulated fleet against any persys scheduler
    persys-scheduler bench SCENARIO ...     the benchmark (BENCH.md)
    persys-scheduler replay ...             rebuild projections and event views and compare
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from handlers.config import ConfigError, Settings, load_settings, require_tls_files
from handlers.logs import configure_logging


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def _serve(settings: Settings) -> int:
    from handlers.looplag import tune_gc

    tune_gc()  # this process is the scheduler: its heap is the projections
    return await run_replica(settings, _stop_event())


async def run_replica(settings: Settings, stop: asyncio.Event, *,
                      ready_timeout: float | None = None) -> int:
    """``serve``'s exit status: 0 when stopped (also while starting), 2 on invalid settings
    (an address it cannot listen on included), 1 when the replica could not start; the reason
    goes to stderr, never as a traceback."""
    from handlers.server import READY_TIMEOUT_S, ListenError, StartError, serve

    try:
        await serve(settings, stop,
                    ready_timeout=READY_TIMEOUT_S if ready_timeout is None else ready_timeout)
    except ConfigError as exc:  # settings read by the parts that need them (Vault, buckets)
        print(f"persys-scheduler: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:
        print(f"persys-scheduler: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except StartError as exc:
        print(f"persys-scheduler: not started: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(os.environ, insecure=args.insecure)
        require_tls_files(settings)
    except ConfigError as exc:
        print(f"persys-scheduler: invalid configuration: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    from handlers.eventloop import run

    return run(lambda: _serve(settings), settings.event_loop)


async def _dev(args: argparse.Namespace) -> int:
    from handlers.looplag import tune_gc
    from handlers.server import Scheduler
    from ops.devstack import EtcdProcess, RedisProcess
    from ops.sim import Fleet, NodeBehaviour

    tune_gc()
    # a directory of our own making is removed on exit; one the user named is kept
    owned_dir = not args.data_dir
    data_dir = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(
        prefix="persys-dev-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    stop = _stop_event()
    etcd = EtcdProcess()
    redis = RedisProcess()
    scheduler: Scheduler | None = None
    fleet: Fleet | None = None
    try:
        etcd.start(data_dir / "etcd")
        redis.start(data_dir / "redis", appendonly=True)
        env = dict(os.environ)
        env.update({
            "ETCD_ENDPOINTS": etcd.endpoint,
            "REDIS_ADDR": redis.addr,
            "PERSYS_GRPC_ADDR": "127.0.0.1",
            "SCHEDULER_HEARTBEAT_INTERVAL": env.get("SCHEDULER_HEARTBEAT_INTERVAL", "10"),
            "SCHEDULER_NODE_LEASE_TTL": env.get("SCHEDULER_NODE_LEASE_TTL", "30"),
            "LOG_FORMAT": env.get("LOG_FORMAT", "text"),
            "LOG_LEVEL": env.get("LOG_LEVEL", "warning"),
        })
        try:
            settings = load_settings(env, insecure=True)
        except ConfigError as exc:
            print(f"persys-scheduler dev: invalid configuration: {exc}", file=sys.stderr)
            return 2
        settings = settings.with_overrides(
            grpc_port=8085 if args.grpc_port is None else args.grpc_port,
            metrics_port=args.metrics_port,
        )
        configure_logging(settings.log_level, settings.log_format)
        scheduler = Scheduler(settings)
        await scheduler.start()
        address = f"127.0.0.1:{scheduler.grpc_port}"
        if args.nodes > 0:
            fleet = Fleet(address, count=args.nodes, behaviour=NodeBehaviour(), seed=1)
            await fleet.start()
            await asyncio.wait_for(fleet.wait_registered(), timeout=60)
        print(f"persys-scheduler dev: ready grpc={address} "
              f"metrics=127.0.0.1:{scheduler.http.port}", flush=True)
        await stop.wait()
        return 0
    finally:
        if fleet is not None:
            await fleet.stop()
        if scheduler is not None:
            await scheduler.stop()
        redis.stop()
        etcd.stop()
        if owned_dir:
            shutil.rmtree(data_dir, ignore_errors=True)


def cmd_dev(args: argparse.Namespace) -> int:
    from handlers.config import EVENT_LOOPS
    from handlers.eventloop import run

    event_loop = os.environ.get("SCHEDULER_EVENT_LOOP", "uvloop").strip().lower()
    if event_loop not in EVENT_LOOPS:
        print(f"persys-scheduler dev: invalid configuration: SCHEDULER_EVENT_LOOP: "
              f"{event_loop!r} is not 'uvloop' or 'asyncio'", file=sys.stderr)
        return 2
    return run(lambda: _dev(args), event_loop)


def cmd_sim(args: argparse.Namespace) -> int:
    from handlers.looplag import tune_gc
    from ops.sim import run_sim

    tune_gc()  # 5,000 simulated nodes are a large long-lived heap too: keep heartbeats on time

    configure_logging("warning", "text")
    return asyncio.run(run_sim(args))


def go_bool(text: str) -> bool:
    """A boolean flag value as Go's strconv.ParseBool reads it."""
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if text in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean value {text!r}")


def build_parser() -> argparse.ArgumentParser:
    from ops.confirm import add_confirm_arguments, cmd_confirm
    from ops.sim import add_sim_arguments

    parser = argparse.ArgumentParser(prog="persys-scheduler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one scheduler replica")
    serve.add_argument("-insecure", "--insecure", nargs="?", const=True, default=False,
                       type=go_bool, metavar="BOOL",
                       help="no mTLS on the gRPC server; agent TLS off by default (as Go's "
                            "flag: -insecure, -insecure=true, -insecure=false)")
    serve.set_defaults(func=cmd_serve)
    dev = sub.add_parser("dev", help="embedded etcd + Redis + scheduler + simulated nodes")
    dev.add_argument("--nodes", type=int, default=20)
    dev.add_argument("--grpc-port", type=int, default=None,
                     help="gRPC port (default 8085; 0 picks a free one)")
    dev.add_argument("--metrics-port", type=int, default=0,
                     help="HTTP port for /metrics and /health (default: a free one)")
    dev.add_argument("--data-dir", default=None, help="where etcd and Redis keep their data")
    dev.set_defaults(func=cmd_dev)
    sim = sub.add_parser("sim", help="a simulated fleet of compute agents")
    add_sim_arguments(sim)
    sim.set_defaults(func=cmd_sim)
    try:
        from ops.bench import add_bench_arguments, cmd_bench
    except ImportError:
        pass
    else:
        bench = sub.add_parser("bench", help="measure a scheduler (BENCH.md)")
        add_bench_arguments(bench)
        bench.set_defaults(func=cmd_bench)
    confirm = sub.add_parser("confirm-empty-state",
                             help="confirm that an empty cluster state is intended (ends "
                                  "recovery mode on every replica)")
    add_confirm_arguments(confirm)
    confirm.set_defaults(func=cmd_confirm)
    try:
        from ops.replay import add_replay_arguments, cmd_replay
    except ImportError:
        pass
    else:
        replay = sub.add_parser("replay", help="rebuild projections and event views")
        add_replay_arguments(replay)
        replay.set_defaults(func=cmd_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in ("-h", "--help")):
        args_list = ["serve", *args_list]
    parser = build_parser()
    args = parser.parse_args(args_list)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
