"""The liveness renewal policy (pure): fewer keepalives, the same promise."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from handlers.nodes.liveness import RenewalLog, lease_ttl, renewal_due

TTL, INTERVAL = 30, 10


def test_renewal_table():
    assert renewal_due(None, 7, 100.0, INTERVAL)  # never renewed here
    assert renewal_due((6, 99.0), 7, 100.0, INTERVAL)  # another lease now
    assert not renewal_due((7, 90.0), 7, 100.0, INTERVAL)  # one interval ago
    assert not renewal_due((7, 85.1), 7, 100.0, INTERVAL)
    assert renewal_due((7, 85.0), 7, 100.0, INTERVAL)  # 1.5 intervals ago
    assert lease_ttl(TTL, INTERVAL) == 45


@given(gaps=st.lists(st.floats(min_value=0.0, max_value=3 * INTERVAL), min_size=1,
                     max_size=60))
def test_a_lease_never_expires_sooner_than_the_ttl_after_a_heartbeat(gaps):
    """Whatever the heartbeat times, after each heartbeat the lease outlives it by the TTL;
    and when heartbeats come every interval, at most about half of them renew."""
    log = RenewalLog(INTERVAL)
    granted_ttl = lease_ttl(TTL, INTERVAL)
    now = 0.0
    log.renewed("n1", 1, now)  # registration grants at 0
    expires = now + granted_ttl
    for gap in gaps:
        now += gap
        if now >= expires:
            return  # expired: the node re-registers with a new lease, a new story
        if log.due("n1", 1, now):
            log.renewed("n1", 1, now)
            expires = now + granted_ttl
        assert expires >= now + TTL


def test_regular_heartbeats_renew_every_other_time():
    log = RenewalLog(INTERVAL)
    log.renewed("n1", 1, 0.0)
    renewals = 0
    for beat in range(1, 101):
        if log.due("n1", 1, beat * INTERVAL):
            log.renewed("n1", 1, beat * INTERVAL)
            renewals += 1
    assert renewals == 50
