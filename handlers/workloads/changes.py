"""Transactions that more than one workload path builds.

Why apart: the dispatcher finalises a deleted workload once its agent confirmed, and the
workload commands and the reconcile loop reach the same transaction through it; keeping the
builder here lets the dispatcher own finalisation without importing the commands above it.
"""

from __future__ import annotations

from eventsource.commit import Change
from eventsource.etcd import Compare, Delete, Put
from eventsource.events import Event
from eventsource.keys import KeyLayout
from eventsource.records import Allocation, encode


def delete_workload_change(
    layout: KeyLayout, workload_id: str, *, spec_rev: int, status_rev: int,
    allocation: tuple[str, Allocation | None, int] | None, event: Event | None,
) -> Change:
    """The transaction that removes a deleted workload's state (finalisation)."""
    change = Change(
        kind="workload",
        compares=[Compare.mod(layout.spec(workload_id), spec_rev),
                  Compare.mod(layout.status(workload_id), status_rev)],
        deletes=[Delete(layout.spec(workload_id), category="spec"),
                 Delete(layout.status(workload_id), category="status"),
                 Delete(layout.assignment(workload_id), category="assignment"),
                 Delete(layout.legacy_workload(workload_id), category="other"),
                 Delete(layout.retry(workload_id), category="other")],
    )
    if allocation is not None:
        node_id, record, mod = allocation
        change.compares.append(Compare.mod(layout.allocation(node_id), mod))
        if record is not None:
            change.puts.append(Put(layout.allocation(node_id), encode(record),
                                   category="allocation"))
    if event is not None:
        change.events.append(event)
    return change
