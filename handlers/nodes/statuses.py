"""The node statuses the node commands set and read.

Apart because registration, heartbeats and the drain controls each move a node between them,
and an operator's drain must survive the agent's registration and heartbeats (sticky).
"""

from __future__ import annotations

READY = "Ready"
NOT_READY = "NotReady"
DRAINING = "Draining"
#: statuses an agent's registration or heartbeat does not turn back to Ready
STICKY_STATUSES = frozenset({DRAINING, "Drained"})
