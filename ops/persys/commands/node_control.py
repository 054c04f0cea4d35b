"""Node writes: ``drain``, ``undrain``, ``taint``, ``untaint``, ``label``."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ops.persys.commands.common import require_accepted
from ops.persys.errors import CliError, InputError
from ops.persys.main import Session, pass_session
from ops.persys.output import console
from proto.persys.control.v1 import control_pb2

EFFECTS = ("NoSchedule", "PreferNoSchedule")
#: how often ``drain --wait`` counts what is left on the node
POLL_S = 0.5


def _on_node(session: Session, node_id: str) -> list[control_pb2.WorkloadView]:
    answer = session.client.call("ListWorkloads",
                                 control_pb2.ListWorkloadsRequest(node_id=node_id))
    return [w for w in answer.workloads if w.desired_state != "Deleted"]


@click.command("drain")
@click.argument("node_id")
@click.option("--reason", default="", help="Why (kept in the node record and its event).")
@click.option("--wait", is_flag=True, help="Show the relocations as they happen, then a summary.")
@pass_session
def drain_cmd(session: Session, node_id: str, reason: str, wait: bool) -> None:
    """Stop placing on a node and move its workloads away.

    Node-local workloads (their data is on the node) stay, each with a RescheduleSkipped event.
    """
    request = control_pb2.DrainNodeRequest(node_id=node_id, reason=reason)
    if not wait:
        answer = session.client.call("DrainNode", request, timeout_s=max(
            session.target.timeout_s, 300.0))
        require_accepted(answer, f"drain {node_id}")
        click.echo(f"node {node_id} draining: {answer.relocated_workloads} workloads relocated")
        return
    before = {w.workload_id for w in _on_node(session, node_id)}
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["answer"] = session.client.call("DrainNode", request, timeout_s=max(
                session.target.timeout_s, 300.0))
        except CliError as exc:
            result["error"] = exc

    worker = threading.Thread(target=call, name="drain", daemon=True)
    worker.start()
    columns = (TextColumn(f"relocating off {node_id}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console(stderr=True), transient=False) as progress:
        task = progress.add_task("drain", total=max(1, len(before)))
        while True:
            done = not worker.is_alive()
            left = {w.workload_id for w in _on_node(session, node_id)} & before
            progress.update(task, completed=len(before) - len(left) if before else 1)
            if done:
                break
            time.sleep(POLL_S)
    worker.join()
    if "error" in result:
        raise result["error"]
    answer = result["answer"]
    require_accepted(answer, f"drain {node_id}")
    staying = sorted({w.workload_id for w in _on_node(session, node_id)})
    click.echo(f"node {node_id} drained: {answer.relocated_workloads} relocated, "
               f"{len(staying)} staying" + (f" ({', '.join(staying)})" if staying else ""))


@click.command("undrain")
@click.argument("node_id")
@click.option("--reason", default="")
@pass_session
def undrain_cmd(session: Session, node_id: str, reason: str) -> None:
    """Return a drained node to service."""
    answer = session.client.call("UndrainNode", control_pb2.UndrainNodeRequest(
        node_id=node_id, reason=reason))
    require_accepted(answer, f"undrain {node_id}")
    click.echo(f"node {node_id}: {answer.node.status or 'Ready'}")


TAINT = re.compile(r"^(?P<key>[^=:]+)(=(?P<value>[^:]*))?(:(?P<effect>\w+))?$")


def _taint(text: str, *, with_value: bool) -> tuple[str, str, str]:
    m = TAINT.match(text)
    if not m or (m.group("effect") or "NoSchedule") not in EFFECTS:
        form = "key=value:Effect" if with_value else "key:Effect"
        raise InputError(f"taint {text!r}: expected {form} (Effect: {', '.join(EFFECTS)})")
    return m.group("key"), m.group("value") or "", m.group("effect") or "NoSchedule"


@click.command("taint")
@click.argument("node_id")
@click.argument("taint")
@pass_session
def taint_cmd(session: Session, node_id: str, taint: str) -> None:
    """Taint a node: key=value:NoSchedule (no new placements) or :PreferNoSchedule."""
    key, value, effect = _taint(taint, with_value=True)
    answer = session.client.call("TaintNode", control_pb2.TaintNodeRequest(
        node_id=node_id, taint=control_pb2.NodeTaint(key=key, value=value, effect=effect)))
    require_accepted(answer, f"taint {node_id}")
    click.echo(f"node {node_id} tainted {key}={value}:{effect}")


@click.command("untaint")
@click.argument("node_id")
@click.argument("taint")
@pass_session
def untaint_cmd(session: Session, node_id: str, taint: str) -> None:
    """Remove a taint: key:Effect."""
    key, _, effect = _taint(taint, with_value=False)
    answer = session.client.call("UntaintNode", control_pb2.UntaintNodeRequest(
        node_id=node_id, key=key, effect=effect))
    require_accepted(answer, f"untaint {node_id}")
    click.echo(f"node {node_id} untainted {key}:{effect}")


@click.command("label")
@click.argument("node_id")
@click.argument("labels", nargs=-1, required=True)
@pass_session
def label_cmd(session: Session, node_id: str, labels: tuple[str, ...]) -> None:
    """Set labels (key=value) or remove them (key-)."""
    for label in labels:
        if label.endswith("-") and "=" not in label:
            key = label[:-1]
            answer = session.client.call("DeleteNodeLabel", control_pb2.DeleteNodeLabelRequest(
                node_id=node_id, key=key))
            require_accepted(answer, f"label {node_id}")
            click.echo(f"node {node_id}: label {key} removed")
            continue
        key, sep, value = label.partition("=")
        if not sep or not key:
            raise InputError(f"label {label!r}: expected key=value or key-")
        answer = session.client.call("SetNodeLabel", control_pb2.SetNodeLabelRequest(
            node_id=node_id, key=key, value=value))
        require_accepted(answer, f"label {node_id}")
        click.echo(f"node {node_id}: label {key}={value}")


COMMANDS = [drain_cmd, undrain_cmd, taint_cmd, untaint_cmd, label_cmd]
