"""Configuration: environment variables -> one frozen ``Settings``.

Names and defaults are the Go scheduler's plus the ones added here (docs/compatibility.md,
"Environment variables"). Unlike the Go version, an invalid value is not silently replaced by the
default: ``load_settings`` raises ``ConfigError`` naming the variable and the reason, and the
process refuses to start. Durations accept a Go duration string (``1m30s``) or integer seconds.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from eventsource.etcdtls import EtcdTls
from eventsource.stream.sentinel import Address, SentinelTarget, parse_sentinels
from handlers.identity.authz import DEFAULT_AGENT_CERT_NAMES, NodeBinding
from handlers.settings.reader import ConfigError, EnvReader
from handlers.settings.tracing import trace_settings


def default_instance_id() -> str:
    """``<hostname>-<first 8 chars of a uuid4>``, as the Go version names replicas."""
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


EVENT_LOOPS = ("uvloop", "asyncio")
UNPLACEABLE_MODES = ("pending", "refuse")

#: LOG_LEVEL values: the Go version's logrus names and Python's, each to the Python level used
LOG_LEVELS = {
    "trace": "debug", "debug": "debug", "info": "info", "warn": "warning",
    "warning": "warning", "error": "error", "fatal": "critical", "panic": "critical",
    "critical": "critical",
}
#: LOG_FORMAT values (logrus's two formatters): one JSON object per line, or key=value text
LOG_FORMATS = ("json", "text")

DEFAULT_TLS_CA = "/etc/persys/certs/persys_scheduler/ca.pem"
DEFAULT_TLS_CERT = "/etc/persys/certs/persys_scheduler/persys_scheduler.crt"
DEFAULT_TLS_KEY = "/etc/persys/certs/persys_scheduler/persys_scheduler-key.key"


#: default capacity maxima of one node: 16,384 cores and 256 TiB, well above any machine sold
#: today (the largest have under 2,000 hardware threads and 32 TiB); a setting may raise them
#: up to ``NODE_CAPACITY_CEILING`` (2^50, far below the 2^62 a hostile agent once claimed, and
#: exact in a float, as node capacities are summed)
NODE_MAX_CPU_MILLICORES = 16_384_000
NODE_MAX_MEMORY_MB = 256 * 1024 * 1024
NODE_CAPACITY_CEILING = 1 << 50


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything configurable, validated."""

    insecure: bool = False
    grpc_addr: str = "0.0.0.0"
    grpc_port: int = 8085
    metrics_port: int = 8084
    #: where /metrics and /health listen ("" = PERSYS_GRPC_ADDR, as the Go version bound them);
    #: they are plaintext and unauthenticated, so 127.0.0.1 keeps them off the network
    metrics_addr: str = ""
    etcd_endpoints: tuple[str, ...] = ("localhost:2379",)
    etcd_timeout_s: float = 5.0
    etcd_root: str = ""
    #: client TLS for etcd (SCHEDULER_ETCD_CA/_CERT/_KEY; the Go version had none)
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    domain: str = "persys.local"
    agents_discovery_domain: str = "agents.persys.cloud"
    shard_key: str = "genesis"
    advertise_ip: str = ""
    advertise_port: int = 0
    redis_addr: str = ""
    redis_password: str = field(default="", repr=False)  # never in a logged repr
    redis_db: int = 0
    #: Sentinels to ask for the master (REDIS_SENTINELS; instead of REDIS_ADDR), the name they
    #: monitor it by, and their own password
    redis_sentinels: tuple[Address, ...] = ()
    redis_sentinel_master: str = ""
    redis_sentinel_password: str = field(default="", repr=False)
    #: replicas that must hold an event before the relay removes it from the outbox
    #: (REDIS_MIN_REPLICAS_ACK); None: 1 while a Sentinel master has a replica, else none
    redis_min_replicas_ack: int | None = None
    redis_event_ttl_s: float = 24 * 3600.0
    redis_event_max_entries: int = 1000
    event_stream: str = "scheduler:events"
    event_outbox_max: int = 100_000
    meter_stream_enabled: bool = True
    meter_stream: str = "persys:usage:stream"
    meter_stream_maxlen: int = 100_000
    tls_ca: str = DEFAULT_TLS_CA
    tls_cert: str = DEFAULT_TLS_CERT
    tls_key: str = DEFAULT_TLS_KEY
    vault_enabled: bool = False
    agent_tls_enabled: bool = True
    #: common names of agent certificates, and how a node is tied to its caller
    #: (handlers/identity/authz.py)
    agent_cert_names: tuple[str, ...] = DEFAULT_AGENT_CERT_NAMES
    operator_cert_names: tuple[str, ...] = ()
    node_binding: NodeBinding = NodeBinding.ENDPOINT
    #: in ``endpoint`` binding, how many live nodes one agent endpoint host may hold
    nodes_per_host: int = 1
    #: answered dials in a row that return a node marked NotReady for unanswered dials
    node_ready_after_dials: int = 3
    #: gRPC server limits (handlers/app/grpc_limits.py): streams per connection, keepalive
    #: enforcement and pings, idle and age limits of a connection (0: no age limit)
    grpc_max_concurrent_streams: int = 1024
    grpc_min_ping_interval_s: float = 10.0
    grpc_keepalive_time_s: float = 60.0
    grpc_keepalive_timeout_s: float = 20.0
    grpc_max_connection_idle_s: float = 1800.0
    grpc_max_connection_age_s: float = 0.0
    grpc_max_connection_age_grace_s: float = 300.0
    #: connections served at once (more are closed at accept), calls in handlers at once
    #: (more answered RESOURCE_EXHAUSTED), and how long a new connection may take to complete
    #: its TLS and HTTP/2 handshake
    grpc_max_connections: int = 16384
    grpc_max_concurrent_rpcs: int = 32768
    grpc_handshake_timeout_s: float = 20.0
    #: answers handed to gRPC and not yet read by their caller (handlers/api/unread.py)
    grpc_max_unread_bytes_per_connection: int = 16 * 1024 * 1024
    grpc_max_unread_bytes: int = 256 * 1024 * 1024
    #: concurrent WatchEvents streams in all, and per caller identity
    watch_max: int = 8192
    watch_max_per_caller: int = 1024
    #: the largest capacity a node may claim (a claim of 2^62 took every placement)
    node_max_cpu_millicores: int = NODE_MAX_CPU_MILLICORES
    node_max_memory_mb: int = NODE_MAX_MEMORY_MB
    agent_rpc_timeout_s: float = 10.0
    agent_apply_timeout_s: float = 45.0
    agent_vm_apply_timeout_s: float = 240.0
    #: the deadline of an agent DeleteWorkload (the Go version polled for up to this long)
    agent_delete_timeout_s: float = 60.0
    #: read for compatibility, unused: the Go version polled GetWorkloadStatus after a delete;
    #: here the agent's DeleteWorkload answer is final
    agent_status_poll_interval_s: float = 1.0
    reconcile_interval_s: float = 5.0
    reconcile_concurrency: int = 64
    drift_detect_interval_s: float = 300.0
    #: read for compatibility, unused: a node is unavailable once its liveness lease
    #: (SCHEDULER_NODE_LEASE_TTL, also 3 min by default) expires, not by heartbeat age
    node_unavailable_grace_s: float = 180.0
    reapply_guard_s: float = 45.0
    heartbeat_interval_s: int = 60
    node_lease_ttl_s: int = 180
    node_gc_after_s: float = 24 * 3600.0
    node_eviction_rate: float = 1.0
    node_eviction_burst: int = 10
    unhealthy_node_threshold: float = 0.55
    reservation_ttl_s: float = 90.0
    ha_mode: str = "failover"
    shard_count: int = 1
    shard_index: int = 0
    leader_lease_ttl_s: int = 15
    leader_renew_deadline_s: float = 10.0
    allow_empty_state: bool = False
    dns_enabled: bool = True
    relay_enabled: bool = True
    dns_lease_ttl_s: int = 15
    max_spec_bytes: int = 1024 * 1024
    instance_id: str = field(default_factory=default_instance_id)
    log_level: str = "info"
    log_format: str = "json"
    #: ``uvloop`` (libuv-based, cheaper per callback) or ``asyncio`` (the standard loop)
    event_loop: str = "uvloop"
    #: what an ApplyWorkload that fits no node does: ``pending`` (stored, placed when capacity
    #: appears, as in the Go version) or ``refuse`` (nothing stored)
    unplaceable: str = "pending"
    #: pending workloads at most; past it an unplaceable apply is refused
    pending_max: int = 10_000
    #: where spans go: the OTLP/HTTP traces URL (``.../v1/traces``); "" exports nothing and
    #: installs no tracer (``trace_endpoint_url``; docs/operations.md, "Tracing")
    trace_endpoint: str = ""
    trace_service_name: str = "persys-scheduler"
    #: OTEL_TRACES_SAMPLER (the OpenTelemetry names) and its ratio
    trace_sampler: str = "parentbased_always_on"
    trace_sampler_ratio: float = 1.0
    #: reconcile nodes traced per cycle at most (their listing, and the actions on them)
    trace_reconcile_nodes: int = 10

    @property
    def etcd_tls(self) -> EtcdTls | None:
        """None unless one of the etcd TLS files is set (then endpoints default to https)."""
        if not (self.etcd_ca or self.etcd_cert or self.etcd_key):
            return None
        return EtcdTls(self.etcd_ca, self.etcd_cert, self.etcd_key)

    @property
    def active_active(self) -> bool:
        return self.ha_mode == "active-active"

    @property
    def events_enabled(self) -> bool:
        return bool(self.redis_addr or self.redis_sentinels)

    @property
    def sentinel_target(self) -> SentinelTarget | None:
        """Where the Redis master is asked for, with ``REDIS_SENTINELS``; else None."""
        if not self.redis_sentinels:
            return None
        return SentinelTarget(self.redis_sentinels, self.redis_sentinel_master,
                              password=self.redis_password, db=self.redis_db,
                              sentinel_password=self.redis_sentinel_password)

    @property
    def replica_acks(self) -> tuple[bool, int | None]:
        """Whether the relay waits for replicas, and for how many (None: 1 while the master
        has one). Without Sentinel only an explicit ``REDIS_MIN_REPLICAS_ACK`` waits."""
        required = self.redis_min_replicas_ack
        if required is None:
            return bool(self.redis_sentinels), None
        return required > 0, required

    def with_overrides(self, **changes: Any) -> Settings:
        return replace(self, **changes)


