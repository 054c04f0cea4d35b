"""Read commands: ``nodes``, ``node``, ``workloads``, ``workload``, ``summary``."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table
from rich.text import Text

from ops.persys.commands.common import output_option
from ops.persys.errors import Refused
from ops.persys.main import Session, pass_session
from ops.persys.output import (
    ago,
    bar,
    emit,
    message_dict,
    new_table,
    stamp,
    status_style,
)
from proto.persys.control.v1 import control_pb2

#: events shown by ``persys workload ID``
RECENT_EVENTS = 10


def has_allocations(view: control_pb2.NodeView) -> bool:
    """This scheduler's views carry the allocations; a Go scheduler's do not."""
    return bool(view.allocatable_cpu_cores or view.allocated_cpu_cores
                or view.allocatable_memory_mb or view.allocated_memory_mb)


def allocated(view: control_pb2.NodeView) -> tuple[float, float, int, int]:
    """(cpu allocated, cpu total, memory allocated MB, memory total MB): what placement
    counts. A Go scheduler's view has no allocations: its ``available`` fields are used."""
    cpu_total = view.total_cpu_cores
    mem_total = view.total_memory_mb
    if has_allocations(view):
        return view.allocated_cpu_cores, cpu_total, view.allocated_memory_mb, mem_total
    return (max(0.0, cpu_total - view.available_cpu_cores), cpu_total,
            max(0, mem_total - view.available_memory_mb), mem_total)


def used_text(view: control_pb2.NodeView) -> str:
    """What the agent reported in use (the Go meaning of ``available``)."""
    if view.usage_reported:
        return f"{view.used_cpu_cores:g} cores, {view.used_memory_mb} MB"
    if not has_allocations(view):  # a Go scheduler: available = total - used
        return (f"{max(0.0, view.total_cpu_cores - view.available_cpu_cores):g} cores, "
                f"{max(0, view.total_memory_mb - view.available_memory_mb)} MB")
    return "-"


def _styled(status: str) -> Text:
    return Text(status, style=status_style(status))


def node_rows(table: Table, nodes: list[control_pb2.NodeView], wide: bool) -> None:
    for n in nodes:
        cpu_used, cpu_total, mem_used, mem_total = allocated(n)
        row: list[Any] = [
            n.node_id, _styled(n.status),
            f"{bar(cpu_used, cpu_total)} {cpu_used:g}/{cpu_total:g}",
            f"{bar(mem_used, mem_total)} {mem_used}/{mem_total} MB",
            used_text(n), ago(n.last_heartbeat),
        ]
        if wide:
            row += [n.grpc_endpoint, ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())),
                    ",".join(f"{t.key}={t.value}:{t.effect or 'NoSchedule'}" for t in n.taints),
                    ",".join(n.supported_workload_types), n.status_reason]
        table.add_row(*row)


NODE_COLUMNS = ("NODE", "STATUS", "CPU (cores allocated)", "MEMORY (allocated)", "IN USE",
                "HEARTBEAT")
NODE_WIDE = ("ENDPOINT", "LABELS", "TAINTS", "TYPES", "REASON")


@click.command("nodes")
@click.option("--status", default="", help="Only nodes with this status.")
@output_option
@pass_session
def nodes_cmd(session: Session, status: str, fmt: str) -> None:
    """List nodes with their allocation and last heartbeat."""
    answer = session.client.call("ListNodes", control_pb2.ListNodesRequest(status=status))
    nodes = sorted(answer.nodes, key=lambda n: n.node_id)

    def table() -> Table:
        t = new_table(*NODE_COLUMNS, *(NODE_WIDE if fmt == "wide" else ()))
        node_rows(t, nodes, fmt == "wide")
        return t

    emit(fmt, {"nodes": [message_dict(n) for n in nodes]}, table)


@click.command("node")
@click.argument("node_id")
@output_option
@pass_session
def node_cmd(session: Session, node_id: str, fmt: str) -> None:
    """Describe one node and the workloads assigned to it."""
    node = session.client.call("GetNode", control_pb2.GetNodeRequest(node_id=node_id)).node
    workloads = session.client.call(
        "ListWorkloads", control_pb2.ListWorkloadsRequest(node_id=node_id)).workloads

    def table() -> list[Any]:
        cpu_used, cpu_total, mem_used, mem_total = allocated(node)
        facts = new_table("", "")
        for key, value in (
            ("Node", node.node_id), ("Status", _styled(node.status)),
            ("Reason", node.status_reason or "-"),
            ("Changed", f"{stamp(node.status_updated_at)} by {node.status_updated_by or '-'}"),
            ("Last heartbeat", f"{stamp(node.last_heartbeat)} ({ago(node.last_heartbeat)} ago)"),
            ("Endpoint", node.grpc_endpoint),
            ("CPU", f"{bar(cpu_used, cpu_total)} {cpu_used:g} of {cpu_total:g} cores allocated"),
            ("Memory", f"{bar(mem_used, mem_total)} {mem_used} of {mem_total} MB allocated"),
            ("In use", f"{used_text(node)} (as its agent reported)"),
            ("Types", ", ".join(node.supported_workload_types) or "-"),
            ("Labels", ", ".join(f"{k}={v}" for k, v in sorted(node.labels.items())) or "-"),
            ("Taints", ", ".join(f"{t.key}={t.value}:{t.effect or 'NoSchedule'}"
                                 for t in node.taints) or "-"),
        ):
            facts.add_row(Text(key, style="bold"), value)
        listed = new_table("WORKLOAD", "TYPE", "STATUS", "DESIRED")
        for w in sorted(workloads, key=lambda w: w.workload_id):
            listed.add_row(w.workload_id, w.type, _styled(w.status), w.desired_state)
        return [facts, Text(f"\nWorkloads ({len(workloads)}):", style="bold"), listed]

    emit(fmt, {"node": message_dict(node),
               "workloads": [message_dict(w) for w in workloads]}, table)


