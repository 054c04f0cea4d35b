"""Disks named by workloads (``persys.disk.ids``): the pure decisions of
handlers/storage/attachments.py."""

from __future__ import annotations

import json

import pytest

from eventsource.keys import KeyLayout
from handlers.specs.fields import InvalidSpec
from handlers.storage.attachments import (
    attached,
    detached,
    disk_ids_in_spec,
    disk_ids_of,
    moved,
    plan_attach,
    volume_of,
)


def disk(name: str, driver: str = "local", *, node: str = "", refs: tuple[str, ...] = (),
         access: str = "ReadWriteOnce") -> dict:
    return {"name": name, "driver": driver, "sizeGb": 5, "fsType": "xfs", "accessMode": access,
            "retainPolicy": "Retain", "phase": "Pending", "workloadRefs": list(refs),
            "attachedNodes": [], "nodeId": node, "mountPath": "/srv", "standalone": True}


@pytest.mark.parametrize(("metadata", "vm", "ids"), [
    ({"persys.disk.ids": "d1, d2;d3  d1"}, None, ["d1", "d2", "d3"]),
    ({"disk_ids": "d9"}, None, ["d9"]),
    ({}, {"metadata": {"persys.disk.ids": "v1"}}, ["v1"]),
    ({"persys.disk.ids": " "}, None, []),
    ({}, None, []),
])
def test_disk_ids_of(metadata, vm, ids):
    assert disk_ids_of(metadata, vm) == ids


def test_a_plan_checks_every_disk_and_pins_to_a_local_disks_node():
    found = {"a": (disk("a", node="n2"), 3), "b": (disk("b", "ceph-rbd"), 4),
             "c": (disk("c", "nfs", refs=("other",), access="ReadWriteMany"), 5)}
    plan = plan_attach("w", ["a", "b", "c"], found)
    assert plan.node_id == "n2"
    assert [v["name"] for v in plan.volumes()] == ["a", "b", "c"]
    assert disk_ids_in_spec(plan.volumes()) == ["a", "b", "c"]
    compares, puts = plan.writes(KeyLayout(""), "w", "n2", "t")
    assert [(c.key, c.value) for c in compares] == [("/volumes/a", 3), ("/volumes/b", 4),
                                                    ("/volumes/c", 5)]
    written = [json.loads(p.value) for p in puts]
    assert [r["workloadRefs"] for r in written] == [["w"], ["w"], ["other", "w"]]
    assert all(r["phase"] == "Attached" and r["attachedNodes"] == ["n2"] for r in written)


@pytest.mark.parametrize(("found", "message"), [
    ({}, "disk 'a' not found"),
    ({"a": (disk("a", refs=("w0",)), 1)}, "is used by workload 'w0'"),
    ({"a": (disk("a", node="n1"), 1), "b": (disk("b", node="n2"), 1)},
     "on different nodes"),
])
def test_a_plan_refuses_naming_the_field(found, message):
    with pytest.raises(InvalidSpec) as err:
        plan_attach("w", sorted(found) or ["a"], found)
    assert str(err.value).startswith("spec.metadata[persys.disk.ids]")
    assert message in str(err.value)


def test_the_same_workload_applying_again_is_not_another_user():
    plan = plan_attach("w", ["a"], {"a": (disk("a", refs=("w",)), 1)})
    assert plan.node_id == ""


def test_attach_pins_a_local_disk_and_detach_keeps_the_pin():
    record = attached(disk("a"), "w", "n3", "t1")
    assert (record["nodeId"], record["phase"], record["workloadRefs"]) == ("n3", "Attached", ["w"])
    rbd = attached(disk("r", "ceph-rbd"), "w", "n3", "t1")
    assert rbd["nodeId"] == ""
    released = detached(record, "w", "t2")
    assert (released["nodeId"], released["phase"], released["workloadRefs"],
            released["attachedNodes"]) == ("n3", "Provisioned", [], [])
    assert detached(rbd, "w", "t2")["phase"] == "Available"
    shared = attached(attached(disk("s", "nfs", access="ReadWriteMany"), "w1", "n1", "t"),
                      "w2", "n2", "t")
    assert detached(shared, "w1", "t")["workloadRefs"] == ["w2"]


def test_a_volume_carries_the_disk():
    volume = volume_of("d", disk("a", access="ReadOnlyMany"))
    assert volume == {"name": "a", "driver": "local", "size_gb": 5,
                      "access_mode": "ReadOnlyMany", "fs_type": "xfs", "mount_path": "/srv",
                      "read_only": True, "retain_policy": "Retain", "disk_id": "d"}


@pytest.mark.parametrize(("attached_to", "node_of", "expected"), [
    # the only user moves: the disk follows it
    (["n1"], {}, ["n2"]),
    # another user still runs on the old node: it stays attached there too
    (["n1"], {"other": "n1"}, ["n1", "n2"]),
    # another user elsewhere: its node stays, the old one goes
    (["n3", "n1"], {"other": "n3"}, ["n3", "n2"]),
    # already attached to the target (a ReadWriteMany disk shared with it)
    (["n1", "n2"], {"other": "n2"}, ["n2"]),
])
def test_a_moved_workload_takes_its_disk_along(attached_to, node_of, expected):
    record = disk("shared", "nfs", refs=("w", "other"), access="ReadWriteMany")
    record["attachedNodes"] = attached_to
    out = moved(record, "w", from_node="n1", to_node="n2", node_of=node_of, now="T")
    assert out["attachedNodes"] == expected
    assert out["workloadRefs"] == ["w", "other"]
    assert out["updatedAt"] == "T"
    assert record["attachedNodes"] == attached_to  # the input is not changed
