"""Workload specs: validation of API input, conversion to the stored record, and the agent
request built from the record.

Validation answers with the field path and the reason (``InvalidSpec``), which the servicer turns
into the in-band ``INVALID_SPEC`` answer Go clients read. Conversion follows the Go scheduler
(persys-facts B "ApplyWorkload" and C "How the scheduler builds an agent apply request") except
where that version lost data: container managed volumes are kept, and the spec's creation time
is read back.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from eventsource.records import Resources, WorkloadSpec, WorkloadStatus
from handlers.placement.decision import canonical_driver, canonical_type
from proto.persys.agent.v1 import agent_pb2
from proto.persys.control.v1 import control_pb2

WORKLOAD_TYPES = frozenset({"container", "compose", "vm", "microvm"})
_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$")


class InvalidSpec(ValueError):
    """Bad input: ``field`` names the offending field, the message says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def normalize_desired_state(value: str) -> str:
    """E2: stop/stopped -> Stopped; delete/deleted -> Deleted; anything else -> Running."""
    v = value.strip().lower()
    if v in ("stop", "stopped"):
        return "Stopped"
    if v in ("delete", "deleted"):
        return "Deleted"
    return "Running"


#: statuses of a workload whose delete is committed
DELETING_STATUSES = frozenset({"Deleting", "Deleted"})


def being_deleted(spec: WorkloadSpec, status: WorkloadStatus) -> bool:
    """A delete is committed: nothing may apply the workload again, only delete it."""
    return (normalize_desired_state(spec.desired_state) == "Deleted"
            or status.status in DELETING_STATUSES)


def validate_id(field: str, value: str) -> str:
    text = value.strip()
    if not text:
        raise InvalidSpec(field, "required")
    if not _ID_PATTERN.match(text):
        raise InvalidSpec(
            field, "must be 1-253 characters of letters, digits, '.', '_', ':' or '-'"
        )
    return text


#: Bounds on node labels and taints. Why: they live in the node record, which every node write
#: rewrites and every replica watches, and they are copied into events; Kubernetes bounds a
#: label key to 253 characters (with its prefix) and we allow longer values than its 63.
LABEL_KEY_MAX = 253
LABEL_VALUE_MAX = 1024
LABELS_MAX = 256


def check_label(field: str, key: str, value: str) -> None:
    """Refuse a label or taint whose key or value is too long (``field`` names it)."""
    if len(key) > LABEL_KEY_MAX:
        raise InvalidSpec(f"{field}.key", f"longer than {LABEL_KEY_MAX} characters")
    if len(value) > LABEL_VALUE_MAX:
        raise InvalidSpec(f"{field}.value", f"longer than {LABEL_VALUE_MAX} characters")


def check_labels(field: str, labels: dict[str, str]) -> None:
    if len(labels) > LABELS_MAX:
        raise InvalidSpec(field, f"more than {LABELS_MAX} labels")
    for key, value in labels.items():
        check_label(f"{field}[{key[:LABEL_KEY_MAX]}]", key, value)


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
    secret = _secret_key(spec.metadata)
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
            # would not be what was asked (the Go version dropped it, persys-facts I.24)
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
            # and then fail every apply (the Go version did that, persys-facts I.24)
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


#: What converting a stored spec to an agent request raises when a field has the wrong shape
#: (a JSON string where a number belongs, a list of strings for a list of objects, a number
#: beyond the agent message's integer range).
CONVERSION_ERRORS = (ValueError, TypeError, AttributeError, KeyError, OverflowError,
                     RecursionError)


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


#: Why a VM password is refused. The Go scheduler stored it in etcd in plain text and copied it
#: into the agent's metadata (persys-facts I.21); specs live in etcd, which holds no secrets.
NO_PASSWORDS = ("VM passwords are not accepted: workload specs are stored in etcd, which never "
                "holds secrets; give cloudInitConfig.sshPublicKey, or a hashed password in "
                "cloud-init userData")
SECRET_METADATA = frozenset({"persys.vm.password"})


def _schema(*keys: str) -> dict[str, str]:
    """Spelling-free key -> the stored spelling. The Go gateway encodes the VM spec with
    snake_case keys (which Go decodes without regard to case); stored records and this
    scheduler's own clients use camelCase. Both are read; anything else is dropped."""
    return {_loose(k): k for k in keys}


def _loose(key: object) -> str:
    return str(key).replace("_", "").lower()


_VM_KEYS = _schema("name", "vcpus", "memoryMb", "osImage", "diskGb", "disks", "networks",
                   "cloudInit", "metadata", "cloudInitConfig", "managedVolumes", "runtime")
_DISK_KEYS = _schema("path", "device", "format", "sizeGb", "type", "boot", "backingFile",
                     "storage")
_NETWORK_KEYS = _schema("network", "macAddress", "ipAddress", "hostDevName", "model", "bridge")
_CLOUD_INIT_KEYS = _schema("userData", "metaData", "networkConfig", "vendorData", "username",
                           "sshPublicKey")
