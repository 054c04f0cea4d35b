"""Standalone disks used by workloads: ``persys.disk.ids`` at ApplyWorkload.

A workload names its disks in metadata ``persys.disk.ids`` (or ``disk_ids``; in the spec's
metadata, else in a VM spec's metadata; separated by commas, spaces or semicolons), as in Go
(docs/compatibility.md, "Disks"). At creation:

* every disk must exist, and a ReadWriteOnce disk must not be used by another workload;
* a local disk already pinned to a node pins the workload there (the Go version recorded the
  pin and never enforced it: docs/compatibility.md, "Local data"); an unpinned local disk is
  pinned to the node the workload is placed on;
* the disk records (``workloadRefs``, ``attachedNodes``, ``nodeId``, phase ``Attached``) are
  written in the placement's own transaction, with a compare on each disk, so two workloads
  cannot both take one ReadWriteOnce disk, and a disk deleted meanwhile fails the placement;
* each disk becomes a managed volume of the spec (tagged with its ``disk_id``), which the
  agent provisions and mounts.

A workload moved to another node (drain, failover) takes its disks along: the move's
transaction rewrites each disk's ``attachedNodes`` (the old node stays only while another of
the disk's workloads is still there), with a compare on the disk. Only workloads whose disks
are not local move at all (a local disk makes the workload node-local).

Deleting the workload detaches its disks in the finalising transaction; DeleteDisk refuses a
disk that workloads still use. The disks of an existing workload cannot change (apply a new
workload instead): moving a volume between workloads is not something an agent can do.

Everything here but :func:`load_disks` is pure.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eventsource.etcd import AsyncEtcd, Compare, Put
from eventsource.keys import KeyLayout
from handlers.specs.fields import InvalidSpec

DISK_ID_KEYS = ("persys.disk.ids", "disk_ids")
FIELD = "spec.metadata[persys.disk.ids]"
_SEPARATORS = re.compile(r"[,;\s]+")
#: access modes that allow one workload only
EXCLUSIVE_MODES = frozenset({"ReadWriteOnce", "ReadWriteOncePod"})

#: a disk as read: (record, mod_revision), or None when there is no such disk
Found = tuple[dict[str, Any], int] | None


def disk_ids_of(metadata: Mapping[str, Any], vm: Mapping[str, Any] | None = None) -> list[str]:
    """The disk ids a workload names, in order, without duplicates."""
    sources: list[Mapping[str, Any]] = [metadata]
    vm_metadata = (vm or {}).get("metadata")
    if isinstance(vm_metadata, Mapping):
        sources.append(vm_metadata)
    for source in sources:
        for key in DISK_ID_KEYS:
            text = str(source.get(key, "") or "").strip()
            if text:
                return list(dict.fromkeys(p for p in _SEPARATORS.split(text) if p))
    return []


@dataclass(frozen=True, slots=True)
class AttachPlan:
    """What attaching a workload's disks requires and changes."""

    #: the node every pinned local disk is on (the workload must go there), or ""
    node_id: str
    #: disk id -> (record, mod revision) as read
    disks: dict[str, tuple[dict[str, Any], int]]

    def volumes(self) -> list[dict[str, Any]]:
        """The managed volumes the disks become in the spec."""
        return [volume_of(disk_id, record) for disk_id, (record, _) in self.disks.items()]

    def writes(self, layout: KeyLayout, workload_id: str, node_id: str,
               now: str) -> tuple[list[Compare], list[Put]]:
        """The compares and puts that attach the disks to ``workload_id`` on ``node_id``."""
        compares, puts = [], []
        for disk_id, (record, mod) in self.disks.items():
            compare, put = rewrite(layout, disk_id, mod,
                                   attached(record, workload_id, node_id, now))
            compares.append(compare)
            puts.append(put)
        return compares, puts


def rewrite(layout: KeyLayout, disk_id: str, mod: int,
            record: Mapping[str, Any]) -> tuple[Compare, Put]:
    """A disk record's new value, compared on the revision the old one was read at."""
    key = layout.volume(disk_id)
    return Compare.mod(key, mod), Put(key, json.dumps(record).encode(), category="other")


def used_by(found: Mapping[str, Found], workload_id: str
            ) -> list[tuple[str, dict[str, Any], int]]:
    """``(disk id, record, revision)`` of the disks read that list ``workload_id`` (a disk
    deleted meanwhile, or no longer listing it, has nothing to keep in step)."""
    return [(disk_id, entry[0], entry[1]) for disk_id, entry in found.items()
            if entry is not None and workload_id in (entry[0].get("workloadRefs") or [])]