WORKLOAD_COLUMNS = ("WORKLOAD", "TYPE", "DESIRED", "STATUS", "NODE", "RETRIES", "UPDATED")


def workload_row(w: control_pb2.WorkloadView, wide: bool) -> list[Any]:
    retries = f"{w.retry_attempts}/{w.retry_max_attempts}" if w.retry_max_attempts else "-"
    row: list[Any] = [w.workload_id, w.type, w.desired_state, _styled(w.status),
                      w.assigned_node_id or "-", retries, ago(w.last_updated)]
    if wide:
        row += [w.reason.code or "-", w.failure_reason or w.reason.message or "-"]
    return row


@click.command("workloads")
@click.option("--node", "node_id", default="", help="Only workloads assigned to this node.")
@click.option("--status", default="", help="Only workloads with this status.")
@click.option("--type", "wtype", default="", help="Only workloads of this type.")
@output_option
@pass_session
def workloads_cmd(session: Session, node_id: str, status: str, wtype: str, fmt: str) -> None:
    """List workloads."""
    answer = session.client.call("ListWorkloads", control_pb2.ListWorkloadsRequest(
        node_id=node_id, status=status))
    rows = sorted((w for w in answer.workloads if not wtype or w.type.lower() == wtype.lower()),
                  key=lambda w: w.workload_id)

    def table() -> Table:
        t = new_table(*WORKLOAD_COLUMNS, *(("CODE", "REASON") if fmt == "wide" else ()))
        for w in rows:
            t.add_row(*workload_row(w, fmt == "wide"))
        return t

    emit(fmt, {"workloads": [message_dict(w) for w in rows]}, table)


def optional_call(session: Session, method: str, request: Any) -> Any:
    """A call whose absence (an older scheduler) or refusal leaves a part of a view empty."""
    try:
        return session.client.call(method, request)
    except Refused:
        return None


@click.command("workload")
@click.argument("workload_id")
@output_option
@pass_session
def workload_cmd(session: Session, workload_id: str, fmt: str) -> None:
    """Describe a workload: spec, status, retries, its recent events and placement.

    -o yaml (or json) prints it in the form `persys apply -f` reads: edit and apply again
    (the `status` part is what the scheduler reports, and apply ignores it).
    """
    answer = session.client.call("GetWorkload",
                                 control_pb2.GetWorkloadRequest(workload_id=workload_id))
    w = answer.workload
    events = optional_call(session, "ListEvents", control_pb2.ListEventsRequest(
        workload_id=workload_id, limit=RECENT_EVENTS))
    explained = optional_call(session, "ExplainPlacement",
                              control_pb2.ExplainPlacementRequest(workload_id=workload_id))
    # no revision_id: an edited copy applied again gets the revision of its new content
    data: dict[str, Any] = {"workload_id": w.workload_id, "desired_state": w.desired_state}
    if answer.HasField("spec"):
        data["spec"] = message_dict(answer.spec, defaults=False)
    data["status"] = {
        "workload": message_dict(w),
        "events": [message_dict(e) for e in (events.events if events else [])],
        "placement": message_dict(explained) if explained is not None else None,
    }

    def table() -> list[Any]:
        from ops.persys.commands.explain import explanation_renderables

        facts = new_table("", "")
        retries = (f"{w.retry_attempts} of {w.retry_max_attempts}"
                   + (f", next at {stamp(w.retry_next_at)}" if w.retry_next_at.seconds else "")
                   if w.retry_max_attempts else "-")
        for key, value in (
            ("Workload", w.workload_id), ("Type", w.type), ("Desired", w.desired_state),
            ("Status", _styled(w.status)), ("Node", w.assigned_node_id or "-"),
            ("Revision", w.revision_id or "-"), ("Retries", retries),
            ("Reason", f"{w.reason.code}: {w.reason.message}" if w.reason.code else "-"),
            ("Failure", w.failure_reason or "-"), ("Created", stamp(w.created_at)),
            ("Updated", f"{stamp(w.last_updated)} ({ago(w.last_updated)} ago)"),
        ):
            facts.add_row(Text(key, style="bold"), value)
        parts: list[Any] = [facts]
        if answer.HasField("spec"):
            import yaml
            parts += [Text("\nSpec:", style="bold"),
                      yaml.safe_dump(data["spec"], sort_keys=False).rstrip()]
        if events is not None:
            from ops.persys.commands.events import event_table
            parts += [Text(f"\nRecent events ({len(events.events)}):", style="bold"),
                      event_table(list(events.events), wide=False)]
        if explained is not None:
            parts += [Text("\nPlacement:", style="bold"), *explanation_renderables(explained)]
        return parts

    emit(fmt, data, table)


@click.command("summary")
@output_option
@pass_session
def summary_cmd(session: Session, fmt: str) -> None:
    """Counts of nodes and workloads by state."""
    s = session.client.call("GetClusterSummary", control_pb2.GetClusterSummaryRequest())

    def table() -> Table:
        t = new_table("", "")
        for key, value in (
            ("Nodes", s.total_nodes), ("  ready", s.ready_nodes),
            ("  not ready", s.not_ready_nodes), ("Workloads", s.total_workloads),
            ("  running", s.running_workloads), ("  pending", s.pending_workloads),
            ("  failed", s.failed_workloads), ("  deleted", s.deleted_workloads),
        ):
            t.add_row(Text(key, style="bold" if not key.startswith(" ") else ""), str(value))
        return t

    emit(fmt, message_dict(s), table)


COMMANDS = [nodes_cmd, node_cmd, workloads_cmd, workload_cmd, summary_cmd]
