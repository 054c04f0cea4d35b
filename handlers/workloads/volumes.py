"""A workload's managed volumes as the apply commands handle them: the ones standalone disks
gave it, where new ones are appended, and the check that an inline volume is not a disk.

Apart because creating and updating a workload (and the relocator, for the disk-backed ones)
read and extend the same volume lists, and the agent takes them from a VM's own list.
"""

from __future__ import annotations

import json
from typing import Any

from eventsource.etcd import AsyncEtcd
from eventsource.keys import KeyLayout
from eventsource.records import WorkloadSpec
from handlers.storage.attachments import FIELD as DISK_FIELD
from handlers.workloads.outcome import Outcome
from handlers.workloads.persistence import managed_volumes_of


def disk_volumes(spec: WorkloadSpec) -> list[dict[str, Any]]:
    """The managed volumes a stored spec got from standalone disks."""
    return [v for v in managed_volumes_of(spec) if isinstance(v, dict) and v.get("disk_id")]


def add_volumes(spec: WorkloadSpec, volumes: list[dict[str, Any]]) -> None:
    """Append managed volumes where the agent request takes them from (a VM's own list)."""
    if not volumes:
        return
    if spec.type in ("vm", "microvm"):
        vm = dict(spec.vm or {})
        vm["managedVolumes"] = [*(vm.get("managedVolumes") or []), *volumes]
        spec.vm = vm
    else:
        spec.managed_volumes = [*spec.managed_volumes, *volumes]


async def inline_volume_clash(etcd: AsyncEtcd, layout: KeyLayout, spec: WorkloadSpec
                              ) -> Outcome | None:
    """INVALID_SPEC when an inline managed volume takes a standalone disk's driver and
    name: the agent knows a volume by those two, so it would be that disk, shared past the
    disk's access mode. A disk is attached with ``persys.disk.ids`` instead."""
    inline = {(str(v.get("driver")), str(v.get("name"))): i
              for i, v in enumerate(managed_volumes_of(spec))
              if isinstance(v, dict) and not v.get("disk_id")}
    if not inline:
        return None
    kvs, _ = await etcd.list_prefix(layout.volumes_prefix)
    for kv in kvs:
        try:
            disk = json.loads(kv.value)
        except ValueError:
            continue
        if not isinstance(disk, dict):
            continue
        index = inline.get((str(disk.get("driver") or "local"), str(disk.get("name"))))
        if index is not None:
            return Outcome(False, "INVALID_SPEC",
                           f"spec.managed_volumes[{index}].name: {disk.get('name')!r} "
                           f"({disk.get('driver') or 'local'}) is disk "
                           f"{disk.get('id') or kv.key.rsplit('/', 1)[-1]!r}; attach "
                           f"it with {DISK_FIELD} instead")
    return None
