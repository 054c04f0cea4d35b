"""What a simulated node is told to be: its behaviour and its certificates.

Apart from the node itself because the fleet, the command line and the tests build these values
without starting anything: :class:`NodeBehaviour` (capacity, advertised types, timings and the
failures to inject) and :class:`SimTls` (the PEM bytes of a Go agent's mTLS).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc


@dataclass(frozen=True)
class SimTls:
    """PEM bytes for mTLS both ways, as a Go agent has: the nodes' servers require a client
    certificate signed by ``ca``, and the fleet presents ``cert`` to the scheduler. One
    certificate serves every node (all of them listen on 127.0.0.1, which it must name)."""

    ca: bytes
    cert: bytes
    key: bytes

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


@dataclass
class NodeBehaviour:
    """How a simulated node behaves. Nodes share the instance they were given: changing a field
    changes every node holding it (use ``dataclasses.replace`` for one node)."""

    #: Delay between an accepted apply (PENDING) and its outcome (RUNNING/FAILED/STOPPED).
    apply_latency_s: float = 0.2
    #: Probability that an apply ends FAILED.
    failure_rate: float = 0.0
    #: Extra delay before answering every agent RPC.
    slow_answer_s: float = 0.0
    cpu_millicores: int = 8000
    memory_mb: int = 16384
    disk_gb: int = 100
    workload_types: list[str] = field(default_factory=lambda: ["container", "compose", "vm"])
    labels: dict[str, str] = field(default_factory=dict)
    storage_drivers: list[str] = field(default_factory=lambda: ["local"])
    #: Send per-workload usage snapshots in heartbeats (twice, as the Go agent does).
    report_usage: bool = True
    #: Types advertised whose runtime is missing: applies of them answer "runtime not
    #: available", as the Go agent does when the hypervisor or Docker is not running.
    missing_runtimes: list[str] = field(default_factory=list)
    #: Answer deletes with success=false (an agent that cannot remove a workload now).
    refuse_deletes: bool = False
    #: Delay between an accepted delete and the workload leaving the agent (a Go agent
    #: answers at once and removes the container or VM afterwards).
    delete_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.apply_latency_s < 0 or self.slow_answer_s < 0:
            raise ValueError("apply_latency_s and slow_answer_s must be >= 0")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be within [0, 1], got {self.failure_rate}")
        if self.cpu_millicores <= 0 or self.memory_mb <= 0:
            raise ValueError("cpu_millicores and memory_mb must be > 0")
