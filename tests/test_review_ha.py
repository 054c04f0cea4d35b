"""Adversarial HA review: leadership hand-over, re-campaign, shard ownership and the
reservations of leader-loop placements, on real etcd and Redis."""

from __future__ import annotations

import copy

from eventsource.commit import Change
from eventsource.errors import Unavailable
from eventsource.etcd import Compare, Put
from eventsource.records import encode
from tests.fixtures.harness import make_settings
from tests.test_reconcile import QUIET, stack


async def test_a_reconcile_placement_whose_commit_fails_leaves_no_reservation(
        etcd_server, redis_server, key_root, stream_key, monkeypatch) -> None:
    """The reconcile loop's placement reserves capacity, then commits. A commit that fails
    with anything but a Conflict (etcd unavailable or timing out, the cycle cancelled by a lost
    leadership) must release the hold, as ApplyWorkload's and the relocator's placements do;
    otherwise the node looks fuller to every later placement of this replica for the whole
    reservation TTL (90 s by default)."""
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, **QUIET)
    async with stack(settings, 2) as s:
        sched = s.sched
        await s.apply(["orphan"])
        await s.running(["orphan"])
        node_id = s.status("orphan").node_id
        status_item = sched.cluster.statuses.get("orphan")
        alloc_item = sched.cluster.allocations.get(node_id)
        assert status_item is not None
        assert alloc_item is not None
        st = copy.deepcopy(status_item.value)
        st.node_id = st.assigned_node = ""
        st.status = "Pending"
        alloc = copy.deepcopy(alloc_item.value)
        alloc.remove("orphan")
        await sched.committer.commit(Change(kind="test", compares=[
            Compare.mod(sched.layout.status("orphan"), status_item.mod_revision),
            Compare.mod(sched.layout.allocation(node_id), alloc_item.mod_revision)],
            puts=[Put(sched.layout.status("orphan"), encode(st), category="status"),
                  Put(sched.layout.allocation(node_id), encode(alloc), category="allocation")]))
        await s.caught_up()

        real_commit = sched.committer.commit

        async def failing_commit(change, **kwargs):  # type: ignore[no-untyped-def]
            if change.kind == "reconcile":
                raise Unavailable("etcd request timed out (injected)")
            return await real_commit(change, **kwargs)

        monkeypatch.setattr(sched.committer, "commit", failing_commit)
        report = await s.loops.reconcile.run_once()
        assert report.actions == {"Assign": 1}
        assert report.failed["Assign"] == 1
        assert sched.placer.reservations.holds() == {}
        assert dict(sched.placer.reservations.by_node) == {}
