"""Who may call what, from the caller's certificate: the pure decisions of
handlers/identity/authz.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from handlers.identity.authz import (
    AGENT_METHODS,
    Caller,
    NodeBinding,
    moves_node,
    refuse_call,
    refuse_heartbeat,
    refuse_registration,
)
from handlers.settings.config import load_settings
from handlers.settings.reader import ConfigError

AGENT = Caller.from_auth_context({
    "x509_common_name": [b"compute-agent"],
    "peer_ip": [b"10.0.0.5", b"::1"],
    "peer_dns": [b"Worker-5.Example.", b"*.pool.example"],
})
OPERATOR = Caller(common_name="persysctl")
NAMES = ("compute-agent",)


def test_the_auth_context_gives_one_spelling_per_name():
    assert AGENT.common_name == "compute-agent"
    assert Caller.of("compute-agent", ["10.0.0.5", "::1", "worker-5.example",
                                                "*.pool.example"]) == AGENT
    assert AGENT.describe() == "CN=compute-agent SAN=*.pool.example,10.0.0.5,::1,worker-5.example"
    assert Caller.from_auth_context({}) == Caller()


@pytest.mark.parametrize(("host", "named"), [
    ("10.0.0.5", True),
    ("[::1]", True),
    ("0:0:0:0:0:0:0:1", True),  # the same IPv6 address, spelled out
    ("WORKER-5.example", True),
    ("worker-5.example.", True),
    ("a.pool.example", True),  # wildcard: one leftmost label
    ("a.b.pool.example", False),
    ("pool.example", False),
    ("10.0.0.6", False),
    ("", False),
    ("::ffff:10.0.0.5", True),  # IPv4-mapped: the same address, as Go compares them
    ("fe80::1%eth0", False),
])
def test_names_host(host, named):
    assert AGENT.names_host(host) is named


@pytest.mark.parametrize(("names", "host", "named"), [
    (["10.9.9.9"], "10.9.9.9", True),
    (["*.0.0.5"], "10.0.0.5", False),  # a DNS wildcard never matches an IP host
    (["fe80::1"], "[fe80::1%eth0]", True),  # the zone id is not part of the address
])
def test_ip_hosts_match_ip_sans_only(names, host, named):
    assert Caller.of("compute-agent", names).names_host(host) is named


def test_a_dns_san_spelled_like_an_ip_does_not_name_that_ip():
    caller = Caller.from_auth_context({"x509_common_name": [b"compute-agent"],
                                       "peer_dns": [b"10.9.9.9"]})
    assert not caller.names_host("10.9.9.9")


@pytest.mark.parametrize(("method", "caller", "refused"), [
    ("RegisterNode", AGENT, False),
    ("Heartbeat", AGENT, False),
    ("ControlStream", AGENT, False),
    ("ApplyWorkload", AGENT, True),
    ("DrainNode", AGENT, True),
    ("GetBucketAccess", AGENT, True),
    ("ListNodes", AGENT, True),
    ("ApplyWorkload", OPERATOR, False),
    ("GetBucketAccess", OPERATOR, False),
    ("RegisterNode", OPERATOR, False),
    ("ListNodes", Caller.of("Compute-Agent"), True),  # names compare without case
    ("WatchEvents", Caller.of("", ["10.0.0.5"]), True),  # no common name: not an operator
    ("RegisterNode", Caller.of("", ["10.0.0.5"]), False),
])
def test_agents_call_only_agent_rpcs(method, caller, refused):
    reason = refuse_call(method, caller, NAMES)
    assert (reason is not None) is refused
    if refused:
        assert method in reason


def test_the_agent_and_operator_names_are_configurable():
    assert refuse_call("ApplyWorkload", AGENT, ("other-agent",)) is None
    assert refuse_call("ApplyWorkload", OPERATOR, ("persysctl",)) is not None
    gateway = Caller.of("persys-gateway")
    assert refuse_call("DrainNode", gateway, NAMES, ("persysctl", "persys-gateway")) is None
    reason = refuse_call("DrainNode", OPERATOR, NAMES, ("persys-gateway",))
    assert reason is not None
    assert "SCHEDULER_OPERATOR_CERT_NAMES" in reason
    assert refuse_call("Heartbeat", OPERATOR, NAMES, ("persys-gateway",)) is None


E = NodeBinding.ENDPOINT


@pytest.mark.parametrize(("host", "registered", "lost", "refused_field"), [
    ("10.0.0.5", None, False, None),                  # a new node at a host the cert names
    ("10.0.0.5", "10.0.0.5", False, None),            # re-registration, same host
    ("worker-5.example", "10.0.0.5", False, None),    # another name the cert also holds
    ("10.0.0.9", None, False, "grpc_endpoint"),       # a host the cert does not name
    ("10.0.0.5", "10.0.0.7", False, "grpc_endpoint"),  # taking a live node from another host
    ("10.0.0.5", "10.0.0.7", True, None),             # ... allowed once that node is lost
    ("10.0.0.5", "::1", False, None),                 # the cert names the old host as well
])
def test_endpoint_binding_on_registration(host, registered, lost, refused_field):
    reason = refuse_registration(AGENT, E, node_id="n1", host=host, registered_host=registered,
                                 lost=lost)
    if refused_field is None:
        assert reason is None
    else:
        assert reason is not None
        assert reason.startswith(refused_field)


@pytest.mark.parametrize(("registered", "refused"), [
    ("10.0.0.5", False), ("::1", False), ("a.pool.example", False),
    ("10.0.0.7", True), ("", True),
])
def test_endpoint_binding_on_heartbeat(registered, refused):
    reason = refuse_heartbeat(AGENT, E, node_id="n1", registered_host=registered)
    assert (reason is not None) is refused


@pytest.mark.parametrize(("node_id", "refused"), [
    ("worker-5.example", False),
    # node ids are case-sensitive etcd keys: variants are other nodes
    ("Worker-5.example", True), ("WORKER-5.EXAMPLE", True), ("worker-5.example.", True),
    ("compute-agent", True),  # the common name is every agent's: never a node name
    ("worker-6.example", True), ("10.0.0.5", True),  # an IP SAN is not a node name
])
def test_name_binding(node_id, refused):
    for reason in (
        refuse_registration(AGENT, NodeBinding.NAME, node_id=node_id, host="10.0.0.5",
                            registered_host="10.8.8.8", lost=False),
        refuse_heartbeat(AGENT, NodeBinding.NAME, node_id=node_id, registered_host="10.8.8.8"),
    ):
        assert (reason is not None) is refused
        if refused:
            assert reason.startswith("node_id")


def test_name_binding_also_binds_the_endpoint_host():
    # the certificate of worker-5 may not register worker-5 at another agent's host: drift
    # would then find that agent's workloads on worker-5 and hand them over
    reason = refuse_registration(AGENT, NodeBinding.NAME, node_id="worker-5.example",
                                 host="10.9.9.9", registered_host=None, lost=False)
    assert reason is not None
    assert reason.startswith("grpc_endpoint")
    # a host it names, even away from the registered one: the node is its own
    assert refuse_registration(AGENT, NodeBinding.NAME, node_id="worker-5.example",
                               host="a.pool.example", registered_host="10.0.0.5",
                               lost=False) is None


def test_name_binding_takes_only_agent_certificates():
    # a per-node certificate whose common name is not an agent name would be an operator's
    node_cert = Caller.of("worker-5.example", ["worker-5.example", "10.0.0.5"])
    for reason in (
        refuse_registration(node_cert, NodeBinding.NAME, node_id="worker-5.example",
                            host="10.0.0.5", registered_host=None, lost=False),
        refuse_heartbeat(node_cert, NodeBinding.NAME, node_id="worker-5.example",
                         registered_host="10.0.0.5"),
    ):
        assert reason is not None
        assert "SCHEDULER_AGENT_CERT_NAMES" in reason
    assert refuse_heartbeat(node_cert, NodeBinding.NAME, node_id="worker-5.example",
                            registered_host="10.0.0.5", agent_names=["worker-5.example"]) is None


def test_moving_a_node_is_named_so_the_commit_can_check_it_is_lost():
    assert moves_node(AGENT, E, host="10.0.0.5", registered_host="10.0.0.7")
    assert not moves_node(AGENT, E, host="10.0.0.5", registered_host="::ffff:10.0.0.5")
    assert not moves_node(AGENT, E, host="10.0.0.5", registered_host="::1")  # cert names both
    assert not moves_node(AGENT, E, host="10.0.0.5", registered_host=None)
    assert not moves_node(AGENT, NodeBinding.NAME, host="10.0.0.5", registered_host="10.0.0.7")


def test_binding_off_allows_everything():
    assert refuse_registration(Caller(), NodeBinding.OFF, node_id="n", host="h",
                               registered_host="x", lost=False) is None
    assert refuse_heartbeat(Caller(), NodeBinding.OFF, node_id="n", registered_host="x") is None


hosts = st.sampled_from(["10.0.0.1", "10.0.0.2", "a.example", "b.example", "::1"])


@given(cert=st.frozensets(hosts, max_size=3), host=hosts, registered=st.none() | hosts,
       lost=st.booleans())
def test_a_registration_never_moves_a_live_node_to_a_host_its_cert_does_not_hold(
        cert, host, registered, lost):
    caller = Caller.of("compute-agent", cert)
    allowed = refuse_registration(caller, E, node_id="n", host=host, registered_host=registered,
                                  lost=lost) is None
    # allowed => the cert names the host it registers, and, unless the node is new or lost,
    # the host it was alive at
    if allowed:
        assert host in cert
        if registered is not None and not lost:
            assert registered == host or registered in cert
    # and every such registration is allowed
    elif host in cert:
        assert registered is not None
        assert not lost
        assert registered not in cert


def test_agent_methods_are_the_compute_agents_subset():
    assert {"RegisterNode", "Heartbeat", "ControlStream"} == AGENT_METHODS


def test_settings_read_the_policy_and_name_a_bad_variable():
    defaults = load_settings({})
    assert defaults.agent_cert_names == ("compute-agent",)
    assert defaults.node_binding is NodeBinding.ENDPOINT
    settings = load_settings({"SCHEDULER_AGENT_CERT_NAMES": " agent-a, agent-b ,",
                              "SCHEDULER_NODE_BINDING": "Name"})
    assert settings.agent_cert_names == ("agent-a", "agent-b")
    assert settings.node_binding is NodeBinding.NAME
    with pytest.raises(ConfigError, match="SCHEDULER_NODE_BINDING"):
        load_settings({"SCHEDULER_NODE_BINDING": "strict"})
    with pytest.raises(ConfigError, match="SCHEDULER_AGENT_CERT_NAMES"):
        load_settings({"SCHEDULER_AGENT_CERT_NAMES": " , "})
    assert load_settings({"SCHEDULER_OPERATOR_CERT_NAMES": "persysctl,persys-gateway"}
                         ).operator_cert_names == ("persysctl", "persys-gateway")