N = TypeVar("N", int, float)

#: OTEL_TRACES_SAMPLER values (the OpenTelemetry specification's built-in samplers)
def _etcd_tls_files(r: EnvReader) -> tuple[str, str, str]:
    files = (r.text("SCHEDULER_ETCD_CA", ""), r.text("SCHEDULER_ETCD_CERT", ""),
             r.text("SCHEDULER_ETCD_KEY", ""))
    if bool(files[1]) != bool(files[2]):
        raise ConfigError("SCHEDULER_ETCD_CERT/SCHEDULER_ETCD_KEY: a client certificate needs "
                          "both files")
    for name, path in zip(("SCHEDULER_ETCD_CA", "SCHEDULER_ETCD_CERT", "SCHEDULER_ETCD_KEY"),
                          files, strict=True):
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{name}: {path!r} is not a readable file")
    return files


def etcd_tls_from_env(env: Mapping[str, str]) -> EtcdTls | None:
    """The etcd client TLS of ``SCHEDULER_ETCD_CA/_CERT/_KEY`` (for the ops commands that
    take ``--etcd``), or None; raises ``ConfigError`` naming the variable."""
    files = _etcd_tls_files(EnvReader(env))
    return EtcdTls(*files) if any(files) else None


def require_tls_files(settings: Settings) -> None:
    """The ``PERSYS_TLS_*`` files ``serve`` will read, checked before anything starts: a
    missing one names its variable instead of ending in a traceback. Skipped when Vault issues
    them (the certificate manager writes them before the server starts)."""
    uses_files = not settings.insecure or settings.agent_tls_enabled
    if not uses_files or settings.vault_enabled:
        return
    for name, path in (("PERSYS_TLS_CA", settings.tls_ca), ("PERSYS_TLS_CERT", settings.tls_cert),
                       ("PERSYS_TLS_KEY", settings.tls_key)):
        if not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ConfigError(f"{name}: {path!r} is not a readable file (mTLS needs it; run "
                              "with -insecure, or PERSYS_VAULT_ENABLED=true to have Vault "
                              "issue it)")


