"""``persys events --follow`` across a scheduler restart, and past retention (EventsGap)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import redis

from proto.persys.control.v1 import control_pb2 as pb
from tests.cli.stack import PERSYS, DevStack, persys
from tests.fixtures.waiting import wait_for_sync

pytestmark = pytest.mark.timeout(300)


def _follow(server: str, out: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(  # the follower runs while the test drives the scheduler
        [str(PERSYS), "events", "--follow", "-o", "json", *args],
        stdout=out.open("wb"), stderr=subprocess.PIPE,
        env={**os.environ, "PERSYS_SERVER": server, "PERSYS_CONFIG": os.devnull})


def _lines(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _label(stack: DevStack, node_id: str, key: str) -> None:
    done = persys("label", node_id, f"{key}=1", server=stack.server)
    assert done.returncode == 0, done.stderr


def _all_events(stack: DevStack) -> list[pb.SchedulerEventView]:
    channel, stub = stack.stub()
    with channel:
        return list(stub.ListEvents(pb.ListEventsRequest(after_id="0-0", limit=10_000),
                                    timeout=10).events)


def test_follow_receives_every_event_once_across_a_scheduler_restart(tmp_path: Path) -> None:
    stack = DevStack(tmp_path / "data", nodes=2)
    stack.start()
    follower = None
    try:
        wait_for_sync(lambda: persys("nodes", server=stack.server).stdout.count("Ready") == 2,
                      timeout=60, interval=0.2)
        node_id = json.loads(persys("nodes", "-o", "json", server=stack.server).stdout
                             )["nodes"][0]["node_id"]
        out = tmp_path / "follow.jsonl"
        follower = _follow(stack.server, out, "--type", "NodeLabelSet")
        for i in range(5):
            _label(stack, node_id, f"before{i}")
        wait_for_sync(lambda: len(_lines(out)) >= 5, timeout=30)
        stack.stop()
        stack.start()  # same ports and data (dev --data-dir)
        wait_for_sync(lambda: persys("summary", server=stack.server).returncode == 0,
                      timeout=60, interval=0.2)
        for i in range(5):
            _label(stack, node_id, f"after{i}")
        expected = [e.id for e in _all_events(stack) if e.type == "NodeLabelSet"]
        assert len(expected) == 10
        wait_for_sync(lambda: len(_lines(out)) >= 10, timeout=60,
                      message="the follower resumed after the restart")
        follower.send_signal(signal.SIGINT)
        follower.wait(timeout=10)
        got = [line["id"] for line in _lines(out)]
        assert got == expected  # each once, in order
        assert follower.stderr is not None
        assert b"resuming after" in follower.stderr.read()
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
        stack.stop()


def test_a_cursor_behind_retention_prints_an_events_gap(tmp_path: Path) -> None:
    stack = DevStack(tmp_path / "data", nodes=1)
    stack.start()
    try:
        wait_for_sync(lambda: "Ready" in persys("nodes", server=stack.server).stdout,
                      timeout=60, interval=0.2)
        node_id = json.loads(persys("nodes", "-o", "json", server=stack.server).stdout
                             )["nodes"][0]["node_id"]
        for i in range(6):
            _label(stack, node_id, f"k{i}")
        events = _all_events(stack)
        cursor = events[1].id
        host, port = stack.addresses["redis"].rsplit(":", 1)
        client = redis.Redis(host=host, port=int(port))
        client.xtrim("scheduler:events", maxlen=2, approximate=False)  # retention passed it
        client.close()
        done = persys("events", "--after", cursor, server=stack.server)
        assert done.returncode == 0, done.stderr
        first = done.stdout.splitlines()[1]
        assert "EventsGap" in first
        lines = persys("events", "--follow", "--after", cursor, "--max-events", "2",
                       server=stack.server, timeout=30)
        assert lines.returncode == 0, lines.stderr
        assert lines.stdout.splitlines()[0].startswith(f"!! EventsGap: events lost after {cursor}")
        assert len(lines.stdout.splitlines()) == 3  # the gap, then the two retained events
    finally:
        stack.stop()
