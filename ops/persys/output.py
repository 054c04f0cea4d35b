"""How answers are shown: tables for people, JSON and YAML for scripts.

* ``-o table`` (the default) and ``-o wide`` (more columns) are rich tables; colour only on a
  terminal (rich decides, and honours ``NO_COLOR``). Off a terminal the width is not clipped
  to 80 columns, so a pipe gets whole lines.
* ``-o json`` is stable for scripts: protobuf field names as in the ``.proto`` files, every
  field present (zero values included), keys sorted. ``-o yaml`` is the same data as YAML.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import click
import yaml
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console, RenderableType
from rich.table import Table

FORMATS = ("table", "wide", "json", "yaml")
#: width of an allocation bar, in cells
BAR_CELLS = 10


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """A reader that stopped reading (``persys nodes | head``) is not a failure."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(0)


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return _Console(file=stream, width=None if tty else 250, soft_wrap=not tty,
                    highlight=False)


def message_dict(msg: Message, *, defaults: bool = True) -> dict[str, Any]:
    """``msg`` as a plain dict: proto field names, 64-bit integers as numbers (protobuf's
    JSON mapping writes them as strings), zero values included unless ``defaults`` is off."""
    body: dict[str, Any] = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=defaults)
    _numbers(msg.DESCRIPTOR, body)
    return body


_INT64 = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64,
                    FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_FIXED64,
                    FieldDescriptor.TYPE_SFIXED64})


def _numbers(descriptor: Descriptor, body: dict[str, Any]) -> None:
    for field in descriptor.fields:
        if field.name not in body:
            continue
        value = body[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                for item in value.values():
                    _numbers(value_field.message_type, item)
            elif value_field.type in _INT64:
                body[field.name] = {k: int(v) for k, v in value.items()}
        elif field.message_type is not None:
            if field.message_type.full_name.startswith("google.protobuf."):
                continue
            for item in value if isinstance(value, list) else [value]:
                _numbers(field.message_type, item)
        elif field.type in _INT64:
            body[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)


def emit(fmt: str, data: Any, table: Callable[[], RenderableType | Iterable[RenderableType]]
         ) -> None:
    """Print ``data`` as JSON/YAML, or the renderables ``table()`` builds."""
    if fmt == "json":
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    if fmt == "yaml":
        click.echo(yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip())
        return
    out = console()
    built = table()
    for item in built if isinstance(built, list | tuple) else [built]:
        out.print(item)


def new_table(*columns: str) -> Table:
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def when(ts: Timestamp) -> datetime | None:
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, UTC)


def ago(ts: Timestamp, now: datetime | None = None) -> str:
    """"12s", "5m", "3h", "2d" since ``ts``; "-" when unset."""
    moment = when(ts)
    if moment is None:
        return "-"
    seconds = int(((now or datetime.now(UTC)) - moment).total_seconds())
    if seconds < 0:
        return "0s"
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def stamp(ts: Timestamp) -> str:
    moment = when(ts)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ") if moment else "-"


def bar(used: float, total: float, cells: int = BAR_CELLS) -> str:
    """A text bar of ``used/total``: "███████░░░"."""
    if total <= 0:
        return "░" * cells
    filled = max(0, min(cells, round(cells * used / total)))
    return "█" * filled + "░" * (cells - filled)


def status_style(status: str) -> str:
    s = status.lower()
    if s in ("ready", "active", "running"):
        return "green"
    if s in ("notready", "failed", "removed"):
        return "red"
    if s in ("draining", "drained", "pending", "retrypending", "deleting", "stopped"):
        return "yellow"
    return ""
