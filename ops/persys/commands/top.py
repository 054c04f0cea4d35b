"""``persys top``: a live view of the cluster in the terminal.

Fed by one WatchEvents stream (the event feed, in a thread of its own, resuming by cursor
as ``persys events --follow`` does) and, every ``--interval`` seconds, GetClusterSummary and
ListNodes: nodes, not workloads, so its cost does not grow with the workloads. Ctrl-C ends it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import click
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ops.persys.commands.events import Follower, event_line
from ops.persys.commands.reads import allocated, node_rows
from ops.persys.errors import CliError
from ops.persys.main import Session, pass_session
from ops.persys.output import console, new_table
from proto.persys.control.v1 import control_pb2

FEED_LINES = 12


def _summary(s: control_pb2.GetClusterSummaryResponse, server: str, note: str) -> Panel:
    line = Text.assemble(
        ("nodes ", "bold"), f"{s.total_nodes} ", ("ready ", "green"), f"{s.ready_nodes} ",
        ("not ready ", "red"), f"{s.not_ready_nodes}   ",
        ("workloads ", "bold"), f"{s.total_workloads} ", ("running ", "green"),
        f"{s.running_workloads} ", ("pending ", "yellow"), f"{s.pending_workloads} ",
        ("failed ", "red"), f"{s.failed_workloads} ", ("deleted ", "dim"),
        f"{s.deleted_workloads}")
    return Panel(line, title=f"persys top  {server}", subtitle=note or None)


def _nodes(nodes: list[control_pb2.NodeView], rows: int) -> Panel:
    ordered = sorted(nodes, key=lambda n: (-_fill(n), n.node_id))[:rows]
    table: Table = new_table("NODE", "STATUS", "CPU (allocated)", "MEMORY (allocated)",
                             "IN USE", "HEARTBEAT")
    node_rows(table, ordered, wide=False)
    more = f" (fullest {len(ordered)} of {len(nodes)})" if len(nodes) > len(ordered) else ""
    return Panel(table, title=f"nodes{more}")


def _fill(n: control_pb2.NodeView) -> float:
    cpu_used, cpu_total, mem_used, mem_total = allocated(n)
    return max(cpu_used / cpu_total if cpu_total else 0.0,
               mem_used / mem_total if mem_total else 0.0)


@click.command("top")
@click.option("--interval", type=click.FloatRange(0.5, 60), default=2.0, show_default=True,
              help="Seconds between summary refreshes.")
@click.option("--rows", type=click.IntRange(1, 500), default=20, show_default=True,
              help="Nodes shown (the fullest first).")
@click.option("--iterations", type=int, default=0, hidden=True)
@pass_session
def top_cmd(session: Session, interval: float, rows: int, iterations: int) -> None:
    """A live view: nodes with allocation bars, workloads by state, the event feed."""
    feed: deque[str] = deque(maxlen=FEED_LINES)
    newest = session.client.call("ListEvents", control_pb2.ListEventsRequest(
        limit=FEED_LINES)).events
    for event in newest:
        feed.append(event_line(event))
    cursor = newest[-1].id if newest else "0-0"
    follower = Follower(session, control_pb2.WatchEventsRequest(), cursor,
                        lambda e: feed.append(event_line(e)))
    threading.Thread(target=_follow, args=(follower, feed), name="events",
                     daemon=True).start()
    out = console()
    done = 0
    with Live(console=out, screen=out.is_terminal, auto_refresh=False) as live:
        while True:
            note = ""
            try:
                summary = session.client.call("GetClusterSummary",
                                              control_pb2.GetClusterSummaryRequest())
                nodes = list(session.client.call("ListNodes", control_pb2.ListNodesRequest()
                                                 ).nodes)
            except CliError as exc:
                note = f"refresh failed: {exc}"
                summary, nodes = control_pb2.GetClusterSummaryResponse(), []
            # what fits the terminal: the fullest nodes, then as many events as remain,
            # newest first (a line wraps at narrow widths)
            height = out.size.height
            shown_rows = max(1, min(rows, len(nodes), (height - 12) // 2))
            room = max(3, height - shown_rows - 11)
            newest_first = list(reversed(feed))[:room]
            parts: list[Any] = [_summary(summary, session.target.server, note),
                                _nodes(nodes, shown_rows),
                                Panel(Text("\n".join(newest_first) or "(no events yet)",
                                           overflow="ellipsis", no_wrap=True),
                                      title="events (newest first)")]
            live.update(Group(*parts), refresh=True)
            done += 1
            if iterations and done >= iterations:
                return
            time.sleep(interval)


def _follow(follower: Follower, feed: deque[str]) -> None:
    try:
        follower.run()
    except CliError as exc:
        feed.append(f"!! event feed stopped: {exc}")


COMMANDS = [top_cmd]
