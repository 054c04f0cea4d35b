"""Record helpers that stand in for generic machinery on the hot path."""

from __future__ import annotations

import copy

from hypothesis import given
from hypothesis import strategies as st

from eventsource.records import Allocation, decode, encode

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
