"""The disk API: standalone volumes recorded under ``/volumes/<id>`` (docs/compatibility.md,
"Disks").

Records are created with a create-only compare and deleted with a compare on the revision that
was checked, so a concurrent attach (which adds a workload reference) cannot be lost by a
delete. Unlike the Go version, deleting an unknown disk is NOT_FOUND, a disk name is unique among
standalone disks, a disk still referenced by workloads is refused unless forced, and unknown
drivers are refused. Nothing is sent to agents: backends are provisioned on first attach.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eventsource.clock import Clock
from eventsource.commit import Change, Committer
from eventsource.errors import Conflict
from eventsource.etcd import AsyncEtcd, Compare, Delete, KeyValue, Put
from eventsource.events import rfc3339
from eventsource.keys import KeyLayout
from handlers.placement.decision import canonical_driver
from handlers.specs.fields import InvalidSpec, check_mount_path, validate_id

DRIVERS = frozenset({"local", "nfs", "ceph-rbd"})
ACCESS_MODES = frozenset({"ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany"})
#: create attempts when other volume writes keep coming first
CREATE_ATTEMPTS = 5
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
#: a file system type as mkfs names it (ext4, xfs, btrfs, ...)
_FS_TYPE = re.compile(r"^[A-Za-z0-9._-]{0,32}$")
#: the largest disk one may ask for: 1 PiB (the agent's backends take a size in GB)
SIZE_GB_MAX = 1 << 20


class DiskError(Exception):
    """``code`` is the gRPC status name the servicer answers with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class DiskRequest:
    name: str
    driver: str
    size_gb: int
    fs_type: str
    access_mode: str
    retain_policy: str
    node_id: str
    mount_path: str


def validate(req: DiskRequest) -> dict[str, Any]:
    """The new record's fields, or ``DiskError(INVALID_ARGUMENT)`` naming the field."""
    name = req.name.strip().lower()
    if not name:
        raise DiskError("INVALID_ARGUMENT", "name: required")
    if not _NAME.match(name):
        raise DiskError("INVALID_ARGUMENT",
                        "name: 1-63 lower-case letters, digits, '.', '_' or '-'")
    if not req.driver.strip():
        raise DiskError("INVALID_ARGUMENT", "driver: required (local, nfs or ceph-rbd)")
    driver = canonical_driver(req.driver)
    if driver not in DRIVERS:
        raise DiskError("INVALID_ARGUMENT", f"driver: {req.driver!r} is not local, nfs or ceph-rbd")
    if req.size_gb < 0:
        raise DiskError("INVALID_ARGUMENT", "size_gb: must not be negative")
    if req.size_gb > SIZE_GB_MAX:
        raise DiskError("INVALID_ARGUMENT", f"size_gb: more than {SIZE_GB_MAX} GB")
    if not _FS_TYPE.match(req.fs_type.strip()):
        raise DiskError("INVALID_ARGUMENT",
                        "fs_type: at most 32 letters, digits, '.', '_' or '-'")
    node_id = req.node_id.strip()
    try:
        if node_id:
            validate_id("node_id", node_id)
        check_mount_path("mount_path", req.mount_path.strip())
    except InvalidSpec as exc:
        raise DiskError("INVALID_ARGUMENT", str(exc)) from None
    retain = req.retain_policy.strip() or "Delete"
    if retain not in ("Delete", "Retain"):
        raise DiskError("INVALID_ARGUMENT", "retain_policy: must be Delete or Retain")
    access = req.access_mode.strip() or "ReadWriteOnce"
    if access not in ACCESS_MODES:
        raise DiskError("INVALID_ARGUMENT", f"access_mode: must be one of {sorted(ACCESS_MODES)}")
    if req.node_id and driver != "local":
        raise DiskError("INVALID_ARGUMENT", "node_id: only local disks are pinned to a node")
    return {
        "name": name,
        "driver": driver,
        "sizeGb": req.size_gb or 1,
        "fsType": req.fs_type.strip() or ("" if driver == "local" else "ext4"),
        "accessMode": access,
        "retainPolicy": retain,
        "phase": "Pending" if driver == "local" else "Available",
        "lastError": "",
        "workloadRefs": [],
        "attachedNodes": [],
        "nodeId": node_id,
        "device": f"rbd:{name}" if driver == "ceph-rbd" else "",
        "standalone": True,
        "mountPath": req.mount_path.strip() or "/data",
    }


