"""A workload status's metadata: its bound, and what of an agent's report is merged into it.

Why: the agent reports metadata with every workload status (``ListWorkloads``, the status in
``ApplyWorkloadResponse``) and the Go scheduler merges it into the workload
(docs/compatibility.md, "Workload status metadata"):
``vm.primary_ip`` is what a VM's status shows (``"Running (ip=...)"``), ``container.stderr`` and
``container.runtime_error`` are what its failure text shows, and ``failure_reason`` (e.g.
``INVALID_IMAGE``) is what stops re-applies for good (``reconcile.halted``).

Invariants (pure functions; the callers write with CAS):

* Bounded: at most ``AGENT_KEYS_MAX`` keys of one report are taken (the first in key order),
  keys longer than ``KEY_CHARS`` are dropped, values are cut to ``VALUE_BYTES`` as stored
  (JSON-escaped), and a key is added to a status only while it holds fewer than
  ``METADATA_MAX_KEYS`` keys and ``METADATA_MAX_BYTES``.
* The scheduler's own keys are never taken from an agent: the re-apply guard, the retry
  budget, the terminal marks it sets itself, ``last_action`` and the placement and storage
  inputs (``persys.*``, ``disk_ids``, ``allow_move``, and any key naming a ``host_path`` or
  ``bind_mount``, which makes a workload node-local), compared without regard to case. An
  agent that echoes the request's metadata back must not move them (nor store
  ``persys.vm.password``).
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

import json
from collections.abc import Mapping, MutableMapping
from types import MappingProxyType
from typing import Any

from handlers.workloads.retry import GRACE_KEYS, REAPPLY_KEYS

#: metadata keys a workload's status may carry (updates merge theirs into it)
METADATA_MAX_KEYS = 512
#: keys taken from one agent report
AGENT_KEYS_MAX = 32
KEY_CHARS = 128
#: a value as stored (JSON-escaped) bytes
VALUE_BYTES = 1024
#: new keys are added while the metadata is below this as stored (JSON) bytes: an agent
#: reporting new keys every listing must not grow a status record toward etcd's request limit
METADATA_MAX_BYTES = 64 * 1024
#: parts of a key that make ``workloads.persistence_class`` call a workload node-local: a
#: placement input, which an agent's report must not set
PLACEMENT_KEY_PARTS = ("host_path", "bind_mount")
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
    folded = key.lower()
    return (bool(key) and len(key) <= KEY_CHARS and folded not in TASK_KEYS
            and folded not in SCHEDULER_KEYS and not folded.startswith(SCHEDULER_PREFIXES)
            and not any(part in folded for part in PLACEMENT_KEY_PARTS))


def _bounded(value: object) -> str:
    """``value`` within ``VALUE_BYTES`` as stored: records are JSON with non-ASCII escaped
    (an emoji costs 12 bytes), so the bound is on the escaped text, not on characters."""
    text = str(value)[:VALUE_BYTES]
    if text.isascii() and len(json.dumps(text)) - 2 <= VALUE_BYTES:
        return text
    kept: list[str] = []
    size = 0
    for ch in text:
        size += len(json.dumps(ch)) - 2
        if size > VALUE_BYTES:
            break
        kept.append(ch)
    return "".join(kept)


def agent_metadata(raw: Mapping[str, str]) -> Mapping[str, str]:
    """The part of an agent's status metadata that may be merged into a status (bounded)."""
    kept: dict[str, str] = {}
    for key in sorted(raw) if len(raw) > AGENT_KEYS_MAX else raw:
        if _taken(key):
            kept[key] = _bounded(raw[key])
            if len(kept) >= AGENT_KEYS_MAX:
                break
    return kept or NO_METADATA


def _stored_bytes(metadata: Mapping[str, Any]) -> int:
    return len(json.dumps(metadata, separators=(",", ":")))


def metadata_news(reported: Mapping[str, str], stored: Mapping[str, Any], *,
                  failed: bool) -> dict[str, str | None]:
    """What a merge of a report (from ``agent_metadata``) would change in ``stored``: the
    reported keys with another value, and ``failure_reason: None`` (remove it) when the report
    does not say Failed (``failed``) and the status holds one.

    A key the status has no room for is no news (or it would be news every cycle).
    """
    news: dict[str, str | None] = {}
    room: bool | None = None  # measured only for a new key: the steady state has none
    for key, value in reported.items():
        if stored.get(key) == value or (not failed and key == FAILURE_REASON):
            continue
        if key not in stored:
            if room is None:
                room = (len(stored) < METADATA_MAX_KEYS
                        and _stored_bytes(stored) < METADATA_MAX_BYTES)
            if not room:
                continue
        news[key] = value
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
        if key not in metadata and (len(metadata) >= METADATA_MAX_KEYS
                                    or _stored_bytes(metadata) >= METADATA_MAX_BYTES):
            continue
        metadata[key] = value
        changed = True
    return changed
