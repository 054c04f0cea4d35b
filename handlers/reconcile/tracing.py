"""The reconcile cycle's trace: one root span per cycle, child spans for a sample of its nodes.

Why sampled: a cycle lists every owned node, and a span (with its agent client span) per node
would be 10,000 spans every 5 s at 5,000 nodes. Each cycle traces at most
``SCHEDULER_TRACE_RECONCILE_NODES`` nodes (10 by default), taken in turn from the sorted node
ids so that every node is traced now and then: the node's ``reconcile.node`` span (its
``ListWorkloads`` client span under it) and a ``reconcile.<action>`` span for each action on
it (its commits and agent calls under that). Placements of workloads on no node are traced up
to the same number per cycle. The work of every other node runs with instrumentation
suppressed: no span, no ``traceparent`` sent, no events stamped.

The cycle's phases (``reconcile.prefetch``, ``reconcile.plan``, ``reconcile.act``,
``reconcile.remediate``) are children of the root, so where a slow cycle's time went shows at
a glance; the root carries the cycle's counts. A cycle the sampler drops traces nothing.

With traces off (``tracer`` None) every method is a no-op context manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Tracer

from eventsource import tracing
from handlers.reconcile.bookkeeping import CycleReport
from handlers.reconcile.planner.workload import Action

#: what every method answers with traces off: one shared no-op context manager
_OFF = contextlib.nullcontext()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Run the block untraced: no current span, and the gRPC instrumentation suppressed."""
    with suppress_instrumentation(), trace.use_span(INVALID_SPAN):
        yield


class CycleTracing:
    """Spans of one reconcile loop's cycles (see the module docstring)."""

    def __init__(self, tracer: Tracer | None, nodes_per_cycle: int) -> None:
        self.tracer = tracer
        self.nodes_per_cycle = nodes_per_cycle
        #: where the next cycle's sample starts in the sorted node ids
        self._rotation = 0
        self._root: Context | None = None
        #: sampled node -> the context of its node span (actions on it are its children)
        self._nodes: dict[str, Context] = {}
        self._chosen: frozenset[str] = frozenset()
        self._unassigned_left = 0

    def cycle(self, report: CycleReport) -> contextlib.AbstractContextManager[None]:
        """The root span of one cycle (always a new trace)."""
        if self.tracer is None:
            return _OFF
        return self._cycle(report)

    @contextlib.contextmanager
    def _cycle(self, report: CycleReport) -> Iterator[None]:
        assert self.tracer is not None
        with self.tracer.start_as_current_span("reconcile.cycle", context=Context(),
                                               kind=SpanKind.INTERNAL) as span:
            self._root = otel_context.get_current() if span.is_recording() else None
            try:
                yield
            finally:
                if span.is_recording():
                    self._summarise(span, report)
                self._root = None
                self._nodes = {}
                self._chosen = frozenset()

    @staticmethod
    def _summarise(span: Span, report: CycleReport) -> None:
        span.set_attribute("scheduler.nodes_listed", report.nodes_listed)
        span.set_attribute("scheduler.nodes_unreachable", len(report.unreachable))
        span.set_attribute("scheduler.drift", bool(report.drift))
        for kind, count in sorted(report.actions.items()):
            span.set_attribute(f"scheduler.actions.{kind}", count)

    def choose(self, node_ids: Iterable[str]) -> None:
        """This cycle's sample of nodes (the next ones in turn)."""
        if self._root is None:
            return
        ordered = sorted(node_ids)
        count = min(self.nodes_per_cycle, len(ordered))
        start = self._rotation % len(ordered) if ordered else 0
        chosen = (ordered + ordered)[start:start + count]
        self._rotation = start + count
        self._chosen = frozenset(chosen)
        self._unassigned_left = self.nodes_per_cycle

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A phase of the cycle, as a child of its root; the block's own work is traced only
        where it asks (``node``, ``action``)."""
        if self.tracer is None:
            return _OFF
        return self._phase(name)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        if self.tracer is None or self._root is None:
            yield
            return
        with self.tracer.start_as_current_span(f"reconcile.{name}", context=self._root,
                                               kind=SpanKind.INTERNAL):
            yield

    def node(self, node_id: str) -> contextlib.AbstractContextManager[None]:
        """A node's listing: its span when the node is in the sample, untraced otherwise."""
        if self.tracer is None:
            return _OFF
        return self._node(node_id)

    @contextlib.contextmanager
    def _node(self, node_id: str) -> Iterator[None]:
        assert self.tracer is not None
        if self._root is None or node_id not in self._chosen:
            with quiet():
                yield
            return
        with self.tracer.start_as_current_span(
                "reconcile.node", context=self._root, kind=SpanKind.INTERNAL,
                attributes={tracing.NODE_ID: node_id}):
            self._nodes[node_id] = otel_context.get_current()
            yield

    def on_node(self, node_id: str) -> contextlib.AbstractContextManager[None]:
        """More work for a node (marking it NotReady), in its span's context when it was
        sampled, untraced otherwise."""
        if self.tracer is None:
            return _OFF
        return self._on_node(node_id)

    @contextlib.contextmanager
    def _on_node(self, node_id: str) -> Iterator[None]:
        assert self.tracer is not None
        parent = self._nodes.get(node_id)
        if parent is None:
            with quiet():
                yield
            return
        token = otel_context.attach(parent)
        try:
            yield
        finally:
            otel_context.detach(token)

    def action(self, action: Action) -> contextlib.AbstractContextManager[None]:
        """One action: a child span of its node's span when the node was sampled (or of the
        root, for the first placements of workloads on no node), untraced otherwise."""
        if self.tracer is None:
            return _OFF
        return self._action(action)

    @contextlib.contextmanager
    def _action(self, action: Action) -> Iterator[None]:
        assert self.tracer is not None
        parent = self._nodes.get(action.node_id) if action.node_id else None
        if parent is None and not action.node_id and self._root is not None \
                and self._unassigned_left > 0:
            self._unassigned_left -= 1
            parent = self._root
        if parent is None:
            with quiet():
                yield
            return
        attributes: dict[str, str] = {tracing.WORKLOAD_ID: action.workload_id}
        if action.node_id:
            attributes[tracing.NODE_ID] = action.node_id
        if action.reason:
            attributes["scheduler.reason"] = action.reason[:1000]
        with self.tracer.start_as_current_span(f"reconcile.{action.kind.lower()}",
                                               context=parent, kind=SpanKind.INTERNAL,
                                               attributes=attributes):
            yield

    def untraced(self) -> contextlib.AbstractContextManager[None]:
        """A block whose work is never traced (drift remediation: unbounded per cycle)."""
        if self.tracer is None:
            return _OFF
        return self._untraced()

    @contextlib.contextmanager
    def _untraced(self) -> Iterator[None]:
        assert self.tracer is not None
        with quiet():
            yield
