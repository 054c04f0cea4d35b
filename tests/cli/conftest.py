"""One dev stack for the CLI tests of a module (starting one takes seconds)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from proto.persys.control.v1 import control_pb2 as pb
from tests.cli.stack import DevStack
from tests.fixtures.waiting import wait_for_sync


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    dev = DevStack(tmp_path_factory.mktemp("dev") / "data")
    dev.start()
    channel, stub = dev.stub()

    def ready() -> bool:
        nodes = stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes
        return len([n for n in nodes if n.status == "Ready"]) == dev.nodes

    try:
        wait_for_sync(ready, timeout=60, interval=0.2, message="the dev fleet Ready")
        yield dev
    finally:
        channel.close()
        dev.stop()
