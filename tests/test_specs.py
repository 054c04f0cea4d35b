"""ApplyWorkload's spec conversion: a spec that could never be sent to an agent is refused with
the field named, before anything is committed (pure; the e2e answer is in test_api_e2e)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventsource.records import WorkloadSpec
from handlers.specs.agent_request import agent_apply_request
from handlers.specs.fields import InvalidSpec
from handlers.specs.validation import parse_apply
from proto.persys.control.v1 import control_pb2 as pb

VM_FIELD = "spec.metadata[persys.vm_spec_b64]"


def vm_request(vm: Any) -> pb.ApplyWorkloadRequest:
    encoded = base64.b64encode(json.dumps(vm).encode()).decode()
    return pb.ApplyWorkloadRequest(workload_id="vm-1", spec=pb.WorkloadSpec(
        type="vm", metadata={"persys.vm_spec_b64": encoded}))


@pytest.mark.parametrize("vm", [
    {"vcpus": "two", "memoryMb": 512},
    {"vcpus": 2, "memoryMb": None},
    {"vcpus": 10**12, "memoryMb": 512},
    {"vcpus": 2, "memoryMb": 512, "disks": [1]},
    {"vcpus": 2, "memoryMb": 512, "disks": "vda"},
    {"vcpus": 2, "memoryMb": 512, "networks": [["br0"]]},
    {"vcpus": 2, "memoryMb": 512, "managedVolumes": ["data"]},
    {"vcpus": 2, "memoryMb": 512, "disks": [{"sizeGb": "big"}]},
], ids=["vcpus-text", "memory-null", "vcpus-beyond-int32", "disk-number", "disks-text",
        "network-list", "volume-text", "disk-size-text"])
def test_a_vm_spec_of_the_wrong_shape_is_refused_naming_the_field(vm: dict[str, Any]) -> None:
    with pytest.raises(InvalidSpec) as caught:
        parse_apply(vm_request(vm), created_at="")
    assert str(caught.value).startswith(VM_FIELD)
    assert "cannot be sent to an agent" in str(caught.value)


def test_a_well_formed_vm_spec_is_accepted() -> None:
    parsed = parse_apply(vm_request({
        "vcpus": 2, "memoryMb": 2048, "osImage": "debian-12",
        "disks": [{"device": "vda", "sizeGb": 20}], "networks": [{"network": "default"}],
        "managedVolumes": [{"name": "data", "driver": "local", "size_gb": 5}]}), created_at="")
    assert parsed.spec is not None
    request = agent_apply_request(parsed.spec, parsed.metadata, parsed.desired_state)
    assert request.spec.vm.vcpus == 2
    assert request.spec.vm.managed_volumes[0].name == "data"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=3),
    max_leaves=12)
VM_KEYS = st.sampled_from(["vcpus", "memoryMb", "osImage", "disks", "networks",
                           "managedVolumes", "sizeGb", "device"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(VM_KEYS, JSON, max_size=6))
def test_any_vm_json_is_accepted_convertible_or_refused_in_band(vm: dict[str, Any]) -> None:
    # the property behind the table: never an exception other than InvalidSpec, and whatever
    # is accepted (and so committed) converts to an agent request every time it is sent
    try:
        parsed = parse_apply(vm_request(vm), created_at="")
    except InvalidSpec:
        return
    assert parsed.spec is not None
    agent_apply_request(parsed.spec, parsed.metadata, parsed.desired_state)


def _vm_agent_request(vm: dict[str, Any], wtype: str = "vm") -> Any:
    request = vm_request(vm)
    request.spec.type = wtype
    parsed = parse_apply(request, created_at="")
    assert parsed.spec is not None
    return agent_apply_request(parsed.spec, parsed.metadata, parsed.desired_state).spec.vm


def test_a_vm_reaches_the_agent_as_the_go_scheduler_sent_it() -> None:
    v = _vm_agent_request({
        "vcpus": 2, "memoryMb": 2048, "osImage": "debian-12", "diskGb": 30,
        "runtime": "libvirt", "cloudInit": "#cloud-config\n", "metadata": {"team": "a"},
        "cloudInitConfig": {"userData": "#cloud-config\nusers: []\n", "metaData": "m",
                            "networkConfig": "n", "vendorData": "v", "username": "ops",
                            "sshPublicKey": "ssh-ed25519 AAAA ops"},
        "disks": [{"device": "vdb", "format": "raw", "sizeGb": 0, "boot": True},
                  {"path": "/data/x.qcow2", "backingFile": "/base.qcow2", "storage": "pool"}],
        "networks": [{"hostDevName": "eth1", "macAddress": "52:54:00:00:00:01",
                      "model": "virtio"}, {"bridge": "br0", "ipAddress": "10.0.0.9"}],
    })
    assert (v.name, v.vcpus, v.memory_mb, v.os_image, v.disk_gb, v.runtime, v.cloud_init) == (
        "vm-1", 2, 2048, "debian-12", 30, "libvirt", "#cloud-config\n")
    ci = v.cloud_init_config
    assert (ci.user_data, ci.meta_data, ci.network_config, ci.vendor_data, ci.username,
            ci.ssh_public_key, ci.password) == (
        "#cloud-config\nusers: []\n", "m", "n", "v", "ops", "ssh-ed25519 AAAA ops", "")
    assert dict(v.metadata) == {
        "team": "a", "os_image": "debian-12", "persys.vm.os_image": "debian-12",
        "disk_gb": "30", "persys.vm.disk_gb": "30", "runtime": "libvirt",
        "persys.vm.runtime": "libvirt", "persys.vm.username": "ops",
        "persys.vm.ssh_public_key": "ssh-ed25519 AAAA ops", "persys.vm.host_dev.eth1": "eth1"}
    raw, given = v.disks
    assert (raw.path, raw.device, raw.format, raw.type, raw.size_gb, raw.boot) == (
        "/var/lib/libvirt/images/vm-1-vdb.img", "vdb", "raw", "disk", 20, True)
    assert (given.path, given.device, given.format, given.backing_file, given.storage) == (
        "/data/x.qcow2", "vda", "qcow2", "/base.qcow2", "pool")
    dev, bridged = v.networks
    assert (dev.network, dev.host_dev_name, dev.mac_address, dev.model) == (
        "eth1", "eth1", "52:54:00:00:00:01", "virtio")
    assert (bridged.network, bridged.bridge, bridged.ip_address) == ("br0", "br0", "10.0.0.9")


def test_a_microvm_runs_on_firecracker() -> None:
    v = _vm_agent_request({"vcpus": 1, "memoryMb": 256, "runtime": "libvirt"}, "microvm")
    assert v.runtime == "firecracker"
    assert v.metadata["persys.workload.type"] == "microvm"
    assert v.metadata["persys.vm.runtime"] == "firecracker"


def test_the_control_api_cloud_init_reaches_the_agent() -> None:
    request = pb.ApplyWorkloadRequest(workload_id="vm-2", spec=pb.WorkloadSpec(
        type="vm", vm=pb.VMSpec(vcpus=1, memory_mb=512, os_image="alpine",
                                cloud_init=pb.CloudInitConfig(user_data="#cloud-config\n"))))
    parsed = parse_apply(request, created_at="")
    assert parsed.spec is not None
    v = agent_apply_request(parsed.spec, parsed.metadata, parsed.desired_state).spec.vm
    assert v.cloud_init_config.user_data == "#cloud-config\n"
    assert v.os_image == "alpine"


@pytest.mark.parametrize(("request_", "field"), [
    (vm_request({"vcpus": 1, "memoryMb": 256, "cloudInitConfig": {"password": "hunter2"}}),
     "spec.metadata[persys.vm_spec_b64].cloudInitConfig.password"),
    (vm_request({"vcpus": 1, "memoryMb": 256, "metadata": {"persys.vm.password": "hunter2"}}),
     "spec.metadata[persys.vm_spec_b64].metadata[persys.vm.password]"),
    (pb.ApplyWorkloadRequest(workload_id="c-1", spec=pb.WorkloadSpec(
        type="container", container=pb.ContainerSpec(image="x"),
        metadata={"persys.vm.password": "hunter2"})), "spec.metadata[persys.vm.password]"),
    (vm_request({"vcpus": 1, "memoryMb": 256, "cloud_init_config": {"password": "hunter2"}}),
     "spec.metadata[persys.vm_spec_b64].cloudInitConfig.password"),
    (vm_request({"vcpus": 1, "memoryMb": 256, "CloudInitConfig": {"Password": "hunter2"}}),
     "spec.metadata[persys.vm_spec_b64].cloudInitConfig.password"),
    (vm_request({"vcpus": 1, "memoryMb": 256, "Metadata": {"Persys.VM.Password": "hunter2"}}),
     "spec.metadata[persys.vm_spec_b64].metadata[Persys.VM.Password]"),
], ids=["cloud-init", "vm-metadata", "request-metadata", "snake-case", "capitalised",
        "metadata-any-case"])
def test_a_vm_password_is_refused_naming_the_field(request_: Any, field: str) -> None:
    with pytest.raises(InvalidSpec) as caught:
        parse_apply(request_, created_at="")
    assert str(caught.value).startswith(field)
    assert "hunter2" not in str(caught.value)
    assert "etcd" in str(caught.value)


def test_the_gateways_snake_case_vm_spec_converts_like_the_camel_case_one() -> None:
    camel = {"vcpus": 2, "memoryMb": 1024, "osImage": "debian", "diskGb": 10,
             "cloudInitConfig": {"userData": "u", "sshPublicKey": "k"},
             "disks": [{"device": "vdb", "sizeGb": 5, "backingFile": "/b"}],
             "networks": [{"hostDevName": "eth0", "macAddress": "m"}],
             "managedVolumes": [{"name": "data", "size_gb": 3, "mount_path": "/d"}]}
    snake = {"vcpus": 2, "memory_mb": 1024, "os_image": "debian", "disk_gb": 10,
             "cloud_init_config": {"user_data": "u", "ssh_public_key": "k"},
             "disks": [{"device": "vdb", "size_gb": 5, "backing_file": "/b"}],
             "networks": [{"host_dev_name": "eth0", "mac_address": "m"}],
             "managed_volumes": [{"name": "data", "size_gb": 3, "mount_path": "/d"}],
             "unknown_key": "dropped"}
    assert _vm_agent_request(snake) == _vm_agent_request(camel)
    v = _vm_agent_request(snake)
    assert (v.memory_mb, v.disk_gb, v.cloud_init_config.ssh_public_key) == (1024, 10, "k")
    assert v.managed_volumes[0].mount_path == "/d"


def test_a_password_in_a_record_the_go_version_wrote_never_reaches_the_agent() -> None:
    record = WorkloadSpec(id="old-vm", type="vm", vm={
        "vcpus": 1, "memoryMb": 256, "metadata": {"persys.vm.password": "hunter2", "a": "b"},
        "cloudInitConfig": {"password": "hunter2", "username": "ops"}})
    v = agent_apply_request(record, {}, "Running").spec.vm
    assert "hunter2" not in str(v)
    assert v.metadata["a"] == "b"
    assert v.cloud_init_config.username == "ops"
