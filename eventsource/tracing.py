"""Trace spans of the write path, on the OpenTelemetry API only (no SDK, no exporter here).

Why here: the commit, the group commit and the relay are where an ApplyWorkload's time goes
after its decision, and they know nothing of gRPC. The composition root decides whether traces
are exported; when they are not, every component holds ``tracer=None`` and none of this runs
(no span objects, no context look-ups: docs/operations.md, "Tracing").

Rules every user follows:

* spans of the write path are made only inside a trace that is being recorded (a server call,
  a sampled reconcile node): a commit made by a background task (relay marks, keepalives) makes
  none, so nothing here starts a trace of its own;
* a committed event remembers the span that committed it as a W3C ``traceparent``
  (``Event.traceparent``); its outbox record carries it, the stream entry's ``details`` carry its
  ``trace_id`` (docs/events.md), and the relay makes its append span a child of it;
* the step that must follow a commit (``on_commit``: an agent call) runs in the committer's
  own task; it is run in the caller's context (``in_context``), so it joins the caller's trace;
* a wait shared by many callers (a group commit, a placement batch) is shown in each caller's
  trace, as attributes of its commit span and a transaction span with explicit start and end
  times (``CommitTiming``), since no single span of the shared task could belong to all of
  those traces;
* spans without children are never made current (``start_span``, not
  ``start_as_current_span``): a context switch costs as much as the span.

Attribute names are the Go scheduler's (``scheduler.*``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
)

from eventsource.events import Event

#: the instrumentation scope of every span of the scheduler's own code
TRACER_NAME = "persys.scheduler"

#: attribute names the Go scheduler put on its spans
NODE_ID = "scheduler.node_id"
WORKLOAD_ID = "scheduler.workload_id"
DESIRED_STATE = "scheduler.workload_desired_state"
WORKLOAD_TYPE = "scheduler.workload_type"
#: ours: what the commit wrote, how it went, and how it was shared
COMMIT_KIND = "scheduler.commit_kind"
COMMIT_OUTCOME = "scheduler.commit_outcome"
COMMIT_REVISION = "scheduler.commit_revision"
GROUP_SIZE = "scheduler.group_size"
GROUP_WAIT_MS = "scheduler.group_wait_ms"
BATCH_WAIT_MS = "scheduler.batch_wait_ms"
EVENT_TYPE = "scheduler.event_type"
EVENT_ID = "scheduler.event_id"
STREAM_ID = "scheduler.stream_id"


def recording() -> bool:
    """Whether the current span is being recorded (a span made now would be exported)."""
    return trace.get_current_span().is_recording()


def traceparent_of(context: SpanContext) -> str:
    """The W3C ``traceparent`` of a sampled span, or "" (an unsampled trace is not exported,
    so an event pointing at it would point at nothing)."""
    if not context.is_valid or not context.trace_flags.sampled:
        return ""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-01"


def current_traceparent() -> str:
    return traceparent_of(trace.get_current_span().get_span_context())


def trace_id_of(traceparent: str) -> str:
    """The 32 hex digits of the trace id in a ``traceparent`` ("" if it is not one)."""
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32:
        return ""
    return parts[1]


def parent_of(traceparent: str) -> Context | None:
    """A context whose current span is the (remote) span of ``traceparent``; None if it does
    not parse."""
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    context = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
    if not context.is_valid:
        return None
    return trace.set_span_in_context(NonRecordingSpan(context), Context())


def stamp(events: Sequence[Event], traceparent: str) -> list[Event]:
    """``events``, each without a trace of its own given ``traceparent``."""
    if not traceparent:
        return list(events)
    return [e if e.traceparent else dataclasses.replace(e, traceparent=traceparent)
            for e in events]


def in_context(ctx: Context, step: Callable[[int], None] | None
               ) -> Callable[[int], None] | None:
    """``step`` run with ``ctx`` as the current context: a commit's ``on_commit`` runs in the
    committer's task, and the agent call it starts belongs to the caller's trace."""
    if step is None:
        return None

    def run(revision: int) -> None:
        token = otel_context.attach(ctx)
        try:
            step(revision)
        finally:
            otel_context.detach(token)

    return run


@dataclass(slots=True)
class CommitTiming:
    """When one change went through the group commit (``time.time_ns`` stamps), for spans
    drawn afterwards in the caller's trace; 0 = not reached."""

    queued_ns: int = 0
    sent_ns: int = 0
    answered_ns: int = 0
    #: changes in the transaction it was sent in
    group_size: int = 0
    #: "single" or "group" (the gateway request it rode in)
    request: str = ""

    def queued(self) -> None:
        self.queued_ns = time.time_ns()

    def sent(self, group_size: int, request: str) -> None:
        self.sent_ns = time.time_ns()
        self.group_size = group_size
        self.request = request

    def answered(self) -> None:
        self.answered_ns = time.time_ns()


def draw_commit(tracer: Tracer, parent: Span, timing: CommitTiming) -> None:
    """One change's way through the group commit, on ``parent`` (its commit span): the time it
    waited for a transaction as ``scheduler.group_wait_ms`` (queued until sent: transactions
    in flight, or a change writing the same key), and the transaction itself as an
    ``etcd.txn`` child span (sent until etcd answered)."""
    if not timing.queued_ns:
        return
    sent = timing.sent_ns or timing.answered_ns or time.time_ns()
    parent.set_attribute(GROUP_WAIT_MS, (sent - timing.queued_ns) / 1e6)
    if not timing.sent_ns:
        return
    txn = tracer.start_span("etcd.txn", context=trace.set_span_in_context(parent),
                            kind=SpanKind.CLIENT, start_time=timing.sent_ns,
                            attributes={"db.system": "etcd", GROUP_SIZE: timing.group_size,
                                        "scheduler.txn_request": timing.request})
    if not timing.answered_ns:
        txn.set_status(Status(StatusCode.ERROR, "no answer"))
    txn.end(end_time=timing.answered_ns or time.time_ns())
