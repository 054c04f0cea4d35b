"""A workload's persistence class: may it move away from its node?

Pure (spec, metadata) -> answer, shared by placement, relocation and the reconcile planner:
a workload whose data lives on its node's disk stays there unless it says it may move.
"""

from __future__ import annotations

from typing import Any

from eventsource.records import WorkloadSpec
from handlers.placement.decision import canonical_driver


def managed_volumes_of(spec: WorkloadSpec) -> list[Any]:
    """A spec's managed volumes (a VM keeps its own list)."""
    return list(spec.managed_volumes or (spec.vm or {}).get("managedVolumes") or [])


TRUTHY = frozenset({"true", "1", "yes"})


def persistence_class(spec: WorkloadSpec, metadata: dict[str, object]) -> str:
    """ephemeral, node-local or shared-storage (docs/compatibility.md, "Persistence class")."""

    def truthy(key: str) -> bool:
        return str(metadata.get(key, "")).strip().lower() in TRUTHY

    explicit = str(metadata.get("persys.scheduling.persistence_class", "")).strip().lower()
    if explicit in ("ephemeral", "node-local", "shared-storage"):
        return explicit
    if spec.type in ("vm", "microvm") and not truthy("persys.storage.shared"):
        return "node-local"
    if truthy("persys.storage.local"):
        return "node-local"
    if truthy("persys.storage.shared"):
        return "shared-storage"
    for key, value in metadata.items():
        if ("host_path" in key or "bind_mount" in key) and str(value).strip():
            return "node-local"
    # data on this node's disk: a container's host-path volumes, or a managed volume of the
    # local driver (the Go version called these ephemeral and moved them away from their
    # data: docs/compatibility.md, "Local data")
    if spec.volumes:
        return "node-local"
    volumes = spec.managed_volumes or (spec.vm or {}).get("managedVolumes") or []
    if any(isinstance(mv, dict) and canonical_driver(str(mv.get("driver", ""))) == "local"
           for mv in volumes):
        return "node-local"
    return "ephemeral"


def is_node_local(spec: WorkloadSpec, metadata: dict[str, object]) -> bool:
    """Node-local and not allowed to move (``persys.scheduling.allow_move``)."""
    allow = str(metadata.get("persys.scheduling.allow_move", metadata.get("allow_move", "")))
    return persistence_class(spec, metadata) == "node-local" and allow.strip().lower() not in (
        TRUTHY
    )
