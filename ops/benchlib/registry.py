"""The scenarios ``persys-scheduler bench`` knows, by name.

To add one: write ``ops/benchlib/<name>.py`` exposing ``SCENARIO`` (an
``ops.benchlib.scenario.Scenario`` with its figure keys), list it below and document it in
docs/benchmark.md. Options it needs that ``ops/bench.py`` does not have yet go there.
"""

from __future__ import annotations

from ops.benchlib import attack, churn, events, failover, pending, place, reconcile
from ops.benchlib.scenario import Scenario

SCENARIOS: dict[str, Scenario] = {
    s.name: s for s in (place.SCENARIO, reconcile.SCENARIO, churn.SCENARIO, events.SCENARIO,
                        failover.SCENARIO, pending.SCENARIO, attack.SCENARIO)
}
