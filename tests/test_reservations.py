"""In-flight reservations (pure state): tables and a Hypothesis model check."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.placement.reservations import Reservations


def fresh(ttl: float = 10.0, already: set[tuple[str, str]] | None = None) -> Reservations:
    counted = already or set()
    return Reservations(ttl, confirmed=lambda node, wid: (node, wid) in counted)


def test_a_hold_counts_until_it_expires() -> None:
    r = fresh(ttl=10.0)
    r.reserve("w1", "a", 500, 256, now=0.0)
    r.reserve("w2", "a", 100, 64, now=5.0)
    assert r.by_node == {"a": (600, 320)}
    r.prune(now=9.9)
    assert r.by_node == {"a": (600, 320)}
    r.prune(now=10.0)
    assert r.by_node == {"a": (100, 64)}
    r.prune(now=15.0)
    assert dict(r.by_node) == {}


def test_a_hold_ends_when_its_nodes_allocation_counts_it() -> None:
    r = fresh()
    r.reserve("w1", "a", 500, 256, now=0.0)
    r.reserve("w2", "b", 100, 64, now=0.0)
    r.confirm_node("a", {"w9": [1, 1]})  # another workload: nothing changes
    assert r.by_node == {"a": (500, 256), "b": (100, 64)}
    r.confirm_node("a", {"w1": [500, 256], "w2": [100, 64]})  # w2 is held on b, not a
    assert r.by_node == {"b": (100, 64)}


def test_reserving_what_the_allocation_already_counts_holds_nothing() -> None:
    r = fresh(already={("a", "w1")})
    r.reserve("w1", "a", 500, 256, now=0.0)
    assert dict(r.by_node) == {}


def test_a_re_made_hold_keeps_its_new_expiry() -> None:
    r = fresh(ttl=10.0)
    r.reserve("w1", "a", 500, 256, now=0.0)
    r.reserve("w1", "b", 500, 256, now=8.0)  # re-decided onto b
    r.prune(now=12.0)  # the first hold's heap entry is stale: skipped
    assert r.by_node == {"b": (500, 256)}


ops = st.lists(st.one_of(
    st.tuples(st.just("reserve"), st.sampled_from("wxyz"), st.sampled_from("ab"),
              st.integers(0, 1000), st.integers(0, 1000)),
    st.tuples(st.just("release"), st.sampled_from("wxyz")),
    st.tuples(st.just("confirm"), st.sampled_from("ab"), st.sets(st.sampled_from("wxyz"))),
    st.tuples(st.just("tick"), st.floats(0.0, 5.0)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_sums_always_equal_the_live_holds(sequence: list[tuple]) -> None:
    """Model: a dict of live holds; expiry and confirmation remove exactly what they should."""
    ttl = 3.0
    r = fresh(ttl=ttl)
    model: dict[str, tuple[str, int, int, float]] = {}
    now = 0.0
    for op in sequence:
        if op[0] == "reserve":
            _, wid, node_id, cpu, mem = op
            r.reserve(wid, node_id, cpu, mem, now)
            model[wid] = (node_id, cpu, mem, now + ttl)
        elif op[0] == "release":
            r.release(op[1])
            model.pop(op[1], None)
        elif op[0] == "confirm":
            _, node_id, allocated = op
            r.confirm_node(node_id, allocated)
            model = {w: h for w, h in model.items() if not (h[0] == node_id and w in allocated)}
        else:
            now += op[1]
            r.prune(now)
            model = {w: h for w, h in model.items() if h[3] > now}
        sums: dict[str, tuple[int, int]] = {}
        for node_id, cpu, mem, _ in model.values():
            c, m = sums.get(node_id, (0, 0))
            sums[node_id] = (c + cpu, m + mem)
        # a node whose holds are all zero-sized may or may not be listed: it holds nothing
        assert {k: v for k, v in r.by_node.items() if v != (0, 0)} == {
            k: v for k, v in sums.items() if v != (0, 0)}
        assert set(r.holds()) == set(model)
