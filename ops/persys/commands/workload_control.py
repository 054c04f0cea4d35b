"""Workload writes: ``apply``, ``delete``, ``retry``, ``stop``, ``start``."""

from __future__ import annotations

import sys

import click

from ops.persys.commands.common import require_accepted
from ops.persys.errors import InputError, Refused
from ops.persys.main import Session, pass_session
from ops.persys.specfiles import Document, read_documents
from proto.persys.control.v1 import control_pb2

#: how a scheduler answers an apply it stored to place later (success=false, as the Go one)
STORED_PENDING = "stored as Pending, placed when capacity appears: "


def read_file_option(path: str, **kw: str) -> list[Document]:
    if path == "-":
        text, source = sys.stdin.read(), "<stdin>"
    else:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise InputError(f"{path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise InputError(f"{path}: not UTF-8 text ({exc.reason})") from exc
        source = path
    return read_documents(text, source, **kw)


@click.command("apply")
@click.option("-f", "--filename", "path", required=True, metavar="FILE|-",
              help="YAML or JSON, one or many documents; - reads stdin.")
@click.option("--id", "workload_id", default="", help="Workload id (for persysctl spec files).")
@click.option("--type", "wtype", default="", help="container, compose or vm (persysctl files).")
@click.option("--desired-state", type=click.Choice(["Running", "Stopped"],
                                                    case_sensitive=False), default=None)
@click.option("--dry-run", is_flag=True, help="Say where each would go and why; store nothing.")
@pass_session
def apply_cmd(session: Session, path: str, workload_id: str, wtype: str,
              desired_state: str | None, dry_run: bool) -> None:
    """Create or update workloads from a file."""
    docs = read_file_option(path, workload_id=workload_id, workload_type=wtype,
                            desired_state=(desired_state or "").capitalize())
    refused = 0
    for doc in docs:
        wid = doc.request.workload_id
        if dry_run:
            from ops.persys.commands.explain import one_line

            answer = session.client.call("ExplainPlacement", control_pb2.ExplainPlacementRequest(
                workload_id=wid, spec=doc.request.spec))
            click.echo(f"{wid}: {one_line(answer)} (dry run, nothing stored)")
            continue
        answer = session.client.call("ApplyWorkload", doc.request)
        if answer.success:
            click.echo(f"workload {wid} applied")
            continue
        if answer.error_message.startswith(STORED_PENDING):
            # stored: the scheduler places it when capacity appears (not a refusal)
            click.echo(f"workload {wid} pending: "
                       f"{answer.error_message.removeprefix(STORED_PENDING)}")
            continue
        refused += 1
        code = control_pb2.FailureReason.Name(answer.failure_reason)
        click.echo(f"persys: workload {wid} ({doc.where}) refused: {code}: "
                   f"{answer.error_message}", err=True)
    if refused:
        raise Refused(f"{refused} of {len(docs)} refused")


@click.command("delete")
@click.argument("workload_ids", nargs=-1, required=True)
@pass_session
def delete_cmd(session: Session, workload_ids: tuple[str, ...]) -> None:
    """Delete workloads."""
    refused = 0
    for wid in workload_ids:
        answer = session.client.call("DeleteWorkload",
                                     control_pb2.DeleteWorkloadRequest(workload_id=wid))
        if answer.success:
            click.echo(f"workload {wid} deleted")
        else:
            refused += 1
            click.echo(f"persys: workload {wid}: {answer.error_message}", err=True)
    if refused:
        raise Refused(f"{refused} of {len(workload_ids)} not deleted")


@click.command("retry")
@click.argument("workload_id")
@pass_session
def retry_cmd(session: Session, workload_id: str) -> None:
    """Reset a workload's retry budget and apply it again."""
    answer = session.client.call("RetryWorkload",
                                 control_pb2.RetryWorkloadRequest(workload_id=workload_id))
    if not answer.accepted:
        raise Refused(f"retry of {workload_id} not accepted (unknown or deleted workload)")
    click.echo(f"workload {workload_id}: retry requested")


def _set_desired(session: Session, workload_id: str, desired: str) -> None:
    answer = session.client.call("ApplyWorkload", control_pb2.ApplyWorkloadRequest(
        workload_id=workload_id, desired_state=desired))
    require_accepted(answer, f"workload {workload_id}")
    click.echo(f"workload {workload_id}: desired state {desired}")


@click.command("stop")
@click.argument("workload_id")
@pass_session
def stop_cmd(session: Session, workload_id: str) -> None:
    """Stop a workload (its desired state becomes Stopped)."""
    _set_desired(session, workload_id, "Stopped")


@click.command("start")
@click.argument("workload_id")
@pass_session
def start_cmd(session: Session, workload_id: str) -> None:
    """Start a stopped workload (its desired state becomes Running)."""
    _set_desired(session, workload_id, "Running")


COMMANDS = [apply_cmd, delete_cmd, retry_cmd, stop_cmd, start_cmd]
