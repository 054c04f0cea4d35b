"""The drift loop's body: it only asks the reconcile loop for drift detection.

Why apart: drift detection (docs/compatibility.md, "Drift detection") has its own interval
(``SCHEDULER_DRIFT_DETECT_INTERVAL``) but no cycle of its own; it reuses a reconcile cycle's
prefetch, so this trigger marks drift due and runs (or joins) a cycle, within the cycle's time
bound.
"""

from __future__ import annotations

import asyncio
import logging

from handlers.reconcile.cycle import ReconcileLoop
from handlers.reconcile.shell import BODY_SHARE

log = logging.getLogger("persys.loops")


class DriftTrigger:
    """The drift loop's body: ask for drift detection on the reconcile cycle's prefetch."""

    name = "drift"

    def __init__(self, reconcile: ReconcileLoop, interval_s: float) -> None:
        self.reconcile = reconcile
        self.interval_s = interval_s

    async def __call__(self) -> None:
        try:
            async with asyncio.timeout(max(self.reconcile.time_bound_s(),
                                           BODY_SHARE * self.interval_s)):
                await self.reconcile.run_once(drift=True)
        except TimeoutError:
            log.warning("drift cycle cut short")
