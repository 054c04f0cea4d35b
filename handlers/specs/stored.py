"""What the scheduler reads off a stored workload spec: its desired state (normalised), whether
its delete is committed, its content revision and its resource request.

Pure, and apart from the input validation because the placement, the dispatcher, the reconcile
planner and loop read these off every stored spec, not only off a request being validated.
"""

from __future__ import annotations

import hashlib
import json

from eventsource.records import WorkloadSpec, WorkloadStatus


def normalize_desired_state(value: str) -> str:
    """stop/stopped -> Stopped; delete/deleted -> Deleted; anything else -> Running.

    As Go (docs/compatibility.md, "Workload states")."""
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
