"""The simulated fleet's registration and heartbeats (ops/sim/control.py), against a fake
AgentControl (tests/fixtures/fakecontrol.py)."""

from __future__ import annotations

import asyncio

import pytest

from ops.sim.config import NodeBehaviour
from ops.sim.fleet import Fleet
from tests.fixtures.fakecontrol import FakeControl, FleetFactory
from tests.fixtures.waiting import wait_for

pytest_plugins = ["tests.fixtures.simfleet"]


async def test_a_fleet_part_takes_its_own_index_range(
    control: tuple[FakeControl, str], make_fleet: FleetFactory
) -> None:
    # the bench runs a large fleet as several processes; their ids must not collide
    fake, _ = control
    fleet = await make_fleet(count=2, first=4)
    ids = [n.node_id for n in fleet.nodes]
    assert ids == ["sim-node-00004", "sim-node-00005"]
    await wait_for(lambda: sorted(set(fake.registered_ids())) == ids, message="registrations")
    with pytest.raises(ValueError, match="first"):
        Fleet("127.0.0.1:1", count=2, first=0)


async def test_all_nodes_register_and_heartbeat_at_the_scheduler_interval(
    control: tuple[FakeControl, str], make_fleet: FleetFactory
) -> None:
    fake, _ = control
    fleet = await make_fleet(
        behaviour=NodeBehaviour(cpu_millicores=4000, memory_mb=2048, labels={"zone": "a"})
    )
    ids = [n.node_id for n in fleet.nodes]
    assert ids == ["sim-node-00001", "sim-node-00002", "sim-node-00003"]

    await wait_for(lambda: sorted(set(fake.registered_ids())) == ids, message="registrations")
    async with asyncio.timeout(5):
        await fleet.wait_registered()
    first = next(r for r in fake.registers if r.node_id == ids[0])
    assert first.capabilities.cpu_total_millicores == 4000
    assert first.capabilities.memory_total_mb == 2048
    assert list(first.capabilities.supported_workload_types) == ["container", "compose", "vm"]
    assert list(first.capabilities.supported_storage_drivers) == ["local"]
    assert first.labels["zone"] == "a"
    assert first.agent_version == "sim"
    assert first.grpc_endpoint == f"127.0.0.1:{fleet.node(ids[0]).port}"
    assert first.timestamp.seconds > 0

    # One heartbeat right after registering, then on the interval the scheduler answered (1 s).
    await wait_for(
        lambda: all(len(fake.heartbeats_of(i)) >= 2 for i in ids),
        timeout=5,
        message="two heartbeats per node",
    )
    assert all(n.control.interval_s == 1.0 for n in fleet.nodes)
    stats = fleet.stats()
    assert stats["nodes"] == 3
    assert stats["registered"] == 3
    assert stats["control"]["register_ok"] == 3


async def test_rejected_registration_backs_off_then_succeeds(
    control: tuple[FakeControl, str], make_fleet: FleetFactory
) -> None:
    fake, _ = control
    fake.accept = False
    fleet = await make_fleet(count=2, heartbeat_interval_s=0.05)
    # 1 s after the first rejection, 2 s after the second: backoff_s is then 4 s for both.
    await wait_for(
        lambda: all(n.control.backoff_s >= 4.0 for n in fleet.nodes),
        timeout=5,
        message="two rejected attempts each",
    )
    assert all(not n.control.registered for n in fleet.nodes)
    assert fleet.stats()["control"]["register_rejected"] >= 4
    fake.accept = True
    async with asyncio.timeout(5):
        await fleet.wait_registered()
    await wait_for(lambda: len(fake.heartbeats) >= 2, message="heartbeats after registration")


async def test_failed_heartbeat_makes_the_node_register_again(
    control: tuple[FakeControl, str], make_fleet: FleetFactory
) -> None:
    fake, _ = control
    fleet = await make_fleet(count=2, heartbeat_interval_s=0.05)
    node_id = fleet.nodes[0].node_id
    await wait_for(lambda: fake.heartbeats_of(node_id), message="first heartbeat")
    fake.known.discard(node_id)  # the scheduler forgot it: Heartbeat answers NOT_FOUND
    await wait_for(
        lambda: fake.registered_ids().count(node_id) >= 2, timeout=5, message="re-registration"
    )
    assert fleet.stats()["control"]["heartbeat_errors"] >= 1
