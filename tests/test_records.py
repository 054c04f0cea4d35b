"""Record helpers that stand in for generic machinery on the hot path."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eventsource.records import (
    Allocation,
    Node,
    ReasonInfo,
    StatusInfo,
    Taint,
    WorkloadStatus,
    copy_record,
    decode,
    encode,
)

# small, flat strategies: generation must stay cheap (Hypothesis's health check fails a test
# whose inputs are slow to draw, as a recursive "extra" was on a loaded CI machine)
_ids = st.sampled_from([f"w-{i}" for i in range(40)])
_holds = st.dictionaries(_ids, st.tuples(st.integers(0, 64_000), st.integers(0, 1 << 20)),
                         max_size=25)
_extra = st.dictionaries(st.sampled_from(["future", "note"]),
                         st.integers() | st.lists(st.integers(), max_size=3), max_size=2)


@given(holds=_holds, extra=_extra, new_id=_ids)
def test_allocation_clone_equals_deepcopy_and_shares_nothing(holds, extra, new_id) -> None:
    original = Allocation(node_id="node-1")
    for workload_id, (cpu, mem) in holds.items():
        original.add(workload_id, cpu, mem)
    original.extra = copy.deepcopy(extra)
    snapshot = encode(original)

    clone = original.clone()
    assert encode(clone) == encode(copy.deepcopy(original)) == snapshot

    clone.add(new_id, 7, 9)
    for held in clone.workloads.values():
        held[0] += 1
    for value in clone.extra.values():
        if isinstance(value, list):
            value.append("changed")
    assert encode(original) == snapshot, "changing the clone changed the original"
    assert decode(Allocation, snapshot) == original


_text = st.sampled_from(["", "a", "linux", "sim-node-1", "ü"])
_json_leaf = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | _text
_json_small = _json_leaf | st.lists(_json_leaf, max_size=3) | st.dictionaries(_text, _json_leaf,
                                                                              max_size=3)


@given(labels=st.dictionaries(_text, _text, max_size=4),
       taint_keys=st.lists(_text, max_size=3),
       types=st.lists(_text, max_size=3),
       extra=st.dictionaries(st.sampled_from(["future", "note"]), _json_small, max_size=2))
def test_copy_record_of_a_node_equals_deepcopy_and_shares_nothing(labels, taint_keys, types,
                                                                  extra) -> None:
    original = Node(node_id="n-1", labels=labels, supported_workload_types=types,
                    taints=[Taint(key=k, value="v", effect="NoSchedule") for k in taint_keys],
                    extra=copy.deepcopy(extra))
    snapshot = encode(original)

    copied = copy_record(original)
    assert type(copied) is Node
    assert copied == copy.deepcopy(original) == original
    assert encode(copied) == snapshot

    copied.labels["changed"] = "yes"
    copied.supported_workload_types.append("changed")
    copied.resources.cpu_usage += 1
    for taint in copied.taints:
        taint.value = "changed"
    for value in copied.extra.values():
        if isinstance(value, list):
            value.append("changed")
        elif isinstance(value, dict):
            value["changed"] = 1
    assert encode(original) == snapshot, "changing the copy changed the original"


@given(metadata=st.dictionaries(_text, _json_small, max_size=3),
       usage=st.none() | st.dictionaries(_text, _json_leaf, max_size=3),
       with_reason=st.booleans())
def test_copy_record_of_a_status_equals_deepcopy_and_shares_nothing(metadata, usage,
                                                                    with_reason) -> None:
    original = WorkloadStatus(id="w-1", metadata=copy.deepcopy(metadata), usage=usage,
                              status_info=StatusInfo(reason=ReasonInfo(code="c") if with_reason
                                                     else None))
    snapshot = encode(original)

    copied = copy_record(original)
    assert copied == copy.deepcopy(original) == original

    copied.metadata["changed"] = ["x"]
    for value in copied.metadata.values():
        if isinstance(value, list):
            value.append("changed")
    if copied.usage is not None:
        copied.usage["changed"] = 1
    copied.retry.attempts += 1
    copied.status_info.actual_state = "changed"
    if copied.status_info.reason is not None:
        copied.status_info.reason.code = "changed"
    assert encode(original) == snapshot, "changing the copy changed the original"


def test_null_containers_from_go_read_as_their_defaults() -> None:
    """Go's encoder writes a nil slice or map as null: that is an empty list or map here,
    never None in a field typed as a container (a projection listener once died on it)."""
    node = decode(Node, json.dumps({"nodeId": "n1", "supportedStorageDrivers": None,
                                    "labels": None, "taints": None}).encode())
    assert node is not None
    assert node.supported_storage_drivers == []
    assert node.labels == {}
    assert node.taints == []
    with pytest.raises(TypeError):
        decode(Node, json.dumps({"nodeId": "n1", "labels": ["not", "a", "map"]}).encode())
