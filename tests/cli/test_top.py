"""``persys top`` in a real terminal (tmux): the screen shows the nodes and the event feed."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from tests.cli.stack import PERSYS, DevStack, persys
from tests.fixtures.waiting import wait_for_sync

pytestmark = pytest.mark.timeout(120)


def _screen(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                          text=True, check=False).stdout


def test_top_shows_nodes_and_events_in_a_terminal(stack: DevStack) -> None:
    nodes = [line.split()[0] for line in persys("nodes", server=stack.server).stdout
             .splitlines()[1:]]
    session = f"persys-top-{uuid.uuid4().hex[:8]}"
    env = f"PERSYS_SERVER={stack.server} PERSYS_CONFIG={os.devnull}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "180", "-y", "50",
                    f"env {env} {PERSYS} top --interval 0.5"], check=True)
    # a tmux server already running keeps its own default size: set this window's
    subprocess.run(["tmux", "set-option", "-t", session, "window-size", "manual"], check=False)
    subprocess.run(["tmux", "resize-window", "-t", session, "-x", "180", "-y", "50"], check=False)
    try:
        wait_for_sync(lambda: "persys top" in _screen(session), timeout=30)
        persys("label", nodes[0], "top-test=yes", server=stack.server)
        screen = wait_for_sync(
            lambda: (s := _screen(session)) and "NodeLabelSet" in s and s, timeout=30,
            interval=0.2, message=f"the label event on the screen: {_screen(session)}")
        for node_id in nodes:
            assert node_id in screen
        assert "NodeJoined" in screen or "NodeLabelSet" in screen
        assert "workloads" in screen
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        wait_for_sync(lambda: subprocess.run(["tmux", "has-session", "-t", session],
                                             capture_output=True).returncode != 0, timeout=10)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True,
                       check=False)
