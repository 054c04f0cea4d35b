"""The free-form VM spec an ApplyWorkload carries as base64 JSON (``persys.vm_spec_b64``), in
the stored schema, and the refusal of VM passwords under any spelling.

Pure, and apart from the request parsing because the VM spec is JSON of two spellings (the Go
gateway's snake_case, the stored camelCase) with its own key schemas, and the agent request
builder must leave out the same secret metadata the parser refuses.
"""

from __future__ import annotations

from typing import Any

from handlers.specs.fields import InvalidSpec

#: Why a VM password is refused. The Go scheduler stored it in etcd in plain text and copied it
#: into the agent's metadata (docs/compatibility.md, "VM passwords"); specs live in etcd, which
#: holds no secrets.
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
        secret = secret_key(metadata)
        if secret is not None:
            raise InvalidSpec(f"{field}.metadata[{secret}]", NO_PASSWORDS)
    vm["disks"] = _pick_each(vm.get("disks", []), _DISK_KEYS)
    vm["networks"] = _pick_each(vm.get("networks", []), _NETWORK_KEYS)
    vm["managedVolumes"] = _pick_each(vm.get("managedVolumes", []), _VOLUME_KEYS)
    return vm


def secret_key(metadata: Any) -> str | None:
    """The first key of ``metadata`` that names a secret (any case), or None."""
    for key in metadata:
        if str(key).strip().lower() in SECRET_METADATA:
            return str(key)
    return None