def _sentinels(r: EnvReader) -> tuple[tuple[Address, ...], str, str]:
    """``REDIS_SENTINELS``, ``REDIS_SENTINEL_MASTER``, ``REDIS_SENTINEL_PASSWORD``, checked
    together (one without the others is a mistake, not a default)."""
    text = r.raw("REDIS_SENTINELS")
    master = r.text("REDIS_SENTINEL_MASTER", "")
    password = r.text("REDIS_SENTINEL_PASSWORD", "")
    if text is None:
        for name, value in (("REDIS_SENTINEL_MASTER", master),
                            ("REDIS_SENTINEL_PASSWORD", password)):
            if value:
                raise ConfigError(f"{name}: set without REDIS_SENTINELS (the Sentinels to "
                                  "ask for the master, host:port,...)")
        return (), "", ""
    try:
        sentinels = parse_sentinels(text)
    except ValueError as exc:
        raise ConfigError(f"REDIS_SENTINELS: {exc} (expected host:port,host:port,...)") from exc
    if not master:
        raise ConfigError("REDIS_SENTINEL_MASTER: required with REDIS_SENTINELS (the name "
                          "the Sentinels monitor the master by)")
    if r.raw("REDIS_ADDR") is not None:
        raise ConfigError("REDIS_ADDR/REDIS_SENTINELS: set one of them (with REDIS_SENTINELS "
                          "the master's address comes from the Sentinels)")
    return sentinels, master, password


