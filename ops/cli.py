"""The ``persys-scheduler`` command.

    persys-scheduler serve [-insecure]      run one replica from the environment (as the Go binary)
    persys-scheduler -insecure              the same: the Go binary's bare form
    persys-scheduler dev [--nodes N] ...    private etcd + Redis + scheduler + simulated nodes
    persys-scheduler sim --scheduler H:P    a simulated fleet against any persys scheduler
    persys-scheduler bench SCENARIO ...     the benchmark (docs/benchmark.md)
    persys-scheduler replay ...             rebuild projections and event views and compare
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from handlers.app.logs import configure_logging
from handlers.settings.config import Settings, load_settings, require_tls_files
from handlers.settings.reader import ConfigError


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def _serve(settings: Settings) -> int:
    from handlers.app.looplag import tune_gc

    tune_gc()  # this process is the scheduler: its heap is the projections
    return await run_replica(settings, _stop_event())


async def run_replica(settings: Settings, stop: asyncio.Event, *,
                      ready_timeout: float | None = None) -> int:
    """``serve``'s exit status: 0 when stopped (also while starting), 2 on invalid settings
    (an address it cannot listen on included), 1 when the replica could not start; the reason
    goes to stderr, never as a traceback."""
    from handlers.app.serve import serve
    from handlers.app.server import READY_TIMEOUT_S
    from handlers.app.start_errors import ListenError, StartError

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
    from handlers.app.eventloop import run

    return run(lambda: _serve(settings), settings.event_loop)


#: In a ``dev`` data directory: the ports its etcd and Redis listened on, which the next run
#: on that directory takes again. Why: the etcd member stored there advertises the peer URL of
#: its first run (a restarted member keeps it), and a client pointed at the stack keeps working.
DEV_PORTS_FILE = "dev-ports.json"
_DEV_PORT_KEYS = ("etcd_client", "etcd_peer", "redis")


class DevError(Exception):
    """``dev`` cannot go on; the message says why and what to do."""


def _saved_ports(data_dir: Path) -> dict[str, int]:
    """The ports saved in ``data_dir`` by an earlier run (empty for a fresh directory)."""
    path = data_dir / DEV_PORTS_FILE
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        if (data_dir / "etcd" / "member").exists():
            raise DevError(
                f"{data_dir / 'etcd'} holds an etcd member whose ports were not recorded (a run "
                f"before {DEV_PORTS_FILE} existed): remove {data_dir}, or give another "
                "--data-dir") from None
        return {}
    except (OSError, ValueError) as exc:
        raise DevError(f"{path}: unreadable ({exc}); remove {data_dir} or give another "
                       "--data-dir") from None
    if not (isinstance(saved, dict) and all(
            isinstance(saved.get(k), int) and 0 < saved[k] < 65536 for k in _DEV_PORT_KEYS)):
        raise DevError(f"{path}: not the ports of an earlier run; remove {data_dir} or give "
                       "another --data-dir")
    return {k: int(saved[k]) for k in _DEV_PORT_KEYS}


def _dev_settings(args: argparse.Namespace) -> Settings:
    """The scheduler's settings for ``dev`` (etcd and Redis addresses filled in later).

    Raises:
        ConfigError: an environment variable dev passes on is invalid.
    """
    env = dict(os.environ)
    env.update({
        "ETCD_ENDPOINTS": "127.0.0.1:2379",
        "REDIS_ADDR": "127.0.0.1:6379",
        "PERSYS_GRPC_ADDR": "127.0.0.1",
        "SCHEDULER_HEARTBEAT_INTERVAL": env.get("SCHEDULER_HEARTBEAT_INTERVAL", "10"),
        "SCHEDULER_NODE_LEASE_TTL": env.get("SCHEDULER_NODE_LEASE_TTL", "30"),
        "LOG_FORMAT": env.get("LOG_FORMAT", "text"),
        "LOG_LEVEL": env.get("LOG_LEVEL", "warning"),
    })
    grpc_port = 8085 if args.grpc_port is None else args.grpc_port
    settings = load_settings(env, insecure=True)
    return settings.with_overrides(
        grpc_port=grpc_port,
        metrics_port=args.metrics_port,
        # the SRV record's port follows --grpc-port (0: the port the system chose), unless
        # SCHEDULER_ADVERTISE_PORT says otherwise; load_settings took GRPC_PORT's 8085
        advertise_port=(settings.advertise_port if env.get("SCHEDULER_ADVERTISE_PORT")
                        else grpc_port),
    )


async def _dev(args: argparse.Namespace) -> int:
    from eventsource.racing import race
    from handlers.app.looplag import tune_gc
    from handlers.app.server import Scheduler
    from handlers.app.start_errors import ListenError, StartError
    from ops.devstack.etcd import EtcdProcess
    from ops.devstack.process import ServerStartError
    from ops.devstack.redis import RedisProcess
    from ops.sim.config import NodeBehaviour
    from ops.sim.fleet import Fleet

    try:  # before anything is started: a bad value leaves nothing behind
        settings = _dev_settings(args)
    except ConfigError as exc:
        print(f"persys-scheduler dev: invalid configuration: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    tune_gc()
    # a directory of our own making is removed on exit; one the user named is kept
    owned_dir = not args.data_dir
    data_dir = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(
        prefix="persys-dev-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    stop = _stop_event()
    etcd: EtcdProcess | None = None
    redis: RedisProcess | None = None
    scheduler: Scheduler | None = None
    fleet: Fleet | None = None
    try:
        try:
            ports = _saved_ports(data_dir)
            etcd = EtcdProcess()
            etcd.start(data_dir / "etcd", client_port=ports.get("etcd_client", 0),
                       peer_port=ports.get("etcd_peer", 0))
            redis = RedisProcess()
            redis.start(data_dir / "redis", port=ports.get("redis", 0), appendonly=True)
        except DevError as exc:
            print(f"persys-scheduler dev: {exc}", file=sys.stderr)
            return 1
        except ServerStartError as exc:
            hint = (f"\n(the ports are those of the earlier run, kept in "
                    f"{data_dir / DEV_PORTS_FILE}: is another dev running on this data "
                    "directory?)" if ports else "")
            print(f"persys-scheduler dev: {exc}{hint}", file=sys.stderr)
            return 1
        except RuntimeError as exc:  # no etcd or redis-server binary
            print(f"persys-scheduler dev: {exc}", file=sys.stderr)
            return 1
        (data_dir / DEV_PORTS_FILE).write_text(json.dumps(
            {"etcd_client": etcd.client_port, "etcd_peer": etcd.peer_port,
             "redis": redis.port}) + "\n")
        if stop.is_set():  # Ctrl-C while the servers started (that blocks the loop)
            return 0
        settings = settings.with_overrides(etcd_endpoints=(etcd.endpoint,),
                                           redis_addr=redis.addr)
        try:
            scheduler = Scheduler(settings)
            await scheduler.start(stop)
        except ConfigError as exc:  # settings read by the parts that need them
            print(f"persys-scheduler dev: invalid configuration: {exc}", file=sys.stderr)
            return 2
        except ListenError as exc:
            flag = {"GRPC_PORT": "--grpc-port", "METRICS_PORT": "--metrics-port"}.get(
                exc.variable)
            if flag is None:
                print(f"persys-scheduler dev: {exc}", file=sys.stderr)
            else:
                print(f"persys-scheduler dev: {exc.detail}; pass {flag} 0 to pick a free port",
                      file=sys.stderr)
            return 2
        except StartError as exc:
            print(f"persys-scheduler dev: not started: {exc}", file=sys.stderr)
            return 1
        if stop.is_set():
            return 0
        address = f"127.0.0.1:{scheduler.grpc_port}"
        if args.nodes > 0:
            fleet = Fleet(address, count=args.nodes, behaviour=NodeBehaviour(), seed=1)
            await fleet.start()
            try:
                registered, _ = await race(asyncio.wait_for(fleet.wait_registered(), 60), stop)
            except TimeoutError:
                print("persys-scheduler dev: the simulated nodes did not register within 60s",
                      file=sys.stderr)
                return 1
            if not registered:
                return 0
        print(f"persys-scheduler dev: ready grpc={address} "
              f"metrics=127.0.0.1:{scheduler.http.port} etcd={etcd.endpoint} "
              f"redis={redis.addr}", flush=True)
        await stop.wait()
        return 0
    finally:
        if fleet is not None:
            await fleet.stop()
        if scheduler is not None:
            await scheduler.stop()
        if redis is not None:
            redis.stop()
        if etcd is not None:
            etcd.stop()
        if owned_dir:
            shutil.rmtree(data_dir, ignore_errors=True)


def cmd_dev(args: argparse.Namespace) -> int:
    from handlers.app.eventloop import run
    from handlers.settings.config import EVENT_LOOPS

    event_loop = os.environ.get("SCHEDULER_EVENT_LOOP", "uvloop").strip().lower()
    if event_loop not in EVENT_LOOPS:
        print(f"persys-scheduler dev: invalid configuration: SCHEDULER_EVENT_LOOP: "
              f"{event_loop!r} is not 'uvloop' or 'asyncio'", file=sys.stderr)
        return 2
    return run(lambda: _dev(args), event_loop)


def cmd_sim(args: argparse.Namespace) -> int:
    from handlers.app.looplag import tune_gc
    from ops.sim.cli import run_sim

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
    from ops.sim.cli import add_sim_arguments

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
    dev.add_argument("--data-dir", default=None,
                     help="where etcd and Redis keep their data (default: a temporary directory, "
                          "removed on exit); a later run on the same directory keeps its state "
                          "and ports")
    dev.set_defaults(func=cmd_dev)
    sim = sub.add_parser("sim", help="a simulated fleet of compute agents")
    add_sim_arguments(sim)
    sim.set_defaults(func=cmd_sim)
    try:
        from ops.bench import add_bench_arguments, cmd_bench
    except ImportError:
        pass
    else:
        bench = sub.add_parser("bench", help="measure a scheduler (docs/benchmark.md)")
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
    try:
        parser = build_parser()
        args = parser.parse_args(args_list)
        result: int = args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C before a command installs its own handling (the imports take a second or
        # two), or one the command leaves to its caller; what it started it has stopped
        print("persys-scheduler: interrupted", file=sys.stderr)
        return 130
    return result


if __name__ == "__main__":
    raise SystemExit(main())
