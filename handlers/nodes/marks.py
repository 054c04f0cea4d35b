"""Taints and labels: the operator's marks on a node that placement reads, each change one
CAS rewrite of the node record with its event.

Apart from the drain because these only edit the record (bounded in number, as the agent's
own labels are), and placement decides with them from the next decision on.
"""

from __future__ import annotations

from typing import Any

from eventsource.clock import Clock
from eventsource.events import Event, rfc3339
from eventsource.records import Node, Taint
from handlers.specs.fields import LABELS_MAX, InvalidSpec
from handlers.writes.cas import StateWriter

#: taints a node may carry (as many as labels)
TAINTS_MAX = LABELS_MAX


class NodeMarks:
    """The taint, untaint, set-label and delete-label controls."""

    def __init__(self, *, writer: StateWriter, clock: Clock) -> None:
        self.writer = writer
        self.clock = clock

    async def _control(self, node_id: str, mutate: Any) -> Node:
        node, _ = await self.writer.update_node(node_id, mutate, kind="node-control")
        return node

    async def taint(self, node_id: str, key: str, value: str, effect: str) -> Node:
        effect = effect or "NoSchedule"
        now = self.clock.now()

        def mutate(node: Node) -> list[Event] | None:
            for t in node.taints:
                if t.key == key and t.effect == effect:
                    if t.value == value:
                        return None
                    t.value = value
                    break
            else:
                if len(node.taints) >= TAINTS_MAX:
                    raise InvalidSpec("taint", f"the node has {TAINTS_MAX} taints already")
                node.taints.append(Taint(key=key, value=value, effect=effect))
            node.status_updated_at = rfc3339(now)
            return [Event(type="NodeTainted", node_id=node_id, reason=f"taint {key}:{effect}",
                          details={"source": "operator", "key": key, "effect": effect,
                                   "value": value}, timestamp=now)]

        return await self._control(node_id, mutate)

    async def untaint(self, node_id: str, key: str, effect: str) -> Node:
        now = self.clock.now()

        def mutate(node: Node) -> list[Event] | None:
            kept = [t for t in node.taints if not (t.key == key and (not effect
                                                                     or t.effect == effect))]
            if len(kept) == len(node.taints):
                return None
            node.taints = kept
            return [Event(type="NodeUntainted", node_id=node_id, reason=f"untaint {key}",
                          details={"source": "operator", "key": key, "effect": effect},
                          timestamp=now)]

        return await self._control(node_id, mutate)

    async def set_label(self, node_id: str, key: str, value: str) -> Node:
        now = self.clock.now()

        def mutate(node: Node) -> list[Event] | None:
            if node.labels.get(key) == value:
                return None
            if key not in node.labels and len(node.labels) > LABELS_MAX:
                raise InvalidSpec("key", f"the node has {len(node.labels)} labels already "
                                         f"(at most {LABELS_MAX} of yours)")
            node.labels[key] = value
            return [Event(type="NodeLabelSet", node_id=node_id, reason=f"label {key}={value}",
                          details={"source": "operator", "key": key, "value": value},
                          timestamp=now)]

        return await self._control(node_id, mutate)

    async def delete_label(self, node_id: str, key: str) -> Node:
        now = self.clock.now()

        def mutate(node: Node) -> list[Event] | None:
            if key not in node.labels:
                return None
            del node.labels[key]
            return [Event(type="NodeLabelDeleted", node_id=node_id, reason=f"label {key} removed",
                          details={"source": "operator", "key": key}, timestamp=now)]

        return await self._control(node_id, mutate)