_VOLUME_KEYS = _schema("name", "driver", "size_gb", "access_mode", "fs_type", "mount_path",
                       "read_only", "retain_policy")


def _pick(value: Any, schema: dict[str, str]) -> Any:
    """``value``'s known keys in their stored spelling; a value of the wrong shape is kept
    as it is, for ``check_agent_request`` to refuse naming the field."""
    if not isinstance(value, dict):
        return value
    return {schema[_loose(k)]: v for k, v in value.items() if _loose(k) in schema}


def _pick_each(value: Any, schema: dict[str, str]) -> Any:
    return [_pick(item, schema) for item in value] if isinstance(value, list) else value


def normalize_vm_json(decoded: dict[str, Any]) -> dict[str, Any]:
    """The VM spec of ``persys.vm_spec_b64`` in the stored schema; refuses a password under
    any spelling (InvalidSpec)."""
    field = "spec.metadata[persys.vm_spec_b64]"
    vm: dict[str, Any] = _pick(decoded, _VM_KEYS)
    cloud_init = vm.get("cloudInitConfig")
    if isinstance(cloud_init, dict):
        if any(_loose(k) == "password" and v for k, v in cloud_init.items()):
            raise InvalidSpec(f"{field}.cloudInitConfig.password", NO_PASSWORDS)
        vm["cloudInitConfig"] = _pick(cloud_init, _CLOUD_INIT_KEYS)
    metadata = vm.get("metadata")
    if isinstance(metadata, dict):
        secret = _secret_key(metadata)
        if secret is not None:
            raise InvalidSpec(f"{field}.metadata[{secret}]", NO_PASSWORDS)
    vm["disks"] = _pick_each(vm.get("disks", []), _DISK_KEYS)
    vm["networks"] = _pick_each(vm.get("networks", []), _NETWORK_KEYS)
    vm["managedVolumes"] = _pick_each(vm.get("managedVolumes", []), _VOLUME_KEYS)
    return vm


def _secret_key(metadata: Any) -> str | None:
    """The first key of ``metadata`` that names a secret (any case), or None."""
    for key in metadata:
        if str(key).strip().lower() in SECRET_METADATA:
            return str(key)
    return None


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


def compute_revision(spec: WorkloadSpec) -> str:
    """A content hash of the spec (24 hex chars), ignoring bookkeeping fields."""
    body = {
        "type": spec.type, "image": spec.image, "commandList": spec.command_list,
        "composeYaml": spec.compose_yaml, "gitRepo": spec.git_repo, "gitBranch": spec.git_branch,
        "envVars": spec.env_vars, "resources": [spec.resources.cpu_usage,
                                                spec.resources.memory_usage,
                                                spec.resources.disk_usage],
        "ports": spec.ports, "volumes": spec.volumes, "restartPolicy": spec.restart_policy,
        "vm": spec.vm, "managedVolumes": spec.managed_volumes, "labels": spec.labels,
        "desiredState": spec.desired_state,
    }
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
    return digest[:12].hex()


def request_of(spec: WorkloadSpec) -> tuple[int, int]:
    """(cpu millicores, memory MB) requested by a spec."""
    return round(spec.resources.cpu_usage * 1000), round(spec.resources.memory_usage)


def _split_port(text: str) -> agent_pb2.PortMapping | None:
    proto = "tcp"
    body = text
    if "/" in body:
        body, proto = body.rsplit("/", 1)
    host, _, container = body.partition(":")
    try:
        return agent_pb2.PortMapping(host_port=int(host or 0), container_port=int(container),
                                     protocol=proto)
    except ValueError:
        return None


def _managed_volume_pb(mv: dict[str, Any]) -> agent_pb2.ManagedVolumeSpec:
    return agent_pb2.ManagedVolumeSpec(
        name=str(mv.get("name", "")), driver=str(mv.get("driver", "")),
        size_gb=int(mv.get("size_gb", 0)), access_mode=str(mv.get("access_mode", "")),
        fs_type=str(mv.get("fs_type", "")), mount_path=str(mv.get("mount_path", "")),
        read_only=bool(mv.get("read_only", False)),
        retain_policy=str(mv.get("retain_policy", "")),
    )


