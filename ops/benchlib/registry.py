"""The scenarios ``persys-scheduler bench`` knows, by name.

To add one (``failover``, ``events``): write ``ops/benchlib/<name>.py`` exposing ``SCENARIO``
(an ``ops.benchlib.scenario.Scenario`` with BENCH.md's figure keys) and list it below. Options
it needs that ``ops/bench.py`` does not have yet go there (``--kills``, ``--lease-ttl``,
``--watchers`` and ``--rate`` already exist).
"""

from __future__ import annotations

from ops.benchlib import churn, events, failover, place, reconcile
from ops.benchlib.scenario import Scenario

SCENARIOS: dict[str, Scenario] = {
    s.name: s for s in (place.SCENARIO, reconcile.SCENARIO, churn.SCENARIO, events.SCENARIO,
                        failover.SCENARIO)
}
