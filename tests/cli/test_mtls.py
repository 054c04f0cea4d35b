"""``persys`` over mTLS (``--ca``/``--cert``/``--key`` and their environment variables)
against a scheduler serving with client-certificate authentication."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.cli.stack import persys_async
from tests.fixtures.certs import Issued, TestCA
from tests.fixtures.harness import make_settings, running_scheduler

pytestmark = pytest.mark.timeout(120)


def flags(ca: TestCA, client: Issued) -> list[str]:
    return ["--ca", str(ca.cert_path), "--cert", str(client.cert_path),
            "--key", str(client.key_path)]


@pytest.fixture
async def tls_server(tmp_path: Path, etcd_server, redis_server, key_root, stream_key  # type: ignore[no-untyped-def]
                     ) -> AsyncIterator[tuple[str, TestCA]]:
    ca = TestCA(tmp_path / "ca")
    served = ca.issue("persys-scheduler", names=("127.0.0.1", "localhost"))
    settings = make_settings(etcd_server, redis_server, key_root, stream_key, insecure=False,
                             tls_ca=str(ca.cert_path), tls_cert=str(served.cert_path),
                             tls_key=str(served.key_path), agent_tls_enabled=True)
    async with running_scheduler(settings) as sched:
        yield f"127.0.0.1:{sched.grpc_port}", ca


async def test_an_operator_certificate_is_served(tls_server) -> None:  # type: ignore[no-untyped-def]
    server, ca = tls_server
    operator = ca.issue("persysctl")
    code, out, err = await persys_async("--server", server, *flags(ca, operator), "summary")
    assert code == 0, err
    assert "Nodes" in out
    env = {"PERSYS_SERVER": server, "PERSYS_TLS_CA": str(ca.cert_path),
           "PERSYS_TLS_CERT": str(operator.cert_path), "PERSYS_TLS_KEY": str(operator.key_path)}
    code, _, err = await persys_async("nodes", env=env)
    assert code == 0, err


async def test_refusals_and_failed_handshakes_have_their_exit_status(tls_server) -> None:  # type: ignore[no-untyped-def]
    server, ca = tls_server
    agent = ca.issue("compute-agent", names=("127.0.0.1",))
    code, _, err = await persys_async("--server", server, *flags(ca, agent), "summary")
    assert code == 1
    assert "PERMISSION_DENIED" in err
    stranger = TestCA(ca.cert_path.parent.parent / "stranger", name="stranger-ca")
    outsider = stranger.issue("persysctl")
    code, _, err = await persys_async("--server", server, *flags(stranger, outsider), "summary")
    assert code == 3
    assert f"cannot reach the scheduler at {server}" in err
    code, _, err = await persys_async("--server", server, "--insecure", "summary")
    assert code == 3
    assert "Traceback" not in err
    code, _, err = await persys_async("--server", server, "--ca", "/nonexistent/ca.pem", "summary")
    assert code == 2
    assert "/nonexistent/ca.pem" in err
