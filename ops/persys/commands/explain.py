"""``persys explain``: why a workload is where it is, or where a spec would go and why not.

The scheduler computes the answer (ExplainPlacement) with its own placement function, so this
module only shows it: the refusals counted by reason, the best candidates with their score's
parts, the reservations that counted, and a sample of refusals in full.
"""

from __future__ import annotations

from typing import Any

import click
from rich.text import Text

from ops.persys.commands.common import output_option
from ops.persys.commands.workload_control import read_file_option
from ops.persys.errors import InputError
from ops.persys.main import Session, pass_session
from ops.persys.output import emit, message_dict, new_table
from proto.persys.control.v1 import control_pb2


def one_line(answer: control_pb2.ExplainPlacementResponse) -> str:
    if answer.chosen_node_id:
        best = next((c for c in answer.candidates if c.node_id == answer.chosen_node_id), None)
        score = f" (score {best.score:.4f})" if best else ""
        return f"would go to node {answer.chosen_node_id}{score}; {answer.summary}"
    return f"fits nowhere: {answer.summary}"


def explanation_renderables(answer: control_pb2.ExplainPlacementResponse) -> list[Any]:
    head = [Text(answer.summary, style="bold")]
    if answer.assigned_node_id:
        head.append(Text(f"assigned to {answer.assigned_node_id}"
                         + (f": {answer.assigned_reason}" if answer.assigned_reason else "")))
    head.append(Text(f"placement now: {answer.chosen_node_id or 'no node fits'}"
                     f"  (request: {answer.workload_type}, {answer.cpu_millicores}m cpu, "
                     f"{answer.memory_mb} MB)"))
    if answer.reservations:
        head.append(Text(f"in-flight reservations counted: {answer.reservations} "
                         f"({answer.reserved_cpu_millicores}m cpu, "
                         f"{answer.reserved_memory_mb} MB)"))
    parts: list[Any] = head
    if answer.refusals:
        refusals = new_table("REFUSED BECAUSE", "NODES")
        for r in answer.refusals:
            refusals.add_row(r.reason, str(r.nodes))
        parts.append(refusals)
    if answer.candidates:
        table = new_table("CANDIDATE", "SCORE", "CPU HEADROOM", "MEM HEADROOM", "SPREAD",
                          "TIE-BREAK", "PENALTY", "FREE CPU", "FREE MEM", "RESERVED")
        for c in answer.candidates:
            table.add_row(c.node_id, f"{c.score:.4f}", f"{c.cpu_headroom:.3f}",
                          f"{c.memory_headroom:.3f}", f"{c.spread:.3f}", f"{c.tie_break:.4f}",
                          f"{c.taint_penalty:g}", f"{c.free_cpu_millicores}m",
                          f"{c.free_memory_mb} MB",
                          f"{c.reserved_cpu_millicores}m/{c.reserved_memory_mb} MB")
        parts.append(table)
    if answer.refusal_sample:
        sample = new_table("REFUSED NODE", "REASON")
        for r in answer.refusal_sample:
            sample.add_row(r.node_id, r.reason)
        parts.append(sample)
    return parts


@click.command("explain")
@click.argument("workload_id", required=False)
@click.option("-f", "--filename", "path", metavar="FILE|-", help="Explain a spec file instead.")
@click.option("--id", "spec_id", default="", help="Workload id for a persysctl spec file.")
@click.option("--top", type=click.IntRange(1, 50), default=5, show_default=True)
@output_option
@pass_session
def explain_cmd(session: Session, workload_id: str | None, path: str | None, spec_id: str,
                top: int, fmt: str) -> None:
    """Why WORKLOAD_ID is where it is (or pending), or where a spec file would go."""
    if bool(workload_id) == bool(path):
        raise InputError("give a workload id or -f FILE (one of them)")
    requests = []
    if path:
        for doc in read_file_option(path, workload_id=spec_id):
            requests.append(control_pb2.ExplainPlacementRequest(
                workload_id=doc.request.workload_id, spec=doc.request.spec, top=top))
    else:
        requests.append(control_pb2.ExplainPlacementRequest(workload_id=workload_id, top=top))
    answers = [session.client.call("ExplainPlacement", r) for r in requests]
    data: Any = [message_dict(a) for a in answers]
    emit(fmt, data[0] if len(data) == 1 else {"explanations": data},
         lambda: [part for a in answers for part in
                  [Text(f"{a.workload_id}:", style="bold underline"),
                   *explanation_renderables(a)]])


COMMANDS = [explain_cmd]
