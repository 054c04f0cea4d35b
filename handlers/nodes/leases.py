"""A node's liveness lease: renewed on a heartbeat when due, granted (with its key) when the
node has none.

Liveness without a write per heartbeat: each node has an etcd lease attached to
``/persys/scheduler/alive/<node>``. A heartbeat, on whichever replica receives it, renews that
lease (a keepalive is not a Raft write; about every other heartbeat, see
``handlers.nodes.liveness``, and many heartbeats' renewals share one gateway call, see
``eventsource.keepalives``); when it expires etcd deletes the key and the leader's node monitor
sees the delete. Apart because registration and heartbeats both keep the lease alive, and the
renewal log is one per replica.
"""

from __future__ import annotations

from eventsource.clock import Clock
from eventsource.commit import Change
from eventsource.errors import LeaseLost
from eventsource.etcd import BULK, AsyncEtcd, Compare, Put
from eventsource.keepalives import KeepaliveBatcher
from eventsource.keys import KeyLayout
from handlers.nodes.liveness import RenewalLog, lease_ttl
from handlers.settings.config import Settings
from projections.cluster import ClusterProjection


class LivenessLeases:
    """Keeps each node's liveness key leased, renewing no more often than the policy asks."""

    def __init__(self, *, etcd: AsyncEtcd, keepalives: KeepaliveBatcher,
                 cluster: ClusterProjection, clock: Clock, layout: KeyLayout,
                 settings: Settings) -> None:
        self.etcd = etcd
        self.keepalives = keepalives
        self.cluster = cluster
        self.clock = clock
        self.layout = layout
        self.settings = settings
        self.renewals = RenewalLog(settings.heartbeat_interval_s)

    async def ensure_alive(self, node_id: str, change: Change) -> None:
        """Renew the node's liveness lease, or add a new lease + key to ``change``.

        The projection may not show a key another replica (or this one) just wrote, so a miss
        there is checked against etcd before a new lease is granted.
        """
        key = self.layout.alive(node_id)
        item = self.cluster.alive.get(node_id)
        lease, mod = (item.lease, item.mod_revision) if item is not None else (0, 0)
        if not lease:
            kv = await self.etcd.get(key)
            if kv is not None:
                lease, mod = kv.lease, kv.mod_revision
        if lease:
            now = self.clock.monotonic()
            if not self.renewals.due(node_id, lease, now):
                return
            try:
                await self.keepalives.renew(lease)
                self.renewals.renewed(node_id, lease, now)
                return
            except LeaseLost:
                self.renewals.forget(node_id)
        asked = self.clock.monotonic()
        lease = await self.etcd.lease_grant(
            lease_ttl(self.settings.node_lease_ttl_s, self.settings.heartbeat_interval_s),
            lane=BULK)
        self.renewals.renewed(node_id, lease, asked)
        change.compares.append(Compare.mod(key, mod))
        change.puts.append(Put(key, self.settings.instance_id.encode(), lease=lease,
                               category="other"))
