"""``dev --grpc-port 0`` registers its SRV record with the port the system chose (it once
registered 8085, where nothing listened)."""

from __future__ import annotations

import json

from eventsource.etcd import AsyncEtcd
from ops.cli import _dev_settings, build_parser
from tests.fixtures.harness import running_scheduler
from tests.fixtures.waiting import wait_for


async def test_dev_with_port_0_advertises_the_real_port(etcd_server, key_root, stream_key,
                                                        monkeypatch) -> None:
    monkeypatch.delenv("SCHEDULER_ADVERTISE_PORT", raising=False)
    monkeypatch.delenv("GRPC_PORT", raising=False)
    settings = _dev_settings(build_parser().parse_args(["dev", "--grpc-port", "0"]))
    assert settings.grpc_port == 0
    settings = settings.with_overrides(etcd_endpoints=(etcd_server.endpoint,),
                                       etcd_root=key_root, redis_addr="", metrics_port=0,
                                       event_stream=stream_key)
    async with running_scheduler(settings) as sched:
        assert sched.grpc_port not in (0, 8085)
        etcd = AsyncEtcd([etcd_server.endpoint])
        try:
            srv_key = sched.layout.skydns(settings.domain, "_persys-scheduler",
                                          settings.instance_id)

            async def record() -> dict[str, object] | None:
                kv = await etcd.get(srv_key)
                return json.loads(kv.value) if kv is not None else None

            srv = await wait_for(record, message="the SRV record")
            assert srv["port"] == sched.grpc_port
        finally:
            etcd.close()


def test_an_explicit_advertise_port_is_kept(monkeypatch) -> None:
    monkeypatch.setenv("SCHEDULER_ADVERTISE_PORT", "9443")
    settings = _dev_settings(build_parser().parse_args(["dev", "--grpc-port", "0"]))
    assert settings.advertise_port == 9443
