"""The rules of the scheduler's Vault PKI certificate (handlers/cluster/certificates.py) that
need no Vault: when a certificate is rotated, which agent failure counts as a refused
certificate, and how the settings are read (test_certmanager.py runs the manager against a
real OpenBao).
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from handlers.agents.pool import is_handshake_failure
from handlers.cluster.certificates import load_cert_config, rotate_at
from handlers.settings.reader import ConfigError

# -- pure parts ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("lifetime", "after"), [
    (24 * 3600.0, 0.8 * 24 * 3600.0),  # 80 % of the lifetime
    (100.0, 80.0),
    (36.0, 30.0),                      # the 30 s floor
    (20.0, 18.0),                      # a lifetime under the floor: still before expiry
    (0.0, 0.0),
])
def test_rotation_time_by_lifetime(lifetime: float, after: float) -> None:
    assert rotate_at(1000.0, 1000.0 + lifetime) == pytest.approx(1000.0 + after)


@given(issued=st.floats(0, 2e9), lifetime=st.floats(0, 1e7))
def test_rotation_is_within_the_lifetime_and_not_before_the_floor(issued: float,
                                                                  lifetime: float) -> None:
    due = rotate_at(issued, issued + lifetime)
    assert issued <= due <= issued + lifetime + 1e-6
    assert due >= issued + min(30.0, 0.9 * lifetime) - 1e-6


@pytest.mark.parametrize(("code", "details", "expected"), [
    # we refused the agent's certificate
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
     "ipv4:127.0.0.1:1: Ssl handshake failed: SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED", True),
    # the agent refused ours (TLS 1.3)
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: "
     "UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed", True),
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: "
     "UNAVAILABLE: ipv4:127.0.0.1:1: Connection refused", False),
    # an answer of the agent itself: the call reached it, so it must never be sent again
    (grpc.StatusCode.UNAVAILABLE, "pull failed: x509: certificate signed by unknown authority",
     False),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", False),
    (grpc.StatusCode.INTERNAL, "certificate of the workload image is invalid", False),
])
def test_only_a_handshake_failure_counts_as_a_refused_certificate(
        code: grpc.StatusCode, details: str, expected: bool) -> None:
    assert is_handshake_failure(code, details) is expected


def test_config_takes_the_go_names_and_defaults_and_names_a_bad_variable() -> None:
    paths = {"cert_path": "/c", "key_path": "/k", "ca_path": "/a"}
    config = load_cert_config({"PERSYS_VAULT_TOKEN": "s.secret-token"}, advertise_ip="10.0.0.5",
                              **paths)
    assert (config.vault.addr, config.mount, config.role, config.service_name) == (
        "http://localhost:8200", "pki", "persys-scheduler", "persys-scheduler")
    assert (config.ttl_s, config.retry_interval_s) == (24 * 3600.0, 60.0)
    assert config.ip_sans == ("10.0.0.5", "127.0.0.1")
    assert config.alt_names == ("persys-scheduler",)
    assert "secret-token" not in repr(config)
    domain = load_cert_config({"PERSYS_VAULT_TOKEN": "t", "PERSYS_VAULT_SERVICE_DOMAIN":
                               "persys.local", "PERSYS_VAULT_CERT_TTL": "1h30m"}, **paths)
    assert domain.alt_names == ("persys-scheduler", "persys-scheduler.persys.local")
    assert domain.ttl_s == 5400.0
    approle = load_cert_config({"PERSYS_VAULT_AUTH_METHOD": "approle",
                                "PERSYS_VAULT_APPROLE_ROLE_ID": "r",
                                "PERSYS_VAULT_APPROLE_SECRET_ID": "s"}, **paths)
    assert approle.vault.uses_approle
    for env, name in [
        ({}, "PERSYS_VAULT_TOKEN"),
        ({"PERSYS_VAULT_AUTH_METHOD": "approle", "PERSYS_VAULT_APPROLE_ROLE_ID": "r"},
         "PERSYS_VAULT_APPROLE_SECRET_ID"),
        ({"PERSYS_VAULT_AUTH_METHOD": "kerberos"}, "PERSYS_VAULT_AUTH_METHOD"),
        ({"PERSYS_VAULT_TOKEN": "t", "PERSYS_VAULT_CERT_TTL": "soon"}, "PERSYS_VAULT_CERT_TTL"),
        ({"PERSYS_VAULT_TOKEN": "t", "PERSYS_VAULT_CERT_TTL": "30s"}, "PERSYS_VAULT_CERT_TTL"),
        ({"PERSYS_VAULT_TOKEN": "t", "PERSYS_VAULT_RETRY_INTERVAL": "1ms"},
         "PERSYS_VAULT_RETRY_INTERVAL"),
        ({"PERSYS_VAULT_TOKEN": "t", "PERSYS_VAULT_ADDR": "vault:8200"}, "PERSYS_VAULT_ADDR"),
    ]:
        with pytest.raises(ConfigError, match=name):
            load_cert_config(env, **paths)



def test_persys_external_ip_is_an_ip_san_once_and_a_bad_one_names_the_variable() -> None:
    paths = {"cert_path": "/c", "key_path": "/k", "ca_path": "/a"}
    env = {"PERSYS_VAULT_TOKEN": "t", "PERSYS_EXTERNAL_IP": " 203.0.113.7 "}
    assert load_cert_config(env, advertise_ip="10.0.0.5", **paths).ip_sans == (
        "10.0.0.5", "203.0.113.7", "127.0.0.1")
    assert load_cert_config(env, **paths).ip_sans == ("203.0.113.7", "127.0.0.1")
    same = {**env, "PERSYS_EXTERNAL_IP": "10.0.0.5"}
    assert load_cert_config(same, advertise_ip="10.0.0.5", **paths).ip_sans == (
        "10.0.0.5", "127.0.0.1")
    v6 = {**env, "PERSYS_EXTERNAL_IP": "2001:DB8:0::7"}
    assert load_cert_config(v6, **paths).ip_sans == ("2001:db8::7", "127.0.0.1")
    for bad in ("scheduler.example.com", "203.0.113.300", "203.0.113.7:8085"):
        with pytest.raises(ConfigError, match="PERSYS_EXTERNAL_IP"):
            load_cert_config({**env, "PERSYS_EXTERNAL_IP": bad}, **paths)