def plan_attach(workload_id: str, disk_ids: list[str], found: Mapping[str, Found]
                ) -> AttachPlan:
    """Check the disks ``workload_id`` names; raises ``InvalidSpec`` naming the disk."""
    disks: dict[str, tuple[dict[str, Any], int]] = {}
    pins: dict[str, str] = {}
    for disk_id in disk_ids:
        entry = found.get(disk_id)
        if entry is None:
            raise InvalidSpec(FIELD, f"disk {disk_id!r} not found")
        record, mod = entry
        users = [w for w in record.get("workloadRefs") or [] if w != workload_id]
        if users and record.get("accessMode", "ReadWriteOnce") in EXCLUSIVE_MODES:
            raise InvalidSpec(FIELD, f"disk {disk_id!r} ({record.get('accessMode')}) is used "
                                     f"by workload {users[0]!r}")
        if record.get("driver") == "local" and record.get("nodeId"):
            pins[disk_id] = str(record["nodeId"])
        disks[disk_id] = (record, mod)
    if len(set(pins.values())) > 1:
        raise InvalidSpec(FIELD, "the local disks are on different nodes: "
                                 + ", ".join(f"{d} on {n}" for d, n in sorted(pins.items())))
    return AttachPlan(next(iter(pins.values()), ""), disks)


def volume_of(disk_id: str, record: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": str(record.get("name") or disk_id),
        "driver": str(record.get("driver") or "local"),
        "size_gb": int(record.get("sizeGb") or 1),
        "access_mode": str(record.get("accessMode") or "ReadWriteOnce"),
        "fs_type": str(record.get("fsType") or ""),
        "mount_path": str(record.get("mountPath") or "/data"),
        "read_only": record.get("accessMode") == "ReadOnlyMany",
        "retain_policy": str(record.get("retainPolicy") or "Delete"),
        "disk_id": disk_id,
    }


def attached(record: Mapping[str, Any], workload_id: str, node_id: str,
             now: str) -> dict[str, Any]:
    out = copy.deepcopy(dict(record))
    refs = list(out.get("workloadRefs") or [])
    if workload_id not in refs:
        refs.append(workload_id)
    nodes = list(out.get("attachedNodes") or [])
    if node_id not in nodes:
        nodes.append(node_id)
    out.update(workloadRefs=refs, attachedNodes=nodes, phase="Attached", updatedAt=now)
    if out.get("driver") == "local" and not out.get("nodeId"):
        out["nodeId"] = node_id  # the data will live there
    return out


def moved(record: Mapping[str, Any], workload_id: str, *, from_node: str, to_node: str,
          node_of: Mapping[str, str], now: str) -> dict[str, Any]:
    """The disk record once ``workload_id`` runs on ``to_node`` instead of ``from_node``.

    ``node_of`` maps the disk's other workloads to their nodes: ``from_node`` stays attached
    while one of them still runs there.
    """
    out = copy.deepcopy(dict(record))
    others_there = any(node_of.get(ref) == from_node
                       for ref in out.get("workloadRefs") or [] if ref != workload_id)
    nodes = [n for n in out.get("attachedNodes") or [] if n != from_node or others_there]
    if to_node not in nodes:
        nodes.append(to_node)
    out.update(attachedNodes=nodes, updatedAt=now)
    return out


def detached(record: Mapping[str, Any], workload_id: str, now: str) -> dict[str, Any]:
    out = copy.deepcopy(dict(record))
    refs = [w for w in out.get("workloadRefs") or [] if w != workload_id]
    out.update(workloadRefs=refs, updatedAt=now)
    if not refs:
        out["attachedNodes"] = []
        # a local disk keeps its node: its data is there
        out["phase"] = "Provisioned" if out.get("driver") == "local" else "Available"
    return out


def disk_ids_in_spec(volumes: list[Any]) -> list[str]:
    """The disks a stored spec's managed volumes came from."""
    return [str(v["disk_id"]) for v in volumes if isinstance(v, dict) and v.get("disk_id")]


async def load_disks(etcd: AsyncEtcd, layout: KeyLayout, disk_ids: list[str]
                     ) -> dict[str, Found]:
    """Each disk's record and revision, read from etcd (not a projection: disks are few and
    rarely used, and the placement's compare catches anything newer)."""
    found: dict[str, Found] = {}
    for disk_id in disk_ids:
        kv = await etcd.get(layout.volume(disk_id))
        record: Any = None
        if kv is not None:
            try:
                record = json.loads(kv.value)
            except ValueError:
                record = None
        found[disk_id] = (record, kv.mod_revision) if isinstance(record, dict) and kv else None
    return found
