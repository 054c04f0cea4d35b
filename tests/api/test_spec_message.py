"""A stored spec printed as a request parses back to the same stored spec (round trip)."""

from __future__ import annotations

import base64
import json

import pytest
from google.protobuf import json_format

from handlers.api.spec_message import spec_message
from handlers.specs.validation import parse_apply
from proto.persys.control.v1 import control_pb2

REQUESTS = {
    "container": {
        "workload_id": "web", "desired_state": "Running",
        "spec": {"type": "container", "resources": {"cpu_millicores": 500, "memory_mb": 256,
                                                     "disk_gb": 2},
                 "metadata": {"persys.scheduling.allow_move": "true"},
                 "container": {"image": "nginx:1.27", "command": ["nginx", "-g", "daemon off;"],
                               "env": {"MODE": "prod"}, "restart_policy": "always",
                               "ports": [{"host_port": 8080, "container_port": 80},
                                         {"container_port": 53, "protocol": "udp"}],
                               "volumes": [{"host_path": "/srv", "container_path": "/data",
                                            "read_only": True}],
                               "managed_volumes": [{"name": "cache", "driver": "local",
                                                    "size_gb": 1, "mount_path": "/cache"}]}},
    },
    "compose": {
        "workload_id": "stack", "desired_state": "Stopped",
        "spec": {"type": "compose", "resources": {"cpu_millicores": 100, "memory_mb": 64},
                 "compose": {"source_type": "inline", "env": {"A": "1"},
                             "inline_yaml": "services:\n  web:\n    image: nginx\n"}},
    },
    "vm": {
        "workload_id": "vm1",
        "spec": {"type": "vm", "resources": {"cpu_millicores": 2000, "memory_mb": 2048},
                 "vm": {"vcpus": 2, "memory_mb": 2048, "os_image": "ubuntu-24.04",
                        "disks": [{"pool_name": "default", "size_gb": 20, "mount_point": "vda"}],
                        "networks": [{"bridge": "br0", "static_ip": "10.0.0.5"}],
                        "cloud_init": {"user_data": "#cloud-config\n"}}},
    },
    "vm-from-json": {
        "workload_id": "vm2",
        "spec": {"type": "vm", "metadata": {"persys.vm_spec_b64": base64.b64encode(json.dumps(
            {"name": "vm2", "vcpus": 1, "memory_mb": 512, "disks": [{"path": "/x.qcow2",
                                                                     "size_gb": 5}]}
        ).encode()).decode()}},
    },
}


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_a_stored_spec_prints_as_a_request_that_stores_it_again(name: str) -> None:
    request = json_format.ParseDict(REQUESTS[name], control_pb2.ApplyWorkloadRequest())
    first = parse_apply(request, created_at="t")
    assert first.spec is not None
    again = control_pb2.ApplyWorkloadRequest(
        workload_id=first.workload_id, desired_state=first.desired_state,
        spec=spec_message(first.spec, {**first.metadata, "last_action": "Created"}))
    second = parse_apply(again, created_at="t")
    assert second.spec == first.spec
    assert second.metadata == {k: v for k, v in first.metadata.items() if k.startswith("persys.")
                               and k != "persys.vm_spec_b64"} | (
        {"persys.vm_spec_b64": second.metadata["persys.vm_spec_b64"]}
        if "persys.vm_spec_b64" in second.metadata else {})


def test_bookkeeping_and_disk_volumes_are_not_part_of_the_spec() -> None:
    request = json_format.ParseDict(REQUESTS["container"], control_pb2.ApplyWorkloadRequest())
    parsed = parse_apply(request, created_at="t")
    assert parsed.spec is not None
    parsed.spec.managed_volumes.append({"name": "d1", "driver": "local", "disk_id": "disk-1"})
    msg = spec_message(parsed.spec, {"last_action": "Created", "vm.primary_ip": "10.0.0.1",
                                     "persys.disk.ids": "disk-1"})
    assert dict(msg.metadata) == {"persys.disk.ids": "disk-1"}
    assert [v.name for v in msg.container.managed_volumes] == ["cache"]
