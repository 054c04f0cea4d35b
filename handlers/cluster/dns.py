"""Per-replica CoreDNS (SkyDNS) records for gateway -> scheduler discovery.

Each replica writes its own SRV and A children (docs/compatibility.md, "CoreDNS records"):
``/skydns/<reversed DOMAIN>/_persys-scheduler/<instance id>`` = ``{"host", "port", "ttl"}`` and
``/skydns/<reversed DOMAIN>/persys-scheduler/<instance id>`` = ``{"host", "ttl"}``, attached to a
lease of this replica. A clean shutdown deletes them (revoking the lease); a crashed replica's
records disappear by themselves when the lease expires, so CoreDNS never keeps answering with a
dead replica for longer than the lease TTL. Registration problems are logged, never fatal: DNS
is discovery, not scheduling.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

from eventsource.errors import LeaseLost, StoreError
from eventsource.etcd import AsyncEtcd, Put
from eventsource.keys import KeyLayout

log = logging.getLogger("persys.dns")


def advertise_ip(configured: str) -> str:
    """SCHEDULER_ADVERTISE_IP, else the address of the interface with the default route."""
    if configured:
        return configured
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        # no packet is sent: connecting a UDP socket only picks the outgoing interface
        probe.connect(("192.0.2.1", 9))
        address = str(probe.getsockname()[0])
    except OSError:
        address = "127.0.0.1"
    finally:
        probe.close()
    return address


class DnsRegistration:
    """Keeps this replica's SRV and A records alive under a lease."""

    def __init__(self, etcd: AsyncEtcd, layout: KeyLayout, *, domain: str, instance_id: str,
                 host: str, port: int, ttl_s: int = 15) -> None:
        self.etcd = etcd
        self.layout = layout
        self.instance_id = instance_id
        self.host = host
        self.port = port
        self.ttl_s = ttl_s
        self.srv_key = layout.skydns(domain, "_persys-scheduler", instance_id)
        self.a_key = layout.skydns(domain, "persys-scheduler", instance_id)
        self.lease = 0

    async def _put_records(self, lease: int) -> None:
        srv = json.dumps({"host": self.host, "port": self.port, "ttl": 300}).encode()
        a = json.dumps({"host": self.host, "ttl": 300}).encode()
        # the keys are this replica's (named by its instance id): a plain put on our lease
        await self.etcd.txn([], [Put(self.srv_key, srv, lease=lease, category="dns"),
                                 Put(self.a_key, a, lease=lease, category="dns")])

    async def _register(self) -> None:
        """A new lease and the records on it; the lease is kept only once they are written,
        so a failed write is retried from the start instead of renewing an empty lease."""
        lease = await self.etcd.lease_grant(self.ttl_s)
        try:
            await self._put_records(lease)
        except BaseException:  # re-raised: only the new lease is cleaned up here
            with contextlib.suppress(StoreError, TimeoutError):
                await asyncio.wait_for(self.etcd.lease_revoke(lease), 2.0)
            raise
        self.lease = lease
        log.info("dns records registered srv=%s a=%s host=%s port=%d", self.srv_key,
                 self.a_key, self.host, self.port)

    async def _still_ours(self) -> None:
        """Put the records back when they are missing or on another lease (deleted by hand,
        or a second replica with the same SCHEDULER_INSTANCE_ID took them, then stopped)."""
        for key in (self.srv_key, self.a_key):
            kv = await self.etcd.get(key)
            if kv is None or kv.lease != self.lease:
                log.warning("dns record %s missing or not on this replica's lease; "
                            "writing it again", key)
                await self._put_records(self.lease)
                return

    async def run(self) -> None:
        """Register, then renew every TTL/3 and check the records; re-register if the lease
        is lost."""
        while True:
            try:
                if not self.lease:
                    await self._register()
                await asyncio.sleep(self.ttl_s / 3)
                await self.etcd.lease_keepalive(self.lease)
                await self._still_ours()
            except LeaseLost:
                log.warning("dns lease lost; registering again")
                self.lease = 0
            except StoreError as exc:
                log.warning("dns registration: %s", exc)
                await asyncio.sleep(1.0)

    async def deregister(self) -> None:
        """Delete the records now (clean shutdown), by revoking their lease."""
        if self.lease:
            try:
                await asyncio.wait_for(self.etcd.lease_revoke(self.lease), 2.0)
            except (StoreError, TimeoutError) as exc:
                log.warning("dns deregistration: %s (records expire with their lease)", exc)
            self.lease = 0
