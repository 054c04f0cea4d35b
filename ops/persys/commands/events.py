"""``persys events``: list the event history, or follow it across reconnects and failovers.

Following is exactly-once by cursor: every event's ``id`` is its stream id, and a watch that
ends (the scheduler restarted, a replica failed over, the network dropped) is opened again
with ``after_id`` = the last id printed, so nothing is printed twice and nothing is skipped.
Without ``--after`` the recent history is read first with ListEvents, which also gives the
cursor to resume from before the first watch has delivered anything. An ``EventsGap`` (the
history a cursor pointed into was trimmed, or lost) is printed as its own line saying what is
missing; it never moves the cursor.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from ops.persys.commands.common import output_option
from ops.persys.errors import Refused, Unreachable
from ops.persys.main import Session, pass_session
from ops.persys.output import emit, message_dict, new_table, stamp
from proto.persys.control.v1 import control_pb2

GAP = "EventsGap"
#: the smallest stream id: "everything retained"
OLDEST = "0-0"
#: reconnect backoff, seconds
BACKOFF_START_S = 0.2
BACKOFF_MAX_S = 3.0
#: statuses after which a watch is opened again (anything else is final)
RESUMABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED", "INTERNAL", "UNKNOWN",
             "ABORTED")


def id_key(stream_id: str) -> tuple[int, int]:
    head, _, tail = stream_id.partition("-")
    try:
        return int(head), int(tail or 0)
    except ValueError:
        return (-1, -1)


def gap_line(event: control_pb2.SchedulerEventView) -> str:
    d = event.details
    span = f"after {d.get('from', event.id)} up to {d.get('to', '?')}"
    dropped = f", {d['dropped']} events" if d.get("dropped") else ""
    cause = f" [{d['cause']}]" if d.get("cause") else ""
    return f"!! EventsGap: events lost {span}{dropped}{cause}: {event.reason}"


def event_line(event: control_pb2.SchedulerEventView) -> str:
    if event.type == GAP:
        return gap_line(event)
    who = " ".join(part for part in (f"node={event.node_id}" if event.node_id else "",
                                     f"workload={event.workload_id}" if event.workload_id
                                     else "") if part)
    return f"{stamp(event.timestamp)}  {event.type:<20} {who:<40} {event.reason}  [{event.id}]"


def event_table(events: list[control_pb2.SchedulerEventView], *, wide: bool) -> Table:
    t = new_table("TIME", "TYPE", "NODE", "WORKLOAD", "REASON", *(("ID", "DETAILS") if wide
                                                                    else ()))
    for e in events:
        style = "bold red" if e.type == GAP else ""
        row: list[Any] = [stamp(e.timestamp), Text(e.type, style=style), e.node_id or "-",
                          e.workload_id or "-", gap_line(e) if e.type == GAP else e.reason]
        if wide:
            row += [e.id, ", ".join(f"{k}={v}" for k, v in sorted(e.details.items()))]
        t.add_row(*row)
    return t


class Follower:
    """Prints a watch's events once each, reopening the watch after every interruption."""

    def __init__(self, session: Session, request: control_pb2.WatchEventsRequest,
                 cursor: str, printer: Callable[[control_pb2.SchedulerEventView], None],
                 *, max_events: int = 0) -> None:
        self.session = session
        self.request = request
        self.cursor = cursor
        self.printer = printer
        self.max_events = max_events
        self.printed = 0

    def run(self) -> None:
        backoff = BACKOFF_START_S
        while True:
            self.request.after_id = self.cursor
            try:
                for event in self.session.client.stream("WatchEvents", self.request):
                    backoff = BACKOFF_START_S
                    if self._take(event) and self.max_events and self.printed >= self.max_events:
                        return
            except (Unreachable, Refused) as exc:
                if isinstance(exc, Refused) and not any(code in str(exc) for code in RESUMABLE):
                    raise
                click.echo(f"persys: watch interrupted ({exc}); resuming after "
                           f"{self.cursor}", err=True)
            time.sleep(backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    def _take(self, event: control_pb2.SchedulerEventView) -> bool:
        if event.type == GAP:
            self.printer(event)
            return False
        if id_key(event.id) <= id_key(self.cursor):
            return False  # already printed (never expected: the server resumes after it)
        self.printer(event)
        self.cursor = event.id
        self.printed += 1
        return True


def printer_for(fmt: str) -> Callable[[control_pb2.SchedulerEventView], None]:
    if fmt in ("json", "yaml"):
        return lambda e: click.echo(json.dumps(message_dict(e), sort_keys=True))
    return lambda e: click.echo(event_line(e))


@click.command("events")
@click.option("--type", "etype", default="", help="Only events of this type.")
@click.option("--node", "node_id", default="", help="Only events of this node.")
@click.option("--workload", "workload_id", default="", help="Only events of this workload.")
@click.option("--after", "after_id", default="", metavar="ID",
              help="Only events after this id (a cursor printed in [brackets]).")
@click.option("--from-oldest", is_flag=True, help="Start from the oldest retained event.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True,
              help="How many events to list (or to replay before following).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events (JSON lines "
              "with -o json).")
@click.option("--max-events", type=int, default=0, hidden=True)
@output_option
@pass_session
def events_cmd(session: Session, etype: str, node_id: str, workload_id: str, after_id: str,
               from_oldest: bool, limit: int, follow: bool, max_events: int, fmt: str) -> None:
    """List or follow scheduler events."""
    if after_id and from_oldest:
        raise click.UsageError("--after and --from-oldest exclude each other")
    cursor = OLDEST if from_oldest else after_id
    listed = session.client.call("ListEvents", control_pb2.ListEventsRequest(
        limit=limit, type=etype, node_id=node_id, workload_id=workload_id, after_id=cursor))
    events = list(listed.events)
    if not follow:
        emit(fmt, {"events": [message_dict(e) for e in events]},
             lambda: event_table(events, wide=fmt == "wide"))
        return
    printer = printer_for(fmt)
    for event in events:
        printer(event)
    newest = [e.id for e in events if e.type != GAP]
    if newest:
        cursor = max(newest, key=id_key)
    elif not cursor:
        cursor = _newest_id(session) or OLDEST
    shown = len(newest)
    if max_events and shown >= max_events:
        return
    Follower(session, control_pb2.WatchEventsRequest(type=etype, node_id=node_id,
                                                     workload_id=workload_id),
             cursor, printer, max_events=max(0, max_events - shown)).run()


def _newest_id(session: Session) -> str:
    """The newest event id of the whole stream: where an empty filtered history resumes."""
    answer = session.client.call("ListEvents", control_pb2.ListEventsRequest(limit=1))
    ids: Iterable[str] = (e.id for e in answer.events if e.type != GAP)
    return max(ids, key=id_key, default="")


COMMANDS = [events_cmd]
