"""The checks every API input shares: ids, labels and taints, and the error that names the
offending field (``InvalidSpec``).

Pure, and apart from the ApplyWorkload parsing because node registration, the node controls
and the servicer check ids and labels too, and the disk attachments refuse with the same
error. The servicer turns an ``InvalidSpec`` into the in-band ``INVALID_SPEC`` answer Go
clients read.
"""

from __future__ import annotations

import re

_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$")


class InvalidSpec(ValueError):
    """Bad input: ``field`` names the offending field, the message says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def validate_id(field: str, value: str) -> str:
    text = value.strip()
    if not text:
        raise InvalidSpec(field, "required")
    if not _ID_PATTERN.match(text):
        raise InvalidSpec(
            field, "must be 1-253 characters of letters, digits, '.', '_', ':' or '-'"
        )
    return text


#: Bounds on node labels and taints. Why: they live in the node record, which every node write
#: rewrites and every replica watches, and they are copied into events; Kubernetes bounds a
#: label key to 253 characters (with its prefix) and we allow longer values than its 63.
LABEL_KEY_MAX = 253
LABEL_VALUE_MAX = 1024
LABELS_MAX = 256


def check_label(field: str, key: str, value: str) -> None:
    """Refuse a label or taint whose key or value is too long (``field`` names it)."""
    if len(key) > LABEL_KEY_MAX:
        raise InvalidSpec(f"{field}.key", f"longer than {LABEL_KEY_MAX} characters")
    if len(value) > LABEL_VALUE_MAX:
        raise InvalidSpec(f"{field}.value", f"longer than {LABEL_VALUE_MAX} characters")


def check_labels(field: str, labels: dict[str, str]) -> None:
    if len(labels) > LABELS_MAX:
        raise InvalidSpec(field, f"more than {LABELS_MAX} labels")
    for key, value in labels.items():
        check_label(f"{field}[{key[:LABEL_KEY_MAX]}]", key, value)
