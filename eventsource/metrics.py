"""Prometheus metrics, built per process by the composition root (no module-level registry).

Names follow docs/compatibility.md, "Metrics": the Go version's where it had them, and fixed
names for the new ones (the benchmark reads these exact names). No per-node or per-workload
labels.

The Go families and where they are filled: ``grpc_server_*`` (``handlers/api/metrics.py``),
``agent_rpc_*`` (``handlers/agents/pool.py``), ``reconciliation_results_total`` and
``reconciliation_cycle*`` (the reconcile loop, through ``observe_reconcile_cycle``),
``nodes_status``, ``workloads_status`` and ``workloads_desired_state`` (kept from the
projections' change feed on every replica: ``projections/gauges.py``) and
``state_store_writes_total`` (spec, status and assignment puts, and events the outbox could not
take, in ``eventsource/commit.py``; events appended or dropped in the relay).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: the Go version's pre-seeded label values: always exported, 0 when nothing has them
NODE_STATUSES = ("ready", "active", "notready", "unknown")
WORKLOAD_STATUSES = ("pending", "running", "stopped", "failed", "deleted", "updating", "unknown")
DESIRED_STATES = ("running", "stopped", "deleted", "unknown")
#: the ``state_store_writes_total`` categories of keys the committer puts (Go counted each save
#: of a spec, status or assignment; deletes were not counted)
STATE_STORE_CATEGORIES = frozenset({"spec", "status", "assignment"})
#: fine where delivery targets are (tens of milliseconds), coarse past a second
EVENT_DELAY_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02,
                       0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10)
#: prometheus client_golang's DefBuckets, which the Go histograms used
GO_DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """Every metric the scheduler exports, on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ns, sub = "persys", "scheduler"
        self.etcd_txns = Counter(
            "etcd_txns", "etcd transactions by kind and result", ["kind", "result"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.etcd_txn_requests = Counter(
            "etcd_txn_requests",
            "etcd transaction requests sent (shape=group carries several changes, each counted "
            "in etcd_txns; group-nested: a group sent again nested after its flat form failed "
            "a compare)", ["shape"], namespace=ns, subsystem=sub, registry=r,
        )
        self.etcd_writes = Counter(
            "etcd_writes", "etcd keys written by category", ["category"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.agent_rpcs = Counter(
            "agent_rpcs", "agent RPCs by method and code", ["method", "code"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.agent_rpc_requests = Counter(
            "agent_rpc_requests", "agent RPCs (Go name)", ["rpc", "code"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.cert_rotations = Counter(
            "cert_rotations", "Vault PKI certificate issues by why (startup, scheduled, retry, "
            "forced) and result", ["why", "result"], namespace=ns, subsystem=sub, registry=r,
        )
        self.agent_rpc_duration = Histogram(
            "agent_rpc_duration_seconds", "agent RPC latency", ["rpc", "code"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.grpc_requests = Counter(
            "grpc_server_requests", "gRPC requests served", ["method", "code"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.grpc_duration = Histogram(
            "grpc_server_request_duration_seconds", "gRPC request latency", ["method", "code"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.event_loop_lag = Histogram(
            "event_loop_lag_seconds", "how much later than asked a timer fired on the loop",
            namespace=ns, subsystem=sub, registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.gc_pause = Histogram(
            "gc_pause_seconds", "garbage collection pauses by generation", ["generation"],
            namespace=ns, subsystem=sub, registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.reconcile_cycles = Counter(
            "reconcile_cycles", "reconcile cycles run", namespace=ns, subsystem=sub, registry=r,
        )
        self.reconcile_cycle_seconds = Histogram(
            "reconcile_cycle_seconds", "reconcile cycle duration",
            namespace=ns, subsystem=sub, registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
        )
        self.reconcile_phase_seconds = Counter(
            "reconcile_phase_seconds", "wall time of reconcile cycles by phase: prefetch (the "
            "agents' ListWorkloads), plan (unreachable nodes marked, drift classified, the "
            "decisions), act (agent calls and writes)",
            ["phase"], namespace=ns, subsystem=sub, registry=r,
        )
        self.reconciliation_cycles = Counter(
            "reconciliation_cycles", "reconcile cycles by result: error when the cycle itself "
            "failed or was cut short, not when one of its actions failed (Go name)", ["result"],
            namespace=ns, subsystem=sub, registry=r,
        )
        for result in ("success", "error"):
            self.reconciliation_cycles.labels(result)
        self.reconciliation_cycle_duration = Histogram(
            "reconciliation_cycle_duration_seconds", "reconcile cycle duration (Go name)",
            namespace=ns, subsystem=sub, registry=r, buckets=GO_DEFAULT_BUCKETS,
        )
        self.reconciliation_results = Counter(
            "reconciliation_results", "reconcile actions (Go name)", ["action", "success"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.placement_decision_seconds = Histogram(
            "placement_decision_seconds", "time of the pure placement function",
            namespace=ns, subsystem=sub, registry=r,
            # fine below 1 ms, where decisions are: the bench interpolates its p99 in a bucket
            buckets=(0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001,
                     0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
        )
        self.pending_workloads = Gauge(
            "pending_workloads", "workloads stored that fit no node yet (on this replica's view)",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.pending_placed = Counter(
            "pending_placed", "pending workloads placed by the pending placer",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.pending_passes = Counter(
            "pending_passes", "passes of the pending placer over its shapes (capacity changes)",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.node_evictions = Counter(
            "node_evictions", "lost nodes admitted by the disruption guard (workloads moved)",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.evictions_waiting = Gauge(
            "evictions_waiting_nodes", "lost nodes with workloads waiting for admission",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.evictions_held = Gauge(
            "evictions_held", "1 while the disruption guard holds every eviction",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.heartbeats = Counter(
            "heartbeats", "heartbeats received", namespace=ns, subsystem=sub, registry=r,
        )
        self.calls_refused = Counter(
            "calls_refused", "calls refused by certificate (an agent certificate calling a "
            "non-agent RPC, or speaking for a node it is not bound to), by RPC",
            ["method"], namespace=ns, subsystem=sub, registry=r,
        )
        self.unread_answer_bytes = Gauge(
            "grpc_unread_answer_bytes", "bytes of unary answers handed to gRPC and not yet "
            "read by their callers", namespace=ns, subsystem=sub, registry=r,
        )
        self.calls_refused_unread = Counter(
            "grpc_calls_refused_unread", "calls answered RESOURCE_EXHAUSTED because their "
            "connection, or all callers, hold too many unread answers, by RPC",
            ["method"], namespace=ns, subsystem=sub, registry=r,
        )
        self.lease_keepalive_calls = Counter(
            "lease_keepalive_calls", "etcd gateway calls that renewed node liveness leases",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.lease_keepalives = Counter(
            "lease_keepalives", "node liveness lease renewals sent (several per call)",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.events_relayed = Counter(
            "events_relayed", "events appended to the stream by the relay",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.events_dropped = Counter(
            "events_dropped", "events dropped (outbox overflow)",
            namespace=ns, subsystem=sub, registry=r,
        )
        # where an event's commit-to-delivery time goes: the decision's timestamp to the
        # relay's append, and to the moment WatchEvents hands it to a client's stream (wall
        # clocks of two replicas when another replica decided it, so clock offset included)
        self.event_relay_delay = Histogram(
            "event_relay_delay_seconds", "an event's timestamp (its decision, just before "
            "commit) to its append to the stream, observed by the relay",
            namespace=ns, subsystem=sub, registry=r, buckets=EVENT_DELAY_BUCKETS,
        )
        self.event_delivery_delay = Histogram(
            "event_delivery_delay_seconds", "an event's timestamp to its hand-over to a "
            "WatchEvents client's stream (live events, not the history a watcher replays)",
            namespace=ns, subsystem=sub, registry=r, buckets=EVENT_DELAY_BUCKETS,
        )
        # Redis under Sentinel (eventsource/stream/sentinel.py, the relay's replica waits)
        self.redis_master = Gauge(
            "redis_master", "1 for the Redis master Sentinel names, as this replica last saw "
            "it (labelled by host:port; absent without REDIS_SENTINELS)", ["address"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.redis_failovers = Counter(
            "redis_failovers", "changes of the Redis master this replica saw (Sentinel "
            "promoted a replica)", namespace=ns, subsystem=sub, registry=r,
        )
        self.events_reappended = Counter(
            "events_reappended", "events the relay appended again because the stream "
            "lacked them although an earlier attempt had sent them (lost with a Redis master "
            "that had not passed them to a replica, or never received)",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.event_replica_waits = Counter(
            "event_replica_waits", "appends the relay waited for replicas to hold (WAIT), by "
            "result: confirmed, short (fewer replicas acknowledged in time: not removed from "
            "the outbox, appended again), alone (no replica connected, REDIS_MIN_REPLICAS_ACK "
            "unset: the master's word taken)", ["result"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.foreign_streams = Counter(
            "foreign_streams_moved", "foreign event streams renamed aside",
            namespace=ns, subsystem=sub, registry=r,
        )
        self.projection_lag = Gauge(
            "projection_lag_revisions", "revisions a projection is behind the newest seen",
            ["projection"], namespace=ns, subsystem=sub, registry=r,
        )
        self.watch_restarts = Counter(
            "watch_restarts", "watch restarts by reason", ["reason"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.leader = Gauge(
            "leader", "1 while this replica leads the shard", ["shard"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.leader_transitions = Counter(
            "leader_transitions", "leadership gained or lost", ["shard", "transition"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.nodes_status = Gauge(
            "nodes_status", "nodes by status, lower-cased (Go name)", ["status"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.workloads_status = Gauge(
            "workloads_status", "workloads by status, lower-cased (Go name)", ["status"],
            namespace=ns, subsystem=sub, registry=r,
        )
        self.workloads_desired_state = Gauge(
            "workloads_desired_state", "workloads by desired state, lower-cased (Go name)",
            ["desired_state"], namespace=ns, subsystem=sub, registry=r,
        )
        for gauge, seeded in ((self.nodes_status, NODE_STATUSES),
                              (self.workloads_status, WORKLOAD_STATUSES),
                              (self.workloads_desired_state, DESIRED_STATES)):
            for label in seeded:
                gauge.labels(label).set(0)
        self.state_store_writes = Counter(
            "state_store_writes", "state writes by category: spec, status, assignment (keys "
            "put), event (events appended to the stream), event_dropped (events lost: outbox "
            "overflow, or no Redis configured) (Go name)",
            ["category"], namespace=ns, subsystem=sub, registry=r,
        )

    def observe_reconcile_cycle(self, seconds: float, *, ok: bool) -> None:
        """One reconcile cycle ended: the project's families and the Go ones."""
        self.reconcile_cycles.inc()
        self.reconcile_cycle_seconds.observe(seconds)
        self.reconciliation_cycles.labels("success" if ok else "error").inc()
        self.reconciliation_cycle_duration.observe(seconds)
