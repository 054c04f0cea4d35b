"""A stored workload spec -> the ``WorkloadSpec`` message ApplyWorkload takes.

Why: ``persys workload ID -o yaml`` prints what was applied in the form ``persys apply`` reads,
so an operator can edit it and apply it again. The stored record is not the request (ports and
volumes are kept as strings, a VM as the agent's JSON), so this is the inverse of
``handlers.specs.validation.parse_apply``, tested as a round trip:
``parse_apply(spec_message(parse_apply(req)))`` stores the same record.

* A VM goes out as ``persys.vm_spec_b64`` metadata (its stored JSON), which ``parse_apply``
  reads back unchanged; the ``VMSpec`` message could not carry every stored key.
* Metadata: the ``persys.*`` keys the workload was applied with. The status's bookkeeping
  (``last_action``, retry state, what agents reported) is not part of the spec.
* Managed volumes that a standalone disk added (they carry ``disk_id``) are left out: the
  ``persys.disk.ids`` metadata brings them back.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

from eventsource.records import WorkloadSpec
from proto.persys.control.v1 import control_pb2

VM_TYPES = frozenset({"vm", "microvm"})
VM_SPEC_KEY = "persys.vm_spec_b64"


def spec_message(spec: WorkloadSpec, metadata: Mapping[str, Any]) -> control_pb2.WorkloadSpec:
    """The request form of ``spec``; ``metadata`` is the workload status's metadata."""
    msg = control_pb2.WorkloadSpec(
        type=spec.type,
        resources=control_pb2.ResourceRequirements(
            cpu_millicores=round(spec.resources.cpu_usage * 1000),
            memory_mb=round(spec.resources.memory_usage),
            disk_gb=round(spec.resources.disk_usage),
        ),
    )
    for key, value in metadata.items():
        if str(key).startswith("persys.") and key != VM_SPEC_KEY:
            msg.metadata[str(key)] = str(value)
    if spec.type in VM_TYPES:
        vm = dict(spec.vm or {})
        vm["managedVolumes"] = _own_volumes(vm.get("managedVolumes") or [])
        msg.metadata[VM_SPEC_KEY] = base64.b64encode(
            json.dumps(vm, sort_keys=True).encode()).decode()
    elif spec.type == "compose":
        msg.compose.source_type = "inline"
        msg.compose.inline_yaml = spec.compose_yaml
        msg.compose.env.update(spec.env_vars)
    else:
        _container(msg.container, spec)
    return msg


def _container(c: control_pb2.ContainerSpec, spec: WorkloadSpec) -> None:
    c.image = spec.image
    c.command.extend(spec.command_list or spec.command.split())
    c.env.update(spec.env_vars)
    c.restart_policy = spec.restart_policy
    for text in spec.ports:
        port = _port(text)
        if port is not None:
            c.ports.append(port)
    for text in spec.volumes:
        host, _, rest = text.partition(":")
        container, _, mode = rest.partition(":")
        c.volumes.append(control_pb2.VolumeMount(host_path=host, container_path=container,
                                                 read_only=mode == "ro"))
    for mv in _own_volumes(spec.managed_volumes):
        c.managed_volumes.append(control_pb2.ManagedVolumeSpec(
            name=str(mv.get("name", "")), driver=str(mv.get("driver", "")),
            size_gb=int(mv.get("size_gb", 0)), access_mode=str(mv.get("access_mode", "")),
            fs_type=str(mv.get("fs_type", "")), mount_path=str(mv.get("mount_path", "")),
            read_only=bool(mv.get("read_only", False)),
            retain_policy=str(mv.get("retain_policy", ""))))


def _port(text: str) -> control_pb2.Port | None:
    body, _, protocol = text.partition("/")
    host, _, container = body.rpartition(":")
    try:
        return control_pb2.Port(host_port=int(host or 0), container_port=int(container),
                                protocol=protocol or "tcp")
    except ValueError:
        return None


def _own_volumes(volumes: list[Any]) -> list[dict[str, Any]]:
    """The managed volumes the spec itself asked for (not those a standalone disk added)."""
    return [dict(v) for v in volumes if isinstance(v, dict) and not v.get("disk_id")]
