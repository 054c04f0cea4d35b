"""ApplyWorkload's spec conversion: a spec that could never be sent to an agent is refused with
the field named, before anything is committed (pure; the e2e answer is in test_api_e2e)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.specs import InvalidSpec, agent_apply_request, parse_apply
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
