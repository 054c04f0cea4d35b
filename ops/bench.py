"""``persys-scheduler bench SCENARIO [options] [--json]``: the benchmark (docs/benchmark.md).

It measures a running system the way an operator would: through the gRPC API, the simulated
agents' own counters, an etcd watch, the scheduler's ``/metrics`` and ``/proc``; never through
private hooks. Without ``--scheduler`` it starts everything itself (private etcd and Redis,
``--replicas`` ``persys-scheduler serve -insecure`` processes, a ``persys-scheduler sim``
process) and stops all of it at the end, also on Ctrl-C or failure. With ``--scheduler`` (and
``--metrics``, ``--etcd``) it measures that system and starts only the simulated fleet; a figure
it cannot get is null with the reason in ``notes``.

Output: a table, and with ``--json`` a last line that is exactly one JSON object
``{"scenario", "nodes", "workloads", "replicas", "figures", "notes"}``.

Examples::

    persys-scheduler bench place --json
    persys-scheduler bench place --nodes 5000 --workloads 100000 --clients 32 --json
    persys-scheduler bench reconcile --nodes 1000 --workloads 20000
    persys-scheduler bench churn --nodes 100 --workloads 1000
    persys-scheduler bench place --scheduler 10.0.0.5:8085 --metrics 10.0.0.5:8084 \\
        --etcd http://10.0.0.5:2379
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

from handlers.app.eventloop import run as run_loop
from ops.benchlib.attack import ATTACKS, DEFAULT_REQUESTS, DEFAULT_SIZE
from ops.benchlib.clients import ApiClients
from ops.benchlib.profile import Profiler
from ops.benchlib.registry import SCENARIOS
from ops.benchlib.scenario import PEAK_RSS, BenchContext, MissingRpcs, Outcome, Scenario
from ops.benchlib.stack import (
    DEFAULT_NODE_PREFIX,
    NODES_PER_SIM_PROCESS,
    Stack,
    StackError,
    StackOptions,
)
from ops.benchlib.workloads import run_prefix
from ops.devstack.process import ServerStartError

__all__ = ["add_bench_arguments", "apply_defaults", "cmd_bench"]


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


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _addresses(text: str) -> list[str]:
    out = [a.strip() for a in text.split(",") if a.strip()]
    for address in out:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"{address!r} is not HOST:PORT")
    if not out:
        raise argparse.ArgumentTypeError("no address given")
    return out


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options (docs/benchmark.md), and the knobs of the stack it starts."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("scenario", choices=sorted(SCENARIOS),
                        help="; ".join(f"{s.name}: {s.summary}" for s in SCENARIOS.values())
                        .replace("%", "%%"))  # argparse formats help with %
    size = parser.add_argument_group("sizes")
    size.add_argument("--nodes", type=_positive_int, default=100,
                      help="simulated nodes (default 100)")
    size.add_argument("--workloads", type=_positive_int, default=1000,
                      help="workloads to apply (default 1000)")
    size.add_argument("--clients", type=_positive_int, default=16,
                      help="concurrent API callers, spread over the replicas (default 16)")
    size.add_argument("--replicas", type=_positive_int, default=None,
                      help="scheduler processes: active-active shards in place, reconcile, "
                           "churn and events; replicas of one shard in failover (default 1; "
                           "failover: 2, the fewest it can kill a leader among)")
    size.add_argument("--seed", type=int, default=1, help="seed of sizes and choices (default 1)")
    size.add_argument("--cycles", type=_positive_int, default=3,
                      help="reconcile: steady cycles to observe per replica (default 3)")
    size.add_argument("--recovery-timeout", type=_positive_float, default=None, metavar="S",
                      help="churn: give up waiting for recovery after S seconds "
                           "(default: 3 reconcile intervals + 1 heartbeat interval, >= 20)")
    size.add_argument("--burst-size", type=_positive_int, default=20, metavar="N",
                      help="pending: slots freed per burst (--cycles bursts; default 20)")
    size.add_argument("--kills", type=_positive_int, default=3,
                      help="failover: leader kills (default 3)")
    size.add_argument("--lease-ttl", type=_positive_int, default=15,
                      help="failover: leader lease TTL in seconds (default 15)")
    size.add_argument("--fault", choices=("kill", "pause"), default="kill",
                      help="failover: SIGKILL the leader and start it again (kill, default), or "
                           "SIGSTOP it past its lease and resume it once a standby leads "
                           "(pause: counts stale_leader_writes)")
    size.add_argument("--watchers", type=_positive_int, default=20,
                      help="events: WatchEvents clients (default 20)")
    size.add_argument("--rate", type=_positive_float, default=200.0,
                      help="events: tagged events per second (default 200)")
    hostile = parser.add_argument_group("attack: one hostile caller against the scheduler")
    hostile.add_argument("--attack", choices=ATTACKS, default=None,
                         help="attack: which hostile caller (required there): nonreading "
                              "callers (nonreading-window: windows kept closed), stream "
                              "resets, watchers, a heartbeat flood")
    hostile.add_argument("--attack-size", type=_positive_int, default=None, metavar="N",
                         help="attack: callers, streams, watchers or flood nodes (default: "
                              + ", ".join(f"{k} {v:,}" for k, v in DEFAULT_SIZE.items()) + ")")
    hostile.add_argument("--attack-requests", type=_positive_int, default=DEFAULT_REQUESTS,
                         metavar="K", help="attack nonreading-window: ListNodes requests each "
                         f"caller sends at once (default {DEFAULT_REQUESTS})")
    hostile.add_argument("--attack-duration", type=_positive_float, default=30.0, metavar="S",
                         help="attack: how long the attack lasts at least (default 30)")
    hostile.add_argument("--attack-quiet", type=_positive_float, default=10.0, metavar="S",
                         help="attack: the probe's quiet baseline before and after the attack "
                              "(default 10 each)")
    stack = parser.add_argument_group("the stack the bench starts")
    stack.add_argument("--heartbeat-interval", type=_positive_int, default=10, metavar="S",
                       help="SCHEDULER_HEARTBEAT_INTERVAL of the schedulers started (default 10)")
    stack.add_argument("--reconcile-interval", type=_positive_float, default=5.0, metavar="S",
                       help="SCHEDULER_RECONCILE_INTERVAL of the schedulers started (default 5); "
                            "against --scheduler, tell the bench the target's interval")
    stack.add_argument("--reapply-guard", type=_positive_float, default=15.0, metavar="S",
                       help="SCHEDULER_REAPPLY_GUARD of the schedulers started (default 15, the "
                            "scheduler's floor); churn kills only after it elapsed since the "
                            "last apply. Against --scheduler, tell the bench the target's guard")
    stack.add_argument("--apply-latency", type=_non_negative_float, default=0.2, metavar="S",
                       help="simulated agents: delay from PENDING to RUNNING (default 0.2)")
    stack.add_argument("--sim-processes", type=_non_negative_int, default=0, metavar="K",
                       help="simulator processes sharing the fleet (default 0: one per "
                            f"{NODES_PER_SIM_PROCESS:,} nodes; failover: always one), so that one "
                            "process's event loop answering every ListWorkloads is not what the "
                            "bench measures")
    stack.add_argument("--trace-endpoint", default="", metavar="HOST:PORT|URL|jaeger",
                       help="export the started schedulers' traces over OTLP/HTTP there "
                            "(OTEL_EXPORTER_OTLP_ENDPOINT); 'jaeger' starts a private Jaeger "
                            "(once built by ops/jaeger.py). Default: no export, whatever the "
                            "bench's own environment says")
    stack.add_argument("--keep", action="store_true",
                       help="keep the run's directory (logs, etcd and Redis data); a run whose "
                            "start failed keeps it anyway, an interrupted one removes it")
    stack.add_argument("--profile", default="", metavar="DIR",
                       help="sample every scheduler process with py-spy (pip install py-spy) "
                            "while the scenario runs; raw stacks go to DIR, the busiest "
                            "functions to notes['profile']")
    target = parser.add_argument_group("an existing target (the bench then starts only the fleet)")
    target.add_argument("--scheduler", type=_addresses, default=None, metavar="HOST:PORT[,...]",
                        help="gRPC address(es) of a running persys-compatible scheduler on this "
                             "machine; the bench's nodes get ids of their own "
                             "(bench-<run>-node-NNNNN), so nodes it already has (a dev stack's "
                             "sim-node-NNNNN) are left alone")
    target.add_argument("--metrics", type=_addresses, default=None, metavar="HOST:PORT[,...]",
                        help="its /metrics address(es)")
    target.add_argument("--scheduler-pid", type=int, action="append", default=[], metavar="PID",
                        help="its process id(s), for RSS and CPU (repeatable)")
    target.add_argument("--etcd", default="", metavar="URL",
                        help="its etcd (http://HOST:PORT), for the write-counting watch")
    target.add_argument("--etcd-root", default="", metavar="PREFIX",
                        help="its SCHEDULER_ETCD_ROOT (default '')")
    parser.add_argument("--json", action="store_true",
                        help="end the output with one JSON line (docs/benchmark.md)")


def apply_defaults(args: argparse.Namespace, scenario: Scenario) -> None:
    """Fill in the defaults that depend on the scenario (``--replicas``)."""
    if args.replicas is None:
        args.replicas = scenario.min_replicas


def _stack_options(args: argparse.Namespace, scenario: Scenario, *,
                   run: str = "bench") -> StackOptions:
    """``run`` (unique per run) names the nodes of a fleet sent to an existing scheduler."""
    return StackOptions(
        nodes=args.nodes,
        replicas=len(args.scheduler) if args.scheduler else args.replicas,
        ha=scenario.ha,
        heartbeat_interval_s=args.heartbeat_interval,
        reconcile_interval_s=args.reconcile_interval,
        reapply_guard_s=args.reapply_guard,
        apply_latency_s=args.apply_latency,
        sim_processes=args.sim_processes,
        seed=args.seed,
        fleet_in_process=scenario.fleet_in_process,
        scheduler_addrs=list(args.scheduler or []),
        metrics_addrs=list(args.metrics or []),
        scheduler_pids=list(args.scheduler_pid),
        etcd_url=args.etcd,
        etcd_root=args.etcd_root,
        keep=args.keep,
        lease_ttl_s=args.lease_ttl,
        node_prefix=f"{run}-node-" if args.scheduler else DEFAULT_NODE_PREFIX,
        trace_endpoint=args.trace_endpoint,
    )


def _check(outcome: Outcome, scenario: Scenario) -> Outcome:
    """Every declared figure present (missing ones null with a note), nothing else."""
    extra = set(outcome.figures) - set(scenario.figures)
    if extra:
        raise AssertionError(f"{scenario.name} returned undeclared figures {sorted(extra)}")
    figures: dict[str, Any] = {}
    for key in scenario.figures:
        value = outcome.figures.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            outcome.note(key, f"not a finite number ({value})")
            value = None
        if value is None and key not in outcome.notes:
            outcome.notes[key] = "not measured in this run"
        figures[key] = value
    outcome.figures = figures
    return outcome


async def _run(args: argparse.Namespace, scenario: Scenario) -> Outcome:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    if main is not None:
        # SIGTERM ends the run like Ctrl-C: the task is cancelled and the finally blocks stop
        # every process the stack started
        loop.add_signal_handler(signal.SIGTERM, main.cancel)
    prefix = run_prefix()
    stack = Stack(_stack_options(args, scenario, run=prefix))
    api: ApiClients | None = None
    profiler: Profiler | None = None
    try:
        print(f"bench: starting {scenario.name}: {args.nodes} nodes, "
              f"{stack.options.replicas} replica(s)"
              + (" (existing scheduler)" if stack.options.external else ""),
              file=sys.stderr, flush=True)
        await stack.start()
        api = ApiClients(stack.grpc_addrs)
        ctx = BenchContext(args=args, stack=stack, api=api, prefix=prefix)
        if args.profile:
            profiler = Profiler(Path(args.profile), stack.scheduler_pids)
            profiler.start()
        try:
            outcome = await scenario.run(ctx)
        finally:
            profiled = profiler.stop() if profiler is not None else ""
        if profiled:
            outcome.notes["profile"] = profiled
        if PEAK_RSS in scenario.figures and outcome.figures.get(PEAK_RSS) is None:
            ctx.peak_rss.fill(outcome, stack.scheduler_pids)
        if stack.trace_endpoint:
            outcome.notes["traces"] = f"exported to {stack.trace_endpoint} (OTLP/HTTP)"
        if stack.options.external and not stack.options.metrics_addrs:
            outcome.notes.setdefault("metrics", "no --metrics given: scheduler-side figures null")
        return _check(outcome, scenario)
    finally:
        try:
            if api is not None:
                await api.close()
        finally:
            await stack.stop()
            loop.remove_signal_handler(signal.SIGTERM)


def _format(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".")
    return f"{value:,}" if isinstance(value, int) else str(value)


def render_table(result: dict[str, Any]) -> str:
    """The human table: one row per figure, then the notes."""
    lines = [f"{result['scenario']}: {result['nodes']} nodes, {result['workloads']} workloads, "
             f"{result['replicas']} replica(s)"]
    width = max(len(k) for k in result["figures"])
    censored = set(result["notes"].get("censored", "").split(", "))
    for key, value in result["figures"].items():
        shown = ("> " if key in censored else "") + _format(value)
        lines.append(f"  {key:<{width}}  {shown:>14}")
    if result["notes"]:
        lines.append("notes:")
        lines.extend(f"  {key}: {text}" for key, text in result["notes"].items())
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one scenario; 0 when it ran (whatever it measured), 1 on failure, 2 on misuse, 3
    when the target lacks an RPC the scenario needs."""
    scenario = SCENARIOS[args.scenario]
    apply_defaults(args, scenario)
    if args.scheduler and scenario.kills_processes:
        print(f"persys-scheduler bench: {scenario.name} kills scheduler processes; it refuses to "
              "run against --scheduler (a system it did not start)", file=sys.stderr)
        return 2
    if not args.scheduler and args.replicas < scenario.min_replicas:
        print(f"persys-scheduler bench: {scenario.name} needs --replicas "
              f"{scenario.min_replicas} or more, not {args.replicas} ({scenario.name}: "
              f"{scenario.summary})", file=sys.stderr)
        return 2
    if scenario.ha == "failover" and args.sim_processes > 1:
        print(f"persys-scheduler bench: {scenario.name} runs the fleet in one process: its "
              "double_applies compares every apply with the newest term any node has seen "
              "(--sim-processes must be 0 or 1)", file=sys.stderr)
        return 2
    if (scenario.name == "attack") != (args.attack is not None):
        print("persys-scheduler bench: --attack KIND goes with the attack scenario, and only "
              f"with it ({', '.join(ATTACKS)})", file=sys.stderr)
        return 2
    if args.metrics and args.scheduler and len(args.metrics) != len(args.scheduler):
        print("persys-scheduler bench: give one --metrics address per --scheduler address",
              file=sys.stderr)
        return 2
    if args.metrics and not args.scheduler:
        print("persys-scheduler bench: --metrics needs --scheduler", file=sys.stderr)
        return 2
    if args.trace_endpoint and args.scheduler:
        print("persys-scheduler bench: --trace-endpoint configures the schedulers it starts, "
              "not --scheduler's", file=sys.stderr)
        return 2
    try:
        outcome = run_loop(lambda: _run(args, scenario), "uvloop")
    except KeyboardInterrupt:
        print("persys-scheduler bench: interrupted; everything it started is stopped",
              file=sys.stderr)
        return 130
    except asyncio.CancelledError:
        print("persys-scheduler bench: terminated; everything it started is stopped",
              file=sys.stderr)
        return 143
    except (StackError, ServerStartError) as exc:
        print(f"persys-scheduler bench: the system under test failed: {exc}", file=sys.stderr)
        return 1
    except MissingRpcs as exc:
        print(f"persys-scheduler bench: {exc}; nothing was measured", file=sys.stderr)
        return 3
    result = {
        "scenario": scenario.name,
        "nodes": args.nodes,
        "workloads": args.workloads if scenario.uses_workloads else 0,
        "replicas": len(args.scheduler) if args.scheduler else args.replicas,
        "figures": outcome.figures,
        "notes": outcome.notes,
    }
    print(render_table(result), flush=True)
    if args.json:
        print(json.dumps(result, separators=(", ", ": ")), flush=True)
    return 0
