"""The agent ApplyWorkloadRequest built from a stored workload spec, as the Go scheduler builds
it, minus the password.

Pure, and apart from the input validation because the dispatcher and the reconcile loop build
this request for every apply of a stored workload; ApplyWorkload builds it once more only to
refuse a spec the agent could never be sent (``validation.check_agent_request``).
"""

from __future__ import annotations

import base64
import re
from typing import Any

from eventsource.records import WorkloadSpec
from handlers.specs.stored import compute_revision, request_of
from handlers.specs.vm_spec import SECRET_METADATA
from proto.persys.agent.v1 import agent_pb2

#: What converting a stored spec to an agent request raises when a field has the wrong shape
#: (a JSON string where a number belongs, a list of strings for a list of objects, a number
#: beyond the agent message's integer range).
CONVERSION_ERRORS = (ValueError, TypeError, AttributeError, KeyError, OverflowError,
                     RecursionError)


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
    """The agent VMSpec of a stored VM spec, as the Go scheduler builds it (docs/compatibility.md,
    "Agent apply request"), minus the password."""
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