def load_settings(env: Mapping[str, str], *, insecure: bool = False) -> Settings:
    """Read and validate every setting; raises ``ConfigError`` naming the variable."""
    r = EnvReader(env)
    etcd_files = _etcd_tls_files(r)
    grpc_port = r.integer("GRPC_PORT", 8085, minimum=1, maximum=65535)
    endpoints = tuple(e.strip() for e in r.text("ETCD_ENDPOINTS", "localhost:2379").split(","))
    if not endpoints or any(not e for e in endpoints):
        raise ConfigError("ETCD_ENDPOINTS: empty endpoint in the comma-separated list")
    ha_mode = r.text("SCHEDULER_HA_MODE", "failover").lower()
    event_loop = r.text("SCHEDULER_EVENT_LOOP", "uvloop").lower()
    if event_loop not in EVENT_LOOPS:
        raise ConfigError(f"SCHEDULER_EVENT_LOOP: {event_loop!r} is not 'uvloop' or 'asyncio'")
    unplaceable = r.text("SCHEDULER_UNPLACEABLE", "pending").lower()
    if unplaceable not in UNPLACEABLE_MODES:
        raise ConfigError(f"SCHEDULER_UNPLACEABLE: {unplaceable!r} is not 'pending' or 'refuse'")
    log_level = r.text("LOG_LEVEL", "info").lower()
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"LOG_LEVEL: {log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    log_format = r.text("LOG_FORMAT", "json").lower()
    if log_format not in LOG_FORMATS:
        raise ConfigError(f"LOG_FORMAT: {log_format!r} is not 'json' or 'text'")
    if ha_mode not in ("failover", "active-active"):
        raise ConfigError(f"SCHEDULER_HA_MODE: {ha_mode!r} is not 'failover' or 'active-active'")
    shard_count = r.integer("SCHEDULER_SHARD_COUNT", 1, minimum=1, maximum=1024)
    shard_index = r.integer("SCHEDULER_SHARD_INDEX", 0, minimum=0)
    if shard_index >= shard_count:
        raise ConfigError(
            f"SCHEDULER_SHARD_INDEX: {shard_index} is outside 0..{shard_count - 1} "
            f"(SCHEDULER_SHARD_COUNT={shard_count})"
        )
    if ha_mode != "active-active" and (shard_count != 1 or shard_index != 0):
        raise ConfigError(
            "SCHEDULER_SHARD_COUNT/SCHEDULER_SHARD_INDEX: sharding needs "
            "SCHEDULER_HA_MODE=active-active"
        )
    agent_cert_names = tuple(n.strip() for n in r.text(
        "SCHEDULER_AGENT_CERT_NAMES", ",".join(DEFAULT_AGENT_CERT_NAMES)).split(",") if n.strip())
    if not agent_cert_names:
        raise ConfigError("SCHEDULER_AGENT_CERT_NAMES: at least one common name is required "
                          "(agents would otherwise be allowed every RPC)")
    operator_cert_names = tuple(n.strip() for n in r.text(
        "SCHEDULER_OPERATOR_CERT_NAMES", "").split(",") if n.strip())
    binding_text = r.text("SCHEDULER_NODE_BINDING", NodeBinding.ENDPOINT.value).lower()
    if binding_text not in {b.value for b in NodeBinding}:
        raise ConfigError(f"SCHEDULER_NODE_BINDING: {binding_text!r} is not one of "
                          f"{', '.join(b.value for b in NodeBinding)}")
    sentinels, sentinel_master, sentinel_password = _sentinels(r)
    min_acks_text = r.raw("REDIS_MIN_REPLICAS_ACK")
    min_acks = None if min_acks_text is None else r.integer(
        "REDIS_MIN_REPLICAS_ACK", 0, minimum=0, maximum=64)
    lease_ttl = r.integer("SCHEDULER_LEADER_LEASE_TTL", 15, minimum=2, maximum=3600)
    renew = r.duration("SCHEDULER_LEADER_RENEW_DEADLINE", lease_ttl * 2 / 3, allow_zero=False)
    if renew >= lease_ttl:
        raise ConfigError(
            f"SCHEDULER_LEADER_RENEW_DEADLINE: {renew}s must be shorter than "
            f"SCHEDULER_LEADER_LEASE_TTL ({lease_ttl}s)"
        )
    settings = Settings(
        insecure=insecure,
        grpc_addr=r.text("PERSYS_GRPC_ADDR", "0.0.0.0"),
        grpc_port=grpc_port,
        metrics_port=r.integer("METRICS_PORT", 8084, minimum=0, maximum=65535),
        metrics_addr=r.text("SCHEDULER_METRICS_ADDR", ""),
        etcd_endpoints=endpoints,
        etcd_timeout_s=r.duration("SCHEDULER_ETCD_TIMEOUT", 5.0, allow_zero=False),
        etcd_root=r.text("SCHEDULER_ETCD_ROOT", ""),
        etcd_ca=etcd_files[0],
        etcd_cert=etcd_files[1],
        etcd_key=etcd_files[2],
        domain=r.text("DOMAIN", "persys.local"),
        agents_discovery_domain=r.text("AGENTS_DISCOVERY_DOMAIN", "agents.persys.cloud"),
        shard_key=r.text("SCHEDULER_SHARD_KEY", "genesis"),
        advertise_ip=r.text("SCHEDULER_ADVERTISE_IP", ""),
        advertise_port=r.integer("SCHEDULER_ADVERTISE_PORT", grpc_port, minimum=1, maximum=65535),
        redis_addr=r.text("REDIS_ADDR", ""),
        redis_password=r.text("REDIS_PASSWORD", ""),
        redis_db=r.integer("REDIS_DB", 0, minimum=0),
        redis_sentinels=sentinels,
        redis_sentinel_master=sentinel_master,
        redis_sentinel_password=sentinel_password,
        redis_min_replicas_ack=min_acks,
        redis_event_ttl_s=r.duration("REDIS_EVENT_TTL", 24 * 3600.0, allow_zero=False),
        redis_event_max_entries=r.integer("REDIS_EVENT_MAX_ENTRIES", 1000, minimum=1),
        event_stream=r.text("SCHEDULER_EVENT_STREAM", "scheduler:events"),
        event_outbox_max=r.integer("SCHEDULER_EVENT_OUTBOX_MAX", 100_000, minimum=1),
        meter_stream_enabled=r.flag("METER_REDIS_STREAM_ENABLED", True),
        meter_stream=r.text("METER_REDIS_STREAM", "persys:usage:stream"),
        meter_stream_maxlen=r.integer("METER_REDIS_STREAM_MAXLEN", 100_000, minimum=1),
        tls_ca=r.text("PERSYS_TLS_CA", DEFAULT_TLS_CA),
        tls_cert=r.text("PERSYS_TLS_CERT", DEFAULT_TLS_CERT),
        tls_key=r.text("PERSYS_TLS_KEY", DEFAULT_TLS_KEY),
        vault_enabled=r.flag("PERSYS_VAULT_ENABLED", False),
        agent_tls_enabled=r.flag("SCHEDULER_AGENT_TLS_ENABLED", not insecure),
        agent_cert_names=agent_cert_names,
        operator_cert_names=operator_cert_names,
        node_binding=NodeBinding(binding_text),
        nodes_per_host=r.integer("SCHEDULER_NODES_PER_HOST", 1, minimum=1, maximum=100_000),
        node_ready_after_dials=r.integer("SCHEDULER_NODE_READY_AFTER_DIALS", 3, minimum=1,
                                         maximum=100),
        grpc_max_concurrent_streams=r.integer("SCHEDULER_GRPC_MAX_CONCURRENT_STREAMS", 1024,
                                              minimum=1, maximum=1 << 20),
        grpc_min_ping_interval_s=r.duration("SCHEDULER_GRPC_MIN_PING_INTERVAL", 10.0,
                                            allow_zero=False),
        grpc_keepalive_time_s=r.duration("SCHEDULER_GRPC_KEEPALIVE_TIME", 60.0,
                                         allow_zero=False),
        grpc_keepalive_timeout_s=r.duration("SCHEDULER_GRPC_KEEPALIVE_TIMEOUT", 20.0,
                                            allow_zero=False),
        grpc_max_connection_idle_s=r.duration("SCHEDULER_GRPC_MAX_CONNECTION_IDLE", 1800.0,
                                              allow_zero=False),
        grpc_max_connection_age_s=r.duration("SCHEDULER_GRPC_MAX_CONNECTION_AGE", 0.0),
        grpc_max_connection_age_grace_s=r.duration("SCHEDULER_GRPC_MAX_CONNECTION_AGE_GRACE",
                                                   300.0),
        grpc_max_connections=r.integer("SCHEDULER_GRPC_MAX_CONNECTIONS", 16384, minimum=1,
                                       maximum=1 << 20),
        grpc_max_concurrent_rpcs=r.integer("SCHEDULER_GRPC_MAX_CONCURRENT_RPCS", 32768,
                                           minimum=1, maximum=1 << 20),
        grpc_handshake_timeout_s=r.duration("SCHEDULER_GRPC_HANDSHAKE_TIMEOUT", 20.0,
                                            allow_zero=False),
        grpc_max_unread_bytes_per_connection=r.integer(
            "SCHEDULER_GRPC_MAX_UNREAD_BYTES_PER_CONNECTION", 16 * 1024 * 1024,
            minimum=64 * 1024, maximum=1 << 40),
        grpc_max_unread_bytes=r.integer("SCHEDULER_GRPC_MAX_UNREAD_BYTES", 256 * 1024 * 1024,
                                        minimum=64 * 1024, maximum=1 << 40),
        watch_max=r.integer("SCHEDULER_WATCH_MAX", 8192, minimum=1, maximum=1_000_000),
        watch_max_per_caller=r.integer("SCHEDULER_WATCH_MAX_PER_CALLER", 1024, minimum=1,
                                       maximum=1_000_000),
        node_max_cpu_millicores=r.integer("SCHEDULER_NODE_MAX_CPU_MILLICORES",
                                          NODE_MAX_CPU_MILLICORES, minimum=1,
                                          maximum=NODE_CAPACITY_CEILING),
        node_max_memory_mb=r.integer("SCHEDULER_NODE_MAX_MEMORY_MB", NODE_MAX_MEMORY_MB,
                                     minimum=1, maximum=NODE_CAPACITY_CEILING),
        agent_rpc_timeout_s=r.duration("SCHEDULER_AGENT_RPC_TIMEOUT", 10.0, allow_zero=False),
        agent_apply_timeout_s=r.duration("SCHEDULER_AGENT_APPLY_TIMEOUT", 45.0),
        agent_vm_apply_timeout_s=r.duration("SCHEDULER_AGENT_VM_APPLY_TIMEOUT", 240.0),
        agent_delete_timeout_s=r.duration("SCHEDULER_AGENT_DELETE_TIMEOUT", 60.0),
        agent_status_poll_interval_s=r.duration("SCHEDULER_AGENT_STATUS_POLL_INTERVAL", 1.0),
        reconcile_interval_s=r.duration("SCHEDULER_RECONCILE_INTERVAL", 5.0, allow_zero=False),
        unplaceable=unplaceable,
        pending_max=r.integer("SCHEDULER_PENDING_MAX", 10_000, minimum=0, maximum=10_000_000),
        reconcile_concurrency=r.integer("SCHEDULER_RECONCILE_CONCURRENCY", 64, minimum=1,
                                    maximum=4096),
        drift_detect_interval_s=r.duration("SCHEDULER_DRIFT_DETECT_INTERVAL", 300.0),
        node_unavailable_grace_s=r.duration("SCHEDULER_NODE_UNAVAILABLE_GRACE", 180.0),
        reapply_guard_s=r.duration("SCHEDULER_REAPPLY_GUARD", 45.0),
        heartbeat_interval_s=r.integer("SCHEDULER_HEARTBEAT_INTERVAL", 60, minimum=1),
        node_lease_ttl_s=r.integer("SCHEDULER_NODE_LEASE_TTL", 180, minimum=2),
        node_gc_after_s=r.duration("SCHEDULER_NODE_GC_AFTER", 24 * 3600.0),
        node_eviction_rate=r.number("SCHEDULER_NODE_EVICTION_RATE", 1.0, minimum=0.0,
                                    maximum=1e6),
        node_eviction_burst=r.integer("SCHEDULER_NODE_EVICTION_BURST", 10, minimum=1),
        unhealthy_node_threshold=r.number("SCHEDULER_UNHEALTHY_NODE_THRESHOLD", 0.55,
                                          minimum=0.0, maximum=1.0),
        reservation_ttl_s=r.duration("SCHEDULER_RESERVATION_TTL", 90.0),
        ha_mode=ha_mode,
        shard_count=shard_count,
        shard_index=shard_index,
        leader_lease_ttl_s=lease_ttl,
        leader_renew_deadline_s=renew,
        allow_empty_state=r.flag("SCHEDULER_ALLOW_EMPTY_STATE", False),
        dns_enabled=r.flag("SCHEDULER_DNS_REGISTRATION", True),
        relay_enabled=r.flag("SCHEDULER_RELAY_ENABLED", True),
        dns_lease_ttl_s=r.integer("SCHEDULER_DNS_LEASE_TTL", 15, minimum=2, maximum=3600),
        instance_id=r.text("SCHEDULER_INSTANCE_ID", "") or default_instance_id(),
        log_level=LOG_LEVELS[log_level],
        log_format=log_format,
        event_loop=event_loop,
        **trace_settings(env),
    )
    if settings.node_lease_ttl_s <= settings.heartbeat_interval_s:
        raise ConfigError(
            f"SCHEDULER_NODE_LEASE_TTL: {settings.node_lease_ttl_s}s must exceed "
            f"SCHEDULER_HEARTBEAT_INTERVAL ({settings.heartbeat_interval_s}s)"
        )
    if settings.etcd_tls is not None and any(
            e.lower().startswith("http://") for e in settings.etcd_endpoints):
        raise ConfigError("ETCD_ENDPOINTS: an http:// endpoint with SCHEDULER_ETCD_CA/_CERT/_KEY "
                          "set would talk to etcd in plaintext; use https:// or no scheme")
    if not insecure:
        for name, path in (("PERSYS_TLS_CA", settings.tls_ca), ("PERSYS_TLS_CERT",
                           settings.tls_cert), ("PERSYS_TLS_KEY", settings.tls_key)):
            if not path:
                raise ConfigError(f"{name}: required unless -insecure")
    return settings
