"""A workload status's metadata: its bound, and what of an agent's report is merged into it.

Why: the agent reports metadata with every workload status (``ListWorkloads``, the status in
``ApplyWorkloadResponse``) and the Go scheduler merges it into the workload (persys-facts E4):
``vm.primary_ip`` is what a VM's status shows (``"Running (ip=...)"``), ``container.stderr`` and
``container.runtime_error`` are what its failure text shows, and ``failure_reason`` (e.g.
``INVALID_IMAGE``) is what stops re-applies for good (``reconcile.halted``).

Invariants (pure functions; the callers write with CAS):

* Bounded: at most ``AGENT_KEYS_MAX`` keys of one report are taken (the first in key order),
  keys longer than ``KEY_CHARS`` are dropped, values are cut to ``VALUE_CHARS``, and a key is
  added to a status only while it holds fewer than ``METADATA_MAX_KEYS``.
* The scheduler's own keys are never taken from an agent: the re-apply guard, the retry
  budget, the terminal marks it sets itself, ``last_action`` and the placement and storage
  inputs (``persys.*``, ``disk_ids``, ``allow_move``). An agent that echoes the request's
  metadata back must not move them (nor store ``persys.vm.password``).
* ``task_id`` and ``task_status`` are not stored: they name one apply task, change with every
  apply, and no later report updates them (the Go agent's ``ListWorkloads`` leaves tasks out),
  so storing them would cost a write per apply and show "pending" for ever. They are logged.
* A merge adds and overwrites; it never removes a key the agent stopped reporting (as Go),
  except ``failure_reason``, which follows the agent's reports: set by a report that says
  Failed, removed by one that does not. Go kept it, so a workload halted by it stayed halted
  (and shown Failed) after its agent ran it again, e.g. when the halt came from a report
  older than a RetryWorkload's apply.
* Writes only on news: ``metadata_news`` is empty when every reported key is stored with that
  value, which is the steady state, so a reconcile cycle writes nothing for it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from types import MappingProxyType
from typing import Any

from handlers.retry import GRACE_KEYS, REAPPLY_KEYS

#: metadata keys a workload's status may carry (updates merge theirs into it)
METADATA_MAX_KEYS = 512
#: keys taken from one agent report
AGENT_KEYS_MAX = 32
KEY_CHARS = 128
VALUE_CHARS = 1024
#: the agent key that halts re-applies (``reconcile.halted``): taken only from a report that
#: says Failed (a leftover on a running workload must not mark it Failed), and removed by a
#: report that does not
FAILURE_REASON = "failure_reason"
#: keys describing one apply task: logged, not stored
TASK_KEYS = frozenset({"task_id", "task_status"})
#: keys the scheduler writes and decides from; an agent's value for them is ignored
SCHEDULER_KEYS = frozenset({
    *REAPPLY_KEYS, *GRACE_KEYS, "last_action", "scheduler_last_error", "retry_terminal",
    "retry_terminal_reason", "terminal_failure_reason", "previous_node", "assignment_reason",
    "created_at", "drift_reason", "drift_reconciled_at", "managed_storage_state", "disk_ids",
    "allow_move",
})
#: key prefixes the scheduler owns (placement and storage inputs, the VM request's copies)
SCHEDULER_PREFIXES = ("persys.",)
NO_METADATA: Mapping[str, str] = MappingProxyType({})


def _taken(key: str) -> bool:
    return (bool(key) and len(key) <= KEY_CHARS and key not in TASK_KEYS
            and key not in SCHEDULER_KEYS and not key.lower().startswith(SCHEDULER_PREFIXES))


def agent_metadata(raw: Mapping[str, str]) -> Mapping[str, str]:
    """The part of an agent's status metadata that may be merged into a status (bounded)."""
    kept: dict[str, str] = {}
    for key in sorted(raw) if len(raw) > AGENT_KEYS_MAX else raw:
        if _taken(key):
            kept[key] = str(raw[key])[:VALUE_CHARS]
            if len(kept) >= AGENT_KEYS_MAX:
                break
    return kept or NO_METADATA


def metadata_news(reported: Mapping[str, str], stored: Mapping[str, Any], *,
                  failed: bool) -> dict[str, str | None]:
    """What a merge of a report (from ``agent_metadata``) would change in ``stored``: the
    reported keys with another value, and ``failure_reason: None`` (remove it) when the report
    does not say Failed (``failed``) and the status holds one.

    A key the status has no room for is no news (or it would be news every cycle).
    """
    room = len(stored) < METADATA_MAX_KEYS
    news: dict[str, str | None] = {
        key: value for key, value in reported.items()
        if stored.get(key) != value and (room or key in stored)
        and (failed or key != FAILURE_REASON)}
    if not failed and FAILURE_REASON in stored:
        news[FAILURE_REASON] = None
    return news


def merge_metadata(metadata: MutableMapping[str, Any], news: Mapping[str, str | None]) -> bool:
    """Merge ``news`` into a (copied) status's metadata within its bound (None: remove the
    key); True if it changed."""
    changed = False
    for key, value in news.items():
        if value is None:
            if key in metadata:
                del metadata[key]
                changed = True
            continue
        if metadata.get(key) == value:
            continue
        if key not in metadata and len(metadata) >= METADATA_MAX_KEYS:
            continue
        metadata[key] = value
        changed = True
    return changed
