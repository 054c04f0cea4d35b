"""What ``persys apply -f`` and ``persys explain -f`` read: YAML or JSON, one or many documents.

Three shapes are accepted, recognised by their keys:

* **native**: an ``ApplyWorkloadRequest`` with its proto field names (``workload_id``,
  ``desired_state``, ``revision_id``, ``spec`` with ``type``, ``resources`` and one of
  ``container``/``compose``/``vm``, ``metadata``). ``persys workload ID -o yaml`` prints this
  form, so an output can be edited and applied again.
* **scheduler format**, the spec files of Go persysctl's ``scheduler apply``: a container
  (``image``, ``command``, ``env``, ``ports``, ``volumes``, ``restart_policy`` as a string,
  ``privileged``), a compose (``source_type``, ``inline_yaml``, ``env``) or a VM (``name``,
  ``vcpus``, ``memory_mb``, ``disks``, ``networks``, ``cloud_init``, ``cloud_init_config``,
  ``metadata``). The workload id comes from ``--id``, as with persysctl.
* **agent format**, persysctl's ``apply-container``/``apply-vm`` files: a container with
  ``resources: {cpu_shares, memory_bytes}`` (cpu_shares are millicores, as the Go scheduler
  wrote them) and ``restart_policy: {policy, max_retry_count}``, or a VM as above.

A VM in either persysctl format is sent as ``persys.vm_spec_b64`` metadata, its JSON with
snake_case keys, as the Go gateway sent it. Every error names the document and its line.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import yaml
from google.protobuf import json_format

from ops.persys.errors import InputError
from proto.persys.control.v1 import control_pb2

NATIVE_KEYS = frozenset({"workload_id", "spec", "desired_state", "revision_id"})
VM_KEYS = frozenset({"vcpus", "memory_mb", "disks", "networks", "cloud_init",
                     "cloud_init_config"})
COMPOSE_KEYS = frozenset({"source_type", "inline_yaml", "git_repo"})
SCHEDULER_CONTAINER_KEYS = frozenset({"image", "command", "env", "ports", "volumes",
                                      "restart_policy", "privileged"})
AGENT_CONTAINER_KEYS = frozenset({"image", "command", "env", "resources", "restart_policy",
                                  "labels", "args"})
MIB = 1024 * 1024


@dataclass(frozen=True)
class Document:
    """One request read from a file, and where it started."""

    request: control_pb2.ApplyWorkloadRequest
    source: str
    line: int
    shape: str

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


def read_documents(text: str, source: str, *, workload_id: str = "", workload_type: str = "",
                   desired_state: str = "") -> list[Document]:
    """Every document of ``text`` as an ApplyWorkloadRequest; ``InputError`` names the line."""
    docs = _load(text, source)
    if not docs:
        raise InputError(f"{source}: no document found")
    if workload_id and len(docs) > 1:
        raise InputError(f"{source}: --id names one workload, the file holds {len(docs)}")
    out = []
    for line, body in docs:
        where = f"{source}:{line}"
        if not isinstance(body, dict):
            raise InputError(f"{where}: expected a mapping, got {type(body).__name__}")
        request, shape = _request(body, where, workload_id, workload_type)
        if desired_state:
            request.desired_state = desired_state
        if not request.workload_id:
            raise InputError(f"{where}: no workload id: give workload_id in the file or --id")
        out.append(Document(request, source, line, shape))
    return out


def _load(text: str, source: str) -> list[tuple[int, Any]]:
    """(first line, data) of each document; JSON is YAML, so one parser reads both, and its
    errors carry the line."""
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        loader_docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InputError(f"{source}{line}: not valid YAML or JSON: {problem}") from exc
    return [(node.start_mark.line + 1, doc) for node, doc in zip(nodes, loader_docs, strict=True)
            if node is not None and doc is not None]


def _request(body: dict[str, Any], where: str, workload_id: str,
             workload_type: str) -> tuple[control_pb2.ApplyWorkloadRequest, str]:
    if NATIVE_KEYS & set(body):
        request = control_pb2.ApplyWorkloadRequest()
        # ``status`` is what ``persys workload ID -o yaml`` adds: the scheduler's report
        body = {key: value for key, value in body.items() if key != "status"}
        try:
            json_format.ParseDict(body, request)
        except json_format.ParseError as exc:
            raise InputError(f"{where}: {exc}") from exc
        if workload_id:
            request.workload_id = workload_id
        return request, "native"
    spec, shape = _persysctl_spec(body, where, workload_type)
    return control_pb2.ApplyWorkloadRequest(workload_id=workload_id, spec=spec), shape


def _persysctl_spec(body: dict[str, Any], where: str,
                    workload_type: str) -> tuple[control_pb2.WorkloadSpec, str]:
    keys = set(body)
    wtype = workload_type.lower()
    if wtype in ("vm", "microvm") or (not wtype and keys & VM_KEYS and "image" not in keys):
        return _vm(body, wtype or "vm"), "persysctl vm"
    if wtype == "compose" or (not wtype and keys & COMPOSE_KEYS):
        return _compose(body, where), "persysctl compose"
    if "image" not in keys:
        raise InputError(f"{where}: not a workload: expected workload_id/spec (native form), "
                         "image (container), inline_yaml (compose) or vcpus (vm)")
    agent = isinstance(body.get("resources"), dict) or isinstance(body.get("restart_policy"),
                                                                  dict) or "labels" in keys
    if agent:
        return _agent_container(body, where), "persysctl agent container"
    return _scheduler_container(body, where), "persysctl scheduler container"


def _parse(body: dict[str, Any], message: Any, where: str, what: str) -> None:
    try:
        json_format.ParseDict(body, message)
    except json_format.ParseError as exc:
        raise InputError(f"{where}: {what}: {exc}") from exc


def _scheduler_container(body: dict[str, Any], where: str) -> control_pb2.WorkloadSpec:
    unknown = set(body) - SCHEDULER_CONTAINER_KEYS
    if unknown:
        raise InputError(f"{where}: unknown container keys {sorted(unknown)}")
    spec = control_pb2.WorkloadSpec(type="container")
    _parse(body, spec.container, where, "container")
    return spec


def _agent_container(body: dict[str, Any], where: str) -> control_pb2.WorkloadSpec:
    unknown = set(body) - AGENT_CONTAINER_KEYS
    if unknown:
        raise InputError(f"{where}: unknown agent container keys {sorted(unknown)}")
    spec = control_pb2.WorkloadSpec(type="container")
    container = {k: body[k] for k in ("image", "command", "env") if k in body}
    if "args" in body:
        container["command"] = [*container.get("command", []), *body["args"]]
    restart = body.get("restart_policy")
    if isinstance(restart, dict):
        container["restart_policy"] = str(restart.get("policy", ""))
    elif restart is not None:
        container["restart_policy"] = str(restart)
    _parse(container, spec.container, where, "container")
    resources = body.get("resources") or {}
    if not isinstance(resources, dict):
        raise InputError(f"{where}: resources: expected a mapping")
    try:
        spec.resources.cpu_millicores = int(resources.get("cpu_shares", 0))
        spec.resources.memory_mb = int(resources.get("memory_bytes", 0)) // MIB
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: resources: {exc}") from exc
    for key, value in (body.get("labels") or {}).items():
        spec.metadata[str(key)] = str(value)
    return spec


def _compose(body: dict[str, Any], where: str) -> control_pb2.WorkloadSpec:
    spec = control_pb2.WorkloadSpec(type="compose")
    _parse(body, spec.compose, where, "compose")
    return spec


def _vm(body: dict[str, Any], wtype: str) -> control_pb2.WorkloadSpec:
    spec = control_pb2.WorkloadSpec(type=wtype)
    vm = dict(body)
    spec.resources.memory_mb = int(vm.get("memory_mb") or 0)
    spec.resources.cpu_millicores = int(vm.get("vcpus") or 0) * 1000
    spec.metadata["persys.vm_spec_b64"] = base64.b64encode(
        json.dumps(vm, sort_keys=True).encode()).decode()
    return spec