def agent_apply_request(
    spec: WorkloadSpec, metadata: dict[str, Any], desired_state: str
) -> agent_pb2.ApplyWorkloadRequest:
    """The agent ApplyWorkloadRequest for a stored workload."""
    desired = (
        agent_pb2.DESIRED_STATE_STOPPED
        if desired_state.lower() in ("stopped", "stop")
        else agent_pb2.DESIRED_STATE_RUNNING
    )
    req = agent_pb2.ApplyWorkloadRequest(
        id=spec.id, revision_id=spec.revision_id or compute_revision(spec), desired_state=desired
    )
    cpu_m, mem_mb = request_of(spec)
    if spec.type == "container":
        req.type = agent_pb2.WORKLOAD_TYPE_CONTAINER
        c = req.spec.container
        c.image = spec.image
        c.command.extend(spec.command_list or spec.command.split())
        c.env.update(spec.env_vars)
        labels = spec.labels or {k: v for k, v in metadata.items() if isinstance(v, str)}
        c.labels.update(labels)
        c.restart_policy.policy = spec.restart_policy
        if cpu_m > 0 or mem_mb > 0:
            c.resources.cpu_shares = cpu_m
            c.resources.memory_bytes = mem_mb * 1024 * 1024
        for text in spec.ports:
            port = _split_port(text)
            if port is not None:
                c.ports.append(port)
        for text in spec.volumes:
            parts = text.split(":")
            if len(parts) >= 2:
                c.volumes.append(agent_pb2.VolumeMount(
                    host_path=parts[0], container_path=parts[1],
                    read_only=len(parts) > 2 and parts[2] == "ro"))
        c.managed_volumes.extend(_managed_volume_pb(mv) for mv in spec.managed_volumes)
    elif spec.type == "compose":
        req.type = agent_pb2.WORKLOAD_TYPE_COMPOSE
        cs = req.spec.compose
        yaml = spec.compose_yaml or spec.compose
        cs.compose_yaml = base64.b64encode(yaml.encode()).decode() if yaml else ""
        cs.project_name = spec.project_name or re.sub(r"[^a-z0-9_-]", "-", spec.id.lower())
        cs.env.update(spec.env_vars)
    else:
        req.type = agent_pb2.WORKLOAD_TYPE_VM
        _fill_vm(req.spec.vm, spec)
    return req


#: the VM's cloud-init fields sent to the agent (JSON key, CloudInitConfig field); never the
#: password, which is refused at ApplyWorkload (``_refuse_secrets``)
_CLOUD_INIT_FIELDS = (("userData", "user_data"), ("metaData", "meta_data"),
                      ("networkConfig", "network_config"), ("vendorData", "vendor_data"),
                      ("username", "username"), ("sshPublicKey", "ssh_public_key"))


def _fill_vm(v: agent_pb2.VMSpec, spec: WorkloadSpec) -> None:
    """The agent VMSpec of a stored VM spec, as the Go scheduler builds it (persys-facts
    "How the scheduler builds an agent apply request"), minus the password."""
    vm = spec.vm or {}
    v.name = spec.id
    v.vcpus = int(vm.get("vcpus", 0))
    v.memory_mb = int(vm.get("memoryMb", 0))
    v.os_image = str(vm.get("osImage", ""))
    v.disk_gb = int(vm.get("diskGb", 0) or 0)
    v.runtime = "firecracker" if spec.type == "microvm" else str(vm.get("runtime", "") or "")
    v.cloud_init = str(vm.get("cloudInit", "") or "")
    meta = v.metadata
    meta.update({str(k): str(val) for k, val in (vm.get("metadata") or {}).items()
                 if str(k).strip().lower() not in SECRET_METADATA})  # records the Go version wrote
    if spec.type == "microvm":
        meta["persys.workload.type"] = "microvm"
    if v.os_image:
        meta["os_image"] = meta["persys.vm.os_image"] = v.os_image
    if v.disk_gb:
        meta["disk_gb"] = meta["persys.vm.disk_gb"] = str(v.disk_gb)
    if v.runtime:
        meta["runtime"] = meta["persys.vm.runtime"] = v.runtime
    cloud_init = vm.get("cloudInitConfig") or {}
    for key, field in _CLOUD_INIT_FIELDS:
        value = str(cloud_init.get(key, "") or "")
        if value:
            setattr(v.cloud_init_config, field, value)
    if v.cloud_init_config.username:
        meta["persys.vm.username"] = v.cloud_init_config.username
    if v.cloud_init_config.ssh_public_key:
        meta["persys.vm.ssh_public_key"] = v.cloud_init_config.ssh_public_key
    for d in vm.get("disks", []):
        device = str(d.get("device") or "vda")
        disk_format = str(d.get("format") or "qcow2")
        suffix = "img" if disk_format == "raw" else "qcow2"
        v.disks.append(agent_pb2.DiskConfig(
            path=str(d.get("path") or f"/var/lib/libvirt/images/{spec.id}-{device}.{suffix}"),
            device=device, format=disk_format, type=str(d.get("type") or "disk"),
            size_gb=int(d.get("sizeGb") or 20), boot=bool(d.get("boot", False)),
            backing_file=str(d.get("backingFile") or ""), storage=str(d.get("storage") or "")))
    for n in vm.get("networks", []):
        host_dev = str(n.get("hostDevName") or "")
        bridge = str(n.get("bridge") or "")
        name = str(n.get("network") or "") or bridge or host_dev
        v.networks.append(agent_pb2.NetworkConfig(
            network=name, mac_address=str(n.get("macAddress") or ""),
            ip_address=str(n.get("ipAddress") or ""), host_dev_name=host_dev,
            model=str(n.get("model") or ""), bridge=bridge))
        if host_dev:
            meta[f"persys.vm.host_dev.{name}"] = host_dev
    v.managed_volumes.extend(_managed_volume_pb(mv) for mv in vm.get("managedVolumes", []))


def spec_size(req: control_pb2.ApplyWorkloadRequest) -> int:
    return int(req.ByteSize())
