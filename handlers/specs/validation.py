"""Validation of an ApplyWorkloadRequest and its conversion to the stored spec record.

Validation answers with the field path and the reason (``InvalidSpec``), which the servicer turns
into the in-band ``INVALID_SPEC`` answer Go clients read. Conversion follows the Go scheduler
(docs/compatibility.md, "ApplyWorkload conversion" and "Agent apply request") except
where that version lost data: container managed volumes are kept, and the spec's creation time
is read back. A spec is refused here when the agent request could not be built from it
(``agent_request``), and a VM spec's JSON is read by ``vm_spec``.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from eventsource.records import Resources, WorkloadSpec
from handlers.placement.decision import canonical_driver, canonical_type
from handlers.specs.agent_request import CONVERSION_ERRORS, agent_apply_request
from handlers.specs.fields import InvalidSpec, validate_id
from handlers.specs.stored import normalize_desired_state
from handlers.specs.vm_spec import NO_PASSWORDS, normalize_vm_json, secret_key
from proto.persys.control.v1 import control_pb2

WORKLOAD_TYPES = frozenset({"container", "compose", "vm", "microvm"})


@dataclass(frozen=True, slots=True)
class ParsedApply:
    """A validated ApplyWorkloadRequest."""

    workload_id: str
    desired_state: str
    spec: WorkloadSpec | None
    metadata: dict[str, str]


def _check_nonneg(field: str, value: int) -> None:
    if value < 0:
        raise InvalidSpec(field, f"must not be negative (got {value})")


def _managed_volumes(field: str, volumes: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, mv in enumerate(volumes):
        if not mv.name.strip():
            raise InvalidSpec(f"{field}[{i}].name", "required")
        _check_nonneg(f"{field}[{i}].size_gb", mv.size_gb)
        retain = mv.retain_policy or "Delete"
        if retain not in ("Delete", "Retain"):
            raise InvalidSpec(f"{field}[{i}].retain_policy", "must be Delete or Retain")
        out.append(
            {
                "name": mv.name.strip(),
                "driver": canonical_driver(mv.driver),
                "size_gb": mv.size_gb,
                "access_mode": mv.access_mode,
                "fs_type": mv.fs_type,
                "mount_path": mv.mount_path,
                "read_only": mv.read_only,
                "retain_policy": retain,
            }
        )
    return out


def parse_apply(req: control_pb2.ApplyWorkloadRequest, *, created_at: str) -> ParsedApply:
    """Validate an ApplyWorkloadRequest and convert it; raises ``InvalidSpec``."""
    workload_id = validate_id("workload_id", req.workload_id)
    desired = normalize_desired_state(req.desired_state)
    if not req.HasField("spec"):
        return ParsedApply(workload_id, desired, None, {})
    spec = req.spec
    wtype = canonical_type(spec.type)
    if not wtype:
        wtype = {"container": "container", "compose": "compose", "vm": "vm"}.get(
            spec.WhichOneof("workload") or "", ""
        )
    if wtype not in WORKLOAD_TYPES:
        raise InvalidSpec(
            "spec.type", f"unknown workload type {spec.type!r} (container, compose, vm, microvm)"
        )
    secret = secret_key(spec.metadata)
    if secret is not None:
        raise InvalidSpec(f"spec.metadata[{secret}]", NO_PASSWORDS)
    res = spec.resources
    _check_nonneg("spec.resources.cpu_millicores", res.cpu_millicores)
    _check_nonneg("spec.resources.memory_mb", res.memory_mb)
    _check_nonneg("spec.resources.disk_gb", res.disk_gb)
    record = WorkloadSpec(
        id=workload_id,
        name=workload_id,
        type=wtype,
        revision_id=req.revision_id.strip(),
        desired_state=desired,
        resources=Resources(
            cpu_usage=res.cpu_millicores / 1000.0,
            memory_usage=float(res.memory_mb),
            disk_usage=float(res.disk_gb),
        ),
        created_at=created_at,
    )
    metadata = {str(k): str(v) for k, v in spec.metadata.items()}
    if wtype == "container":
        if spec.WhichOneof("workload") != "container":
            raise InvalidSpec("spec.container", "required for type container")
        c = spec.container
        if c.privileged:
            # the agent's ContainerSpec has no such field: running it unprivileged instead
            # would not be what was asked (the Go version dropped it: docs/compatibility.md,
            # "Privileged containers")
            raise InvalidSpec("spec.container.privileged",
                              "not supported: agents cannot run privileged containers")
        if not c.image.strip():
            raise InvalidSpec("spec.container.image", "required")
        record.image = c.image.strip()
        record.command_list = list(c.command)
        record.command = " ".join(c.command)
        record.env_vars = dict(c.env)
        record.restart_policy = c.restart_policy
        for i, p in enumerate(c.ports):
            if not 0 <= p.host_port <= 65535:
                raise InvalidSpec(f"spec.container.ports[{i}].host_port", "must be 0-65535")
            if not 1 <= p.container_port <= 65535:
                raise InvalidSpec(f"spec.container.ports[{i}].container_port", "must be 1-65535")
            record.ports.append(f"{p.host_port}:{p.container_port}/{p.protocol or 'tcp'}")
        for i, v in enumerate(c.volumes):
            if not v.host_path or not v.container_path:
                raise InvalidSpec(f"spec.container.volumes[{i}]", "host_path and container_path")
            record.volumes.append(
                f"{v.host_path}:{v.container_path}" + (":ro" if v.read_only else "")
            )
        record.managed_volumes = _managed_volumes("spec.container.managed_volumes",
                                                  c.managed_volumes)
    elif wtype == "compose":
        if spec.WhichOneof("workload") != "compose":
            raise InvalidSpec("spec.compose", "required for type compose")
        cs = spec.compose
        source = (cs.source_type or ("git" if cs.git_repo else "inline")).lower()
        if source == "git":
            # the agent's ComposeSpec carries only the YAML: a git source would be committed
            # and then fail every apply (the Go version did that: docs/compatibility.md,
            # "Git-sourced compose")
            raise InvalidSpec("spec.compose.source_type",
                              "git is not supported: agents take only the compose YAML; "
                              "send it as inline_yaml")
        if source == "inline":
            if not cs.inline_yaml.strip():
                raise InvalidSpec("spec.compose.inline_yaml", "required for source_type inline")
            record.compose_yaml = cs.inline_yaml
        else:
            raise InvalidSpec("spec.compose.source_type", "must be git or inline")
        record.env_vars = dict(cs.env)
    else:
        vm = _vm_from_request(spec, metadata)
        record.vm = vm
    check_agent_request(record, metadata, desired)
    return ParsedApply(workload_id, desired, record, metadata)


def check_agent_request(record: WorkloadSpec, metadata: dict[str, str], desired: str) -> None:
    """Build the agent request once, so that a spec the agent could never be sent is refused
    at ApplyWorkload with the field named, not committed and then failing in every dispatch
    and reconcile cycle. The VM spec arrives as free-form JSON (``persys.vm_spec_b64``)."""
    try:
        agent_apply_request(record, metadata, desired)
    except CONVERSION_ERRORS as exc:
        field = ("spec.metadata[persys.vm_spec_b64]" if metadata.get("persys.vm_spec_b64")
                 else f"spec.{record.type}" if record.type in ("vm", "microvm") else "spec")
        raise InvalidSpec(field, f"cannot be sent to an agent: {exc}") from exc


def _vm_from_request(spec: control_pb2.WorkloadSpec, metadata: dict[str, str]) -> dict[str, Any]:
    encoded = metadata.get("persys.vm_spec_b64", "")
    if encoded:
        try:
            decoded = json.loads(base64.b64decode(encoded))
        except (binascii.Error, ValueError, RecursionError) as exc:
            raise InvalidSpec("spec.metadata[persys.vm_spec_b64]", "not base64 JSON (or "
                              "nested too deeply)") from exc
        if not isinstance(decoded, dict):
            raise InvalidSpec("spec.metadata[persys.vm_spec_b64]", "not a JSON object")
        return normalize_vm_json(decoded)
    if spec.WhichOneof("workload") != "vm":
        raise InvalidSpec("spec.vm", "required for type vm")
    v = spec.vm
    if v.vcpus <= 0:
        raise InvalidSpec("spec.vm.vcpus", "must be positive")
    if v.memory_mb <= 0:
        raise InvalidSpec("spec.vm.memory_mb", "must be positive")
    disks = []
    for i, d in enumerate(v.disks):
        _check_nonneg(f"spec.vm.disks[{i}].size_gb", d.size_gb)
        disks.append({"device": d.mount_point or "vda", "format": "qcow2", "type": "disk",
                      "sizeGb": d.size_gb or 20, "storage": d.pool_name})
    networks = [{"network": n.bridge, "ipAddress": n.static_ip, "bridge": n.bridge}
                for n in v.networks]
    ci = v.cloud_init
    return {
        "vcpus": v.vcpus,
        "memoryMb": v.memory_mb,
        "osImage": v.os_image,
        "disks": disks,
        "networks": networks,
        "cloudInitConfig": {"userData": ci.user_data, "metaData": ci.meta_data,
                            "networkConfig": ci.network_config, "vendorData": ci.vendor_data},
        "managedVolumes": _managed_volumes("spec.vm.managed_volumes", v.managed_volumes),
    }


def spec_size(req: control_pb2.ApplyWorkloadRequest) -> int:
    return int(req.ByteSize())
