"""The leader loops that make the fleet match the committed state: the reconcile cycle
(planning, acting, bookkeeping parts), drift detection, the node monitor, the disruption guard,
and the pending placer (workloads that fit nowhere, placed when capacity appears). The pure
deciders are in ``planner``.

Runs only while leading (fenced commits). May not answer RPCs: ``handlers.api`` is beside it,
and neither imports the other.
"""
