"""The system under test: started by the bench, or pointed at, and always stopped.

Why a separate simulator process: a scheduler holding 5,000 agent channels and a 5,000-node
fleet in one process would sit near this machine's 20,000 open-file limit (measured), and
the CPU each side burns would be indistinguishable. So by default the fleet is
``persys-scheduler sim --stats-port P`` in its own process and the bench reads its counters over
``GET /stats``. A large fleet is several such processes with disjoint node ranges (one per
``NODES_PER_SIM_PROCESS`` nodes unless ``--sim-processes`` says otherwise): in production every
agent answers ListWorkloads on its own host, while one simulator process answering 5,000 of
them per reconcile cycle spends 3.3 s of one core and would be what the bench measures.
A scenario that must act on agents directly (``churn`` kills workloads, which ``/stats``
cannot do) runs the fleet in the bench process instead (``fleet_in_process``).

What the bench starts (private etcd and Redis from ``ops.devstack``, ``--replicas`` scheduler
processes, the fleet) it stops in reverse order in ``stop()``, which is safe to call after any
partial ``start()``; the caller calls it in a ``finally``. Children run in their own sessions,
so a Ctrl-C at the terminal reaches the bench only.

Against an existing scheduler (``--scheduler``) only the fleet is started; its agents listen on
127.0.0.1, so that scheduler must run on this machine. Its nodes then get ids of their own
(``StackOptions.node_prefix``, unique to the run): with the simulator's default ids they would
re-register the target's own simulated nodes (a ``dev`` stack's ``sim-node-00001`` ...) at the
bench's agents, which go away when the bench ends.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from ops.benchlib.fleetstats import merge_fleet_stats
from ops.benchlib.httpget import HttpError, get_json, http_get
from ops.benchlib.procs import Child
from ops.benchlib.promtext import MetricsSnapshot
from ops.devstack.etcd import EtcdProcess
from ops.devstack.process import free_port
from ops.devstack.redis import RedisProcess
from proto.persys.control.v1 import control_pb2

if TYPE_CHECKING:
    from ops.benchlib.clients import ApiClients

HOST = "127.0.0.1"
#: Extra start-up allowance per simulated node (5,000 nodes register in minutes, not seconds,
#: when the scheduler is the bottleneck).
STARTUP_PER_NODE_S = 0.05
#: Nodes per simulator process when the bench picks the count.
NODES_PER_SIM_PROCESS = 2500
#: Lowest port service_port() picks.
PORT_FLOOR = 10000
#: Node ids of a fleet the bench runs against its own schedulers (the simulator's default).
DEFAULT_NODE_PREFIX = "sim-node-"
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


class StackError(RuntimeError):
    """Something the bench started did not come up (the message carries its log tail)."""


@dataclass
class StackOptions:
    """How to build or reach the system under test."""

    nodes: int
    replicas: int = 1
    #: "shards": active-active, one shard per replica; "failover": replicas of one shard.
    ha: str = "shards"
    heartbeat_interval_s: int = 10
    reconcile_interval_s: float = 5.0
    reapply_guard_s: float = 15.0
    apply_latency_s: float = 0.2
    #: Simulator processes sharing the fleet; 0: one per NODES_PER_SIM_PROCESS nodes.
    sim_processes: int = 0
    seed: int | None = None
    fleet_in_process: bool = False
    #: External target (``--scheduler``/``--metrics``/``--etcd``): nothing of it is started.
    scheduler_addrs: list[str] = field(default_factory=list)
    metrics_addrs: list[str] = field(default_factory=list)
    scheduler_pids: list[int] = field(default_factory=list)
    etcd_url: str = ""
    etcd_root: str = ""
    keep: bool = False
    startup_timeout_s: float = 120.0
    lease_ttl_s: int = 15
    #: Node ids are ``f"{node_prefix}{i:05d}"``; against an existing scheduler, unique per run.
    node_prefix: str = DEFAULT_NODE_PREFIX
    #: Where the started schedulers export traces (OTEL_EXPORTER_OTLP_ENDPOINT); "jaeger":
    #: a private Jaeger the stack starts (``ops.jaeger``); "": no export (the tracing
    #: variables of the bench's own environment are not passed on either).
    trace_endpoint: str = ""

    @property
    def external(self) -> bool:
        return bool(self.scheduler_addrs)

    def fleet_parts(self) -> list[tuple[int, int]]:
        """(first node index, node count) of each simulator process, covering 1..nodes.

        ``failover`` keeps one process (the bench refuses more): its ``double_applies``
        compares each apply with the newest term any node has seen, and a process knows only
        its own nodes.
        """
        automatic = 1 if self.ha == "failover" else -(-self.nodes // NODES_PER_SIM_PROCESS)
        wanted = self.sim_processes or automatic
        parts = max(1, min(wanted, self.nodes))
        base, extra = divmod(self.nodes, parts)
        out: list[tuple[int, int]] = []
        first = 1
        for i in range(parts):
            count = base + (1 if i < extra else 0)
            out.append((first, count))
            first += count
        return out


class Stack:
    """The running system: addresses, processes and the fleet's counters."""

    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.workdir = Path(tempfile.mkdtemp(prefix="persys-bench-"))
        self.grpc_addrs: list[str] = list(options.scheduler_addrs)
        self.metrics_addrs: list[str] = list(options.metrics_addrs)
        self.etcd_url = options.etcd_url
        self.etcd_root = options.etcd_root
        #: Scheduler processes by name ("scheduler-0" ...), for RSS and CPU accounting.
        self.scheduler_pids: dict[str, int] = {
            f"scheduler-{i}": pid for i, pid in enumerate(options.scheduler_pids)}
        self.schedulers: list[Child] = []
        #: Simulator processes, and the /stats address of each.
        self.sims: list[Child] = []
        self.sim_stats_addrs: list[str] = []
        self.fleet: Any = None  # ops.sim.fleet.Fleet when in process (imported lazily)
        self._etcd: EtcdProcess | None = None
        self._redis: RedisProcess | None = None
        self._jaeger: Any = None  # ops.jaeger.JaegerProcess (imported lazily)
        #: what the schedulers were told to export to ("" when off)
        self.trace_endpoint = ""
        self._failed = False
        #: Ports handed to children (some maybe not bound yet).
        self._ports: set[int] = set()

    @property
    def managed(self) -> bool:
        """Whether the bench started the schedulers (and may kill or measure them)."""
        return not self.options.external

    # -- start ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bring everything up and wait until the fleet is registered and visible via the API."""
        try:
            if self.managed:
                self._start_stores()
                await self._start_schedulers()
            await self._start_fleet()
            await self._wait_registered()
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise  # Ctrl-C or SIGTERM: nothing failed, so stop() removes the run's directory
        except BaseException:
            self._failed = True  # its logs tell why: stop() keeps the directory
            raise

    def _start_stores(self) -> None:
        # Blocking, but short; a Ctrl-C meanwhile is delivered once they are up and recorded,
        # so stop() still finds and stops them.
        self._etcd = EtcdProcess()
        self._etcd.start(self.workdir / "etcd")
        self.etcd_url = self._etcd.url
        self._redis = RedisProcess()
        self._redis.start(self.workdir / "redis", appendonly=True)
        self.trace_endpoint = self.options.trace_endpoint
        if self.trace_endpoint == "jaeger":
            from ops.jaeger import JaegerProcess, find_jaeger_binary

            binary = find_jaeger_binary()
            if binary is None:
                raise StackError("--trace-endpoint jaeger: no Jaeger binary; build it with "
                                 "python -m ops.jaeger --build")
            self._jaeger = JaegerProcess(binary).start(self.workdir / "jaeger")
            self.trace_endpoint = self._jaeger.otlp_endpoint

    def _scheduler_env(self, index: int, grpc_port: int, metrics_port: int) -> dict[str, str]:
        o = self.options
        assert self._etcd is not None
        assert self._redis is not None
        # the tracing variables too: a run without --trace-endpoint exports nothing
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SCHEDULER_", "ETCD_", "OTEL_EXPORTER_OTLP_"))
               and k != "JAEGER_ENDPOINT"}
        env.update({
            "GRPC_PORT": str(grpc_port),
            "METRICS_PORT": str(metrics_port),
            "PERSYS_GRPC_ADDR": HOST,
            "ETCD_ENDPOINTS": self._etcd.endpoint,
            "REDIS_ADDR": self._redis.addr,
            "SCHEDULER_INSTANCE_ID": f"bench-{index}",
            "SCHEDULER_HEARTBEAT_INTERVAL": str(o.heartbeat_interval_s),
            "SCHEDULER_NODE_LEASE_TTL": str(max(30, 3 * o.heartbeat_interval_s)),
            "SCHEDULER_RECONCILE_INTERVAL": f"{o.reconcile_interval_s:g}",
            "SCHEDULER_REAPPLY_GUARD": f"{o.reapply_guard_s:g}",
            "SCHEDULER_LEADER_LEASE_TTL": str(o.lease_ttl_s),
            "LOG_LEVEL": "warning",
            "PYTHONUNBUFFERED": "1",
        })
        if self.trace_endpoint:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.trace_endpoint
        if o.ha == "shards" and o.replicas > 1:
            env.update({
                "SCHEDULER_HA_MODE": "active-active",
                "SCHEDULER_SHARD_COUNT": str(o.replicas),
                "SCHEDULER_SHARD_INDEX": str(index),
            })
        else:
            env["SCHEDULER_HA_MODE"] = "failover"
        return env

    async def _start_schedulers(self) -> None:
        for i in range(self.options.replicas):
            grpc_port, metrics_port = service_port(self._ports), service_port(self._ports)
            child = Child(
                f"scheduler-{i}",
                [sys.executable, "-m", "ops.cli", "serve", "-insecure"],
                env=self._scheduler_env(i, grpc_port, metrics_port),
                log=self.workdir / f"scheduler-{i}.log",
                cwd=_PROJECT_ROOT,
            )
            self.schedulers.append(child)
            self.grpc_addrs.append(f"{HOST}:{grpc_port}")
            self.metrics_addrs.append(f"{HOST}:{metrics_port}")
            self.scheduler_pids[child.name] = child.pid
        await asyncio.gather(*(self._wait_healthy(c, a)
                               for c, a in zip(self.schedulers, self.metrics_addrs, strict=True)))
        await self._wait_leaders()

    async def restart_scheduler(self, index: int) -> None:
        """Start scheduler ``index`` again on its old ports (after it was killed)."""
        grpc_port = int(self.grpc_addrs[index].rsplit(":", 1)[1])
        metrics_port = int(self.metrics_addrs[index].rsplit(":", 1)[1])
        child = Child(
            f"scheduler-{index}",
            [sys.executable, "-m", "ops.cli", "serve", "-insecure"],
            env=self._scheduler_env(index, grpc_port, metrics_port),
            log=self.workdir / f"scheduler-{index}.log",
            cwd=_PROJECT_ROOT,
        )
        self.schedulers[index] = child
        self.scheduler_pids[child.name] = child.pid
        await self._wait_healthy(child, self.metrics_addrs[index])

    async def _wait_healthy(self, child: Child, metrics_addr: str) -> None:
        await self._wait_serving(child, metrics_addr, "/health")

    async def _wait_serving(self, child: Child, addr: str, path: str) -> None:
        """Until ``child`` answers ``GET path`` with JSON; its log tail if it exits or is late."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.startup_timeout_s
        while True:
            if not child.running():
                raise StackError(f"{child.name} exited with {child.proc.returncode} before it "
                                 f"served {path}:\n{child.tail()}")
            try:
                await get_json(addr, path, timeout=2.0)
                return
            except (OSError, HttpError):
                pass
            if loop.time() > deadline:
                raise StackError(f"{child.name} did not serve {path} within "
                                 f"{self.options.startup_timeout_s:g}s:\n{child.tail()}")
            await asyncio.sleep(0.1)

    async def _wait_leaders(self, timeout: float = 60.0) -> None:
        """Shards: every replica leads its shard; failover: one replica leads."""
        want = self.options.replicas if self.options.ha == "shards" else 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            leaders = sum(1 for h in await self.health() if h.get("leader") == "true")
            if leaders >= want:
                return
            if loop.time() > deadline:
                raise StackError(f"{leaders} of {want} expected leaders after {timeout:g}s")
            await asyncio.sleep(0.2)

    def _fleet_target(self) -> str:
        """Active-active shards: the fleet is spread over the replicas, as agents behind DNS
        would be; replicas of one shard (failover) all get the first replica's address."""
        return (",".join(self.grpc_addrs) if self.options.ha == "shards"
                else self.grpc_addrs[0])

    async def _start_fleet(self) -> None:
        o = self.options
        if o.fleet_in_process:
            from ops.sim.config import NodeBehaviour
            from ops.sim.fleet import Fleet

            _raise_fd_limit(2 * o.nodes + 512)
            self.fleet = Fleet(self._fleet_target(), count=o.nodes,
                               behaviour=NodeBehaviour(apply_latency_s=o.apply_latency_s),
                               seed=o.seed, prefix=o.node_prefix)
            await self.fleet.start()
            return
        parts = o.fleet_parts()
        for i, (first, count) in enumerate(parts):
            port = service_port(self._ports)
            argv = [sys.executable, "-m", "ops.cli", "sim", "--scheduler", self._fleet_target(),
                    "--nodes", str(count), "--first-index", str(first),
                    "--stats-port", str(port), "--report-every", "0",
                    "--apply-latency", f"{o.apply_latency_s:g}", "--prefix", o.node_prefix]
            if o.seed is not None:
                argv += ["--seed", str(o.seed + i)]
            name = "sim" if len(parts) == 1 else f"sim-{i}"
            self.sims.append(Child(name, argv, env=dict(os.environ),
                                   log=self.workdir / f"{name}.log", cwd=_PROJECT_ROOT))
            self.sim_stats_addrs.append(f"{HOST}:{port}")
        await asyncio.gather(*(self._wait_serving(sim, addr, "/stats")
                               for sim, addr in zip(self.sims, self.sim_stats_addrs,
                                                    strict=True)))

    async def _wait_registered(self) -> None:
        """Every replica's API counts all simulated nodes Ready.

        The API's view is what placement uses; the fleet's own "registered" count is only
        reported, because an overloaded scheduler makes some nodes' heartbeats time out and
        re-register, so it may never read N at one instant while the scheduler has them all.
        An existing scheduler may have nodes of its own: only ours (by id) count there.
        """
        from ops.benchlib.clients import ApiClients

        loop = asyncio.get_running_loop()
        timeout = self.options.startup_timeout_s + self.options.nodes * STARTUP_PER_NODE_S
        deadline = loop.time() + timeout
        want = self.options.nodes
        api = ApiClients(self.grpc_addrs)
        ready: list[int] = []
        last_error = ""
        try:
            while True:
                try:
                    ready = [await self._ready_nodes(api, i) for i in range(len(self.grpc_addrs))]
                except grpc.aio.AioRpcError as exc:
                    last_error = f"; GetClusterSummary: {exc.code().name} {exc.details()}"
                else:
                    if min(ready) >= want:
                        return
                if loop.time() > deadline:
                    stats = await self.fleet_stats()
                    raise StackError(
                        f"after {timeout:.0f}s the schedulers count {ready} Ready nodes of "
                        f"{want}; the fleet says {stats.get('registered')} registered, "
                        f"control outcomes {stats.get('control')}{last_error}")
                await asyncio.sleep(0.5)
        finally:
            await api.close()

    async def _ready_nodes(self, api: ApiClients, replica: int) -> int:
        if not self.options.external:  # every node is ours: the cheap count
            return int((await api.summary(replica, timeout=10.0)).ready_nodes)
        return len(await self.own_nodes(api, replica, status="Ready"))

    async def own_nodes(self, api: ApiClients, replica: int = 0, *,
                        status: str = "") -> list[str]:
        """The ids of this run's simulated nodes a replica knows (with ``status``, if given)."""
        reply = await api.stubs[replica].ListNodes(control_pb2.ListNodesRequest(status=status),
                                                   timeout=30.0)
        return sorted(n.node_id for n in reply.nodes
                      if n.node_id.startswith(self.options.node_prefix))

    # -- observation ----------------------------------------------------------------------------

    async def fleet_stats(self, *, per_node: bool = False) -> dict[str, Any]:
        """The simulator's own counters (``ops.sim.fleet.Fleet.stats``), summed over its
        processes."""
        if self.fleet is not None:
            stats: dict[str, Any] = self.fleet.stats(per_node=per_node)
            return stats
        path = "/stats?per_node=1" if per_node else "/stats"
        parts = await asyncio.gather(*(get_json(addr, path, timeout=60.0)
                                       for addr in self.sim_stats_addrs))
        return merge_fleet_stats(parts)

    async def scrape(self) -> list[MetricsSnapshot | None]:
        """``/metrics`` of every replica (None for one that did not answer)."""
        async def one(addr: str) -> MetricsSnapshot | None:
            try:
                body = await http_get(addr, "/metrics", timeout=10.0)
            except (OSError, HttpError):
                return None
            return MetricsSnapshot.parse(body.decode("utf-8", errors="replace"))

        return list(await asyncio.gather(*(one(a) for a in self.metrics_addrs)))

    async def scrape_merged(self) -> MetricsSnapshot | None:
        """The sum over replicas; None when no replica exposes metrics (or none was given)."""
        snaps = [s for s in await self.scrape() if s is not None]
        return MetricsSnapshot.merge(snaps) if snaps else None

    async def scrape_etcd(self) -> MetricsSnapshot | None:
        """``/metrics`` of the etcd the bench started (None for an external one, or no
        answer): its disk figures tell a slow disk from a slow scheduler."""
        if self._etcd is None or not self.etcd_url:
            return None
        address = self.etcd_url.split("://", 1)[-1].split(",", 1)[0].rstrip("/")
        try:
            body = await http_get(address, "/metrics", timeout=10.0)
        except (OSError, HttpError, ValueError):
            return None
        return MetricsSnapshot.parse(body.decode("utf-8", errors="replace"))

    async def health(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for addr in self.metrics_addrs:
            try:
                out.append(await get_json(addr, "/health", timeout=5.0))
            except (OSError, HttpError):
                out.append({})
        return out

    def process_pids(self) -> dict[str, int]:
        """Every process of the run worth accounting, by name (the bench itself included)."""
        pids = dict(self.scheduler_pids)
        for sim in self.sims:
            pids[sim.name] = sim.pid
        if self._etcd is not None and self._etcd.pid is not None:
            pids["etcd"] = self._etcd.pid
        if self._redis is not None and self._redis.pid is not None:
            pids["redis"] = self._redis.pid
        if self._jaeger is not None and self._jaeger.pid is not None:
            pids["jaeger"] = self._jaeger.pid
        pids["bench" if self.fleet is None else "bench+sim"] = os.getpid()
        return pids

    # -- stop -----------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop everything this stack started, fleet first; safe after a partial start."""
        try:
            if self.fleet is not None:
                fleet, self.fleet = self.fleet, None
                await fleet.stop()
        finally:
            self._stop_processes()

    def _stop_processes(self) -> None:
        children = self.sims + list(self.schedulers)
        for child in children:
            child.terminate()
        for child in children:
            child.wait_or_kill(20.0)
        for server in (self._redis, self._etcd, self._jaeger):
            if server is not None:
                server.stop()
        if self._failed or self.options.keep:
            print(f"bench: logs kept in {self.workdir}", file=sys.stderr)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tails(self) -> str:
        """The end of every child's log, for a failure report."""
        parts = [f"--- {c.name} ---\n{c.tail()}"
                 for c in self.sims + self.schedulers]
        return "\n".join(parts)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def service_port(taken: set[int]) -> int:
    """A free loopback port outside the kernel's ephemeral range.

    Why: the simulator binds one server per node on kernel-picked (ephemeral) ports before its
    stats server starts; 5,000 of them take a fifth of the range, so a port picked from that
    range a moment earlier is often taken by then. ``taken`` holds ports already handed out
    (not bound yet); the chosen one is added to it.
    """
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(50):
        port = rng.randrange(PORT_FLOOR, max(PORT_FLOOR + 1, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            if port in taken:
                continue
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        taken.add(port)
        return port
    port = free_port()
    taken.add(port)
    return port


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
