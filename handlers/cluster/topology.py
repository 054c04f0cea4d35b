"""The shard topology, recorded in etcd, so that replicas which disagree on it never lead together.

Why: a node belongs to shard ``crc32(node id) % SCHEDULER_SHARD_COUNT`` and each shard elects
its leader under its own prefix. Replicas started with different shard counts (a rolling change
of the count, one replica's stale configuration) would each win a shard of their own topology:
the nodes both map get two leaders, applying and deleting on the same agents, while others get
none. So the first replica to campaign records ``{"haMode", "shardCount"}``; a replica that
disagrees fails at start (docs/compatibility.md, "Shard topology"), and
every campaign compares the record's revision, so a change made while a replica was away keeps
it from leading. The record changes only while no replica campaigns (no key under the leader's
election prefix): stop every replica, change the setting, start them again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from eventsource.etcd import AsyncEtcd, Compare, Put
from eventsource.keys import KeyLayout

log = logging.getLogger("persys.topology")

#: attempts to settle the record when other replicas write it at the same moment
SETTLE_ATTEMPTS = 5


class TopologyMismatch(Exception):
    """This replica's shard settings differ from the ones replicas are campaigning with."""


@dataclass(frozen=True, slots=True)
class Topology:
    ha_mode: str
    shard_count: int

    def encode(self) -> bytes:
        return json.dumps({"haMode": self.ha_mode, "shardCount": self.shard_count},
                          separators=(",", ":"), sort_keys=True).encode()

    def describe(self) -> str:
        return f"SCHEDULER_HA_MODE={self.ha_mode} SCHEDULER_SHARD_COUNT={self.shard_count}"


def describe_record(raw: bytes) -> str:
    """The recorded topology as settings, or the raw bytes if they are not a record."""
    try:
        body = json.loads(raw)
        return Topology(str(body["haMode"]), int(body["shardCount"])).describe()
    except (ValueError, TypeError, KeyError):
        return repr(raw[:80])


async def settle_topology(etcd: AsyncEtcd, layout: KeyLayout, wanted: Topology) -> Compare:
    """Make the record say ``wanted`` and answer the compare a campaign must carry.

    The record is created when absent, and rewritten when no replica campaigns.

    Raises:
        TopologyMismatch: the record differs and replicas campaign with it.
        StoreError: etcd did not answer.
    """
    key, value = layout.topology, wanted.encode()
    for _ in range(SETTLE_ATTEMPTS):
        kv = await etcd.get(key)
        if kv is not None and kv.value == value:
            return Compare.mod(key, kv.mod_revision)
        if kv is None:
            compares = [Compare.absent(key)]
        else:
            # nobody campaigns: no key, of any shard or of the failover election, exists
            compares = [Compare.mod(key, kv.mod_revision),
                        Compare(layout.leader_elections, "CREATE", 0, prefix=True)]
        result = await etcd.txn(compares, [Put(key, value, category="topology")])
        if result.succeeded:
            if kv is not None:
                log.warning("shard topology changed from %s to %s (no replica was campaigning)",
                            describe_record(kv.value), wanted.describe())
            continue  # read it back for its revision
        again = await etcd.get(key)
        if again is not None and again.value != value and (
                kv is not None and again.mod_revision == kv.mod_revision):
            raise TopologyMismatch(
                f"this replica runs {wanted.describe()}, but the replicas campaigning in this "
                f"cluster run {describe_record(again.value)} (recorded at {key}); replicas "
                "with different shard settings would lead the same nodes twice. To change the "
                "settings, stop every replica, then start them all with the new ones (a "
                "replica killed without stopping holds its key until its lease expires, "
                "SCHEDULER_LEADER_LEASE_TTL)")
    raise TopologyMismatch(f"the shard topology at {key} kept changing ({SETTLE_ATTEMPTS} "
                           "attempts): replicas with different settings are starting together")