class DiskCommands:
    def __init__(self, etcd: AsyncEtcd, committer: Committer, layout: KeyLayout,
                 clock: Clock, *,
                 volume_users: Callable[[str, str], list[str]] | None = None,
                 node_exists: Callable[[str], bool] | None = None) -> None:
        self.etcd = etcd
        self.committer = committer
        self.layout = layout
        self.clock = clock
        #: the workloads whose specs hold a managed volume of (driver, name): a disk made
        #: with that name would be their volume on the agent, which knows volumes by those two
        self.volume_users = volume_users
        #: whether a node is registered (a local disk pinned to a node that does not exist
        #: would never be provisioned)
        self.node_exists = node_exists

    async def _all(self) -> list[tuple[KeyValue, dict[str, Any]]]:
        return (await self._listed())[0]

    async def _listed(self) -> tuple[list[tuple[KeyValue, dict[str, Any]]], int]:
        """Every volume record, and the revision of the listing."""
        kvs, revision = await self.etcd.list_prefix(self.layout.volumes_prefix)
        out = []
        for kv in kvs:
            try:
                record = json.loads(kv.value)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append((kv, record))
        return out, revision

    async def create(self, req: DiskRequest) -> dict[str, Any]:
        """Create a standalone disk whose name no other standalone disk has.

        The name check holds at commit: the transaction compares that no volume record was
        created or changed since the listing it checked, so of two concurrent creates of one
        name the second re-lists and is refused.
        """
        fields = validate(req)
        if fields["nodeId"] and self.node_exists is not None \
                and not self.node_exists(fields["nodeId"]):
            raise DiskError("INVALID_ARGUMENT", f"node_id: node {fields['nodeId']!r} is not "
                                                "registered")
        for _ in range(CREATE_ATTEMPTS):
            listed, revision = await self._listed()
            for _, existing in listed:
                if existing.get("standalone") and existing.get("name") == fields["name"]:
                    raise DiskError("ALREADY_EXISTS",
                                    f"name: a disk named {fields['name']!r} exists")
            users = (self.volume_users(str(fields.get("driver") or "local"), fields["name"])
                     if self.volume_users is not None else [])
            if users:
                # a disk force-deleted while attached is still their volume on the agent
                raise DiskError("ALREADY_EXISTS",
                                f"name: workloads {sorted(users)[:10]} still have a volume "
                                f"named {fields['name']!r}; delete or update them first")
            now = rfc3339(self.clock.now())
            disk_id = f"disk-{uuid.uuid4()}"
            record = {"id": disk_id, **fields, "createdAt": now, "updatedAt": now}
            key = self.layout.volume(disk_id)
            try:
                await self.committer.commit(Change(
                    kind="disk",
                    compares=[Compare.absent(key),
                              Compare.unchanged_since(self.layout.volumes_prefix, revision)],
                    puts=[Put(key, json.dumps(record).encode(), category="other")]))
            except Conflict:
                continue  # another volume write came first: check the names again
            return record
        raise DiskError("ABORTED", "volumes changed during every attempt to create the disk; "
                                   "retry")

    async def list(self) -> list[dict[str, Any]]:
        return sorted((r for _, r in await self._all()), key=lambda r: str(r.get("id", "")))

    async def get(self, disk_id: str) -> tuple[KeyValue, dict[str, Any]]:
        try:
            disk_id = validate_id("disk_id", disk_id)
        except InvalidSpec as exc:
            raise DiskError("INVALID_ARGUMENT", str(exc)) from None
        kv = await self.etcd.get(self.layout.volume(disk_id))
        if kv is None:
            raise DiskError("NOT_FOUND", f"disk {disk_id!r} not found")
        record = json.loads(kv.value)
        record.setdefault("id", disk_id)
        return kv, record

    async def delete(self, disk_id: str, *, force: bool) -> None:
        kv, record = await self.get(disk_id)
        refs = list(record.get("workloadRefs") or [])
        if refs and not force:
            raise DiskError("FAILED_PRECONDITION",
                            f"disk {disk_id!r} is used by workloads {refs[:10]}; "
                            "delete them first or pass force")
        try:
            await self.committer.commit(Change(
                kind="disk", compares=[Compare.mod(kv.key, kv.mod_revision)],
                deletes=[Delete(kv.key, category="other")]))
        except Conflict as exc:
            raise DiskError("ABORTED", f"disk {disk_id!r} changed while deleting; retry") from exc
