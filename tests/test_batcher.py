"""Which placement intents share a transaction (pure: ``PlacementBatcher._take``)."""

from __future__ import annotations

from collections import deque
from typing import Any

from eventsource.etcd import Compare, Put
from eventsource.group import MAX_GROUP_BYTES
from handlers.placement.batcher import Intent, PlacementBatcher


def intent(i: int, *, node: str, value_bytes: int) -> Intent:
    return Intent(workload_id=f"w{i}", node_id=node, cpu_m=1, mem_mb=1, compares=[],
                  puts=[Put(f"/workloads-spec/w{i}", b"x" * value_bytes, category="spec")],
                  events=[])


def batcher() -> PlacementBatcher:
    none: Any = None  # _take reads no store
    return PlacementBatcher(none, none, none, max_intents=24)


async def test_small_intents_share_one_batch() -> None:
    queue = deque(intent(i, node=f"n{i}", value_bytes=1_000) for i in range(10))
    assert [i.workload_id for i in batcher()._take(queue)] == [f"w{i}" for i in range(10)]
    assert not queue


async def test_large_intents_are_split_to_fit_one_request() -> None:
    big = MAX_GROUP_BYTES // 3
    queue = deque(intent(i, node=f"n{i}", value_bytes=big) for i in range(5))
    b = batcher()
    first = b._take(queue)
    assert 1 <= len(first) < 5
    assert sum(i.size() for i in first) <= MAX_GROUP_BYTES
    # one intent larger than the bound still goes, alone
    alone = deque([intent(9, node="n9", value_bytes=2 * MAX_GROUP_BYTES),
                   intent(10, node="n10", value_bytes=10)])
    assert [i.workload_id for i in b._take(alone)] == ["w9"]
    assert [i.workload_id for i in alone] == ["w10"]


async def test_intents_comparing_one_key_never_share_a_batch() -> None:
    """Two workloads wanting one disk: in one transaction both compares would pass."""
    disk = Compare.mod("/volumes/disk-1", 7)
    queue = deque(intent(i, node=f"n{i}", value_bytes=10) for i in range(3))
    queue[0].compares.append(disk)
    queue[2].compares.append(disk)
    b = batcher()
    assert [i.workload_id for i in b._take(queue)] == ["w0", "w1"]
    # nor a batch in flight: w2 waits until w0's batch is done
    assert b._take(queue) == []
    b._busy_keys -= queue[0].keys()  # what _flush does when w0's batch ends
    assert [i.workload_id for i in b._take(queue)] == ["w2"]


async def test_an_intent_costs_its_own_writes() -> None:
    many = Intent(workload_id="w", node_id="n", cpu_m=1, mem_mb=1, compares=[],
                  puts=[Put(f"/k{i}", b"v") for i in range(5)], events=[object()] * 2)  # type: ignore[list-item]
    assert many.ops() == 7


async def test_an_intent_that_must_go_alone_goes_alone() -> None:
    queue = deque(intent(i, node=f"n{i}", value_bytes=10) for i in range(4))
    queue[1].alone = True
    b = batcher()
    assert [i.workload_id for i in b._take(queue)] == ["w0", "w2", "w3"]
    b._busy.clear()
    assert [i.workload_id for i in b._take(queue)] == ["w1"]
    queue.extend([intent(7, node="n7", value_bytes=10)])
    queue.appendleft(intent(8, node="n8", value_bytes=10, ))
    queue[0].alone = True
    b._busy.clear()
    assert [i.workload_id for i in b._take(queue)] == ["w8"]  # nothing joins it either
