"""The etcd key layout, under a configurable root prefix.

The persys keys (``/nodes/``, ``/workloads-spec/`` ...) are the Go version's, so a Go tool reading
etcd sees the same data. Keys that are new in this implementation live under
``/persys/scheduler/`` but never under the leader election prefix, which the Go version scans.
A non-empty root (``/t/<uuid>``) isolates tests that share one etcd server.
"""

from __future__ import annotations

from dataclasses import dataclass


def sanitize_segment(segment: str) -> str:
    """A key segment with ``/`` replaced, as the Go version writes drift and attachment keys."""
    return segment.replace("/", "_") or "_"


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """Builds every key the scheduler reads or writes."""

    root: str = ""

    def _k(self, path: str) -> str:
        return f"{self.root}{path}"

    # -- persys keys (shared with the Go version) -------------------------------------------
    @property
    def nodes_prefix(self) -> str:
        return self._k("/nodes/")

    def node(self, node_id: str) -> str:
        return self._k(f"/nodes/{node_id}")

    def node_status(self, node_id: str) -> str:
        return self._k(f"/nodes/{node_id}/status")

    @property
    def specs_prefix(self) -> str:
        return self._k("/workloads-spec/")

    def spec(self, workload_id: str) -> str:
        return self._k(f"/workloads-spec/{workload_id}")

    @property
    def statuses_prefix(self) -> str:
        return self._k("/workloads-status/")

    def status(self, workload_id: str) -> str:
        return self._k(f"/workloads-status/{workload_id}")

    def legacy_workload(self, workload_id: str) -> str:
        return self._k(f"/workloads/{workload_id}")

    @property
    def assignments_prefix(self) -> str:
        return self._k("/assignments/")

    def assignment(self, workload_id: str) -> str:
        return self._k(f"/assignments/{workload_id}")

    def retry(self, workload_id: str) -> str:
        return self._k(f"/retries/{workload_id}")

    @property
    def drifts_prefix(self) -> str:
        return self._k("/drifts/")

    def drift(self, node_id: str, workload_id: str, drift_type: str) -> str:
        wid = sanitize_segment(workload_id) if workload_id else "_unknown"
        return self._k(f"/drifts/{sanitize_segment(node_id)}/{wid}/{sanitize_segment(drift_type)}")

    @property
    def volumes_prefix(self) -> str:
        return self._k("/volumes/")

    def volume(self, volume_id: str) -> str:
        return self._k(f"/volumes/{volume_id}")

    @property
    def health(self) -> str:
        return self._k("/health")

    # -- keys new in this implementation ----------------------------------------------------
    @property
    def allocations_prefix(self) -> str:
        return self._k("/allocations/")

    def allocation(self, node_id: str) -> str:
        return self._k(f"/allocations/{node_id}")

    @property
    def outbox_prefix(self) -> str:
        return self._k("/persys/scheduler/outbox/")

    def outbox(self, event_id: str) -> str:
        return self._k(f"/persys/scheduler/outbox/{event_id}")

    @property
    def relay_election(self) -> str:
        return self._k("/persys/scheduler/relay")

    @property
    def relay_mark(self) -> str:
        return self._k("/persys/scheduler/relay-mark")

    @property
    def initialized(self) -> str:
        return self._k("/persys/scheduler/initialized")

    @property
    def alive_prefix(self) -> str:
        return self._k("/persys/scheduler/alive/")

    def alive(self, node_id: str) -> str:
        return self._k(f"/persys/scheduler/alive/{node_id}")

    def host_claim(self, host_key: str) -> str:
        """The last node that joined an agent endpoint host (``HostIndex.key`` spelling):
        every registration that adds a node to a host compares and rewrites it, so replicas
        registering two new nodes at one host at once cannot both find it free."""
        return self._k(f"/persys/scheduler/hosts/{host_key}")

    def leadership_record(self, label: str) -> str:
        """Who led a shard last (never under the election prefix, which Go ranges)."""
        return self._k(f"/persys/scheduler/leadership/{label}")

    @property
    def topology(self) -> str:
        """The shard topology every campaigning replica agrees on (handlers/cluster/topology.py)."""
        return self._k("/persys/scheduler/topology")

    @property
    def leader_elections(self) -> str:
        """Every election key of the leader, failover and shards alike."""
        return self._k("/persys/scheduler/leader/")

    def leader_election(self, *, active_active: bool, shard_index: int) -> str:
        """The Go version's election prefix (``concurrency.Election`` semantics)."""
        if active_active:
            return self._k(f"/persys/scheduler/leader/shard-{shard_index}")
        return self._k("/persys/scheduler/leader")

    def skydns(self, domain: str, *labels: str) -> str:
        reversed_domain = "/".join(reversed([p for p in domain.split(".") if p]))
        suffix = "".join(f"/{label}" for label in labels)
        return self._k(f"/skydns/{reversed_domain}{suffix}")


def prefix_end(prefix: bytes) -> bytes:
    """The exclusive end of a prefix range (etcd's ``range_end``)."""
    for i in range(len(prefix) - 1, -1, -1):
        if prefix[i] < 0xFF:
            return prefix[:i] + bytes([prefix[i] + 1])
    return b"\0"
