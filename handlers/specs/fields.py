"""The checks every API input shares: ids, labels and taints, and the error that names the
offending field (``InvalidSpec``).

Pure, and apart from the ApplyWorkload parsing because node registration, the node controls
and the servicer check ids and labels too, and the disk attachments refuse with the same
error. The servicer turns an ``InvalidSpec`` into the in-band ``INVALID_SPEC`` answer Go
clients read.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata

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
    """Refuse a label or taint whose key is empty or whose key or value is too long
    (``field`` names it)."""
    if not key.strip():
        raise InvalidSpec(f"{field}.key", "required (an empty key)")
    if len(key) > LABEL_KEY_MAX:
        raise InvalidSpec(f"{field}.key", f"longer than {LABEL_KEY_MAX} characters")
    if len(value) > LABEL_VALUE_MAX:
        raise InvalidSpec(f"{field}.value", f"longer than {LABEL_VALUE_MAX} characters")
    if _has_control(key):
        raise InvalidSpec(f"{field}.key", "contains a control or format character")


def check_labels(field: str, labels: dict[str, str]) -> None:
    if len(labels) > LABELS_MAX:
        raise InvalidSpec(field, f"more than {LABELS_MAX} labels")
    for key, value in labels.items():
        check_label(f"{field}[{key[:LABEL_KEY_MAX]}]", key, value)


#: Bounds on the free text an operator gives (a drain's reason): it is stored in the node record
#: and copied into its events, which every replica and watcher reads.
REASON_MAX = 1024


def _has_control(text: str) -> bool:
    """Whether ``text`` holds a control or format character (NUL, newline, the bidirectional
    overrides, zero-width characters): none belongs in a name, a path or a host."""
    return any(unicodedata.category(c) in ("Cc", "Cf") for c in text)


def check_text(field: str, value: str, max_chars: int = REASON_MAX) -> str:
    """Free text of at most ``max_chars`` characters, without NUL."""
    if len(value) > max_chars:
        raise InvalidSpec(field, f"longer than {max_chars} characters")
    if "\x00" in value:
        raise InvalidSpec(field, "contains a NUL character")
    return value


#: a DNS label (letters, digits, '-', and '_' as some hosts carry), as RFC 1123 allows
_HOST_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
HOST_MAX_CHARS = 253


def validate_host(field: str, host: str) -> str:
    """A host name or an IP address (IPv6 in brackets or not); the text is published in DNS
    records and dialed, so nothing else passes: no control characters, no empty label."""
    if not host:
        raise InvalidSpec(field, "the host is required")
    if _has_control(host):
        raise InvalidSpec(field, "the host contains a control or format character")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
        return host
    except ValueError:
        if bare is not host:
            raise InvalidSpec(field, f"{host!r} is not an IPv6 address") from None
    name = host[:-1] if host.endswith(".") else host
    if len(name) > HOST_MAX_CHARS:
        raise InvalidSpec(field, f"the host is longer than {HOST_MAX_CHARS} characters")
    if not all(_HOST_LABEL.match(label) for label in name.split(".")):
        raise InvalidSpec(field, f"{host!r} is not a host name (labels of letters, digits "
                                 "and '-', separated by single dots) or an IP address")
    return host


#: a disk's mount path: at most 4,096 characters (Linux's PATH_MAX)
PATH_MAX_CHARS = 4096


def check_mount_path(field: str, path: str) -> str:
    """An absolute path without ``..`` segments or control characters ("" passes: the
    default applies)."""
    if not path:
        return path
    if len(path) > PATH_MAX_CHARS:
        raise InvalidSpec(field, f"longer than {PATH_MAX_CHARS} characters")
    if _has_control(path):
        raise InvalidSpec(field, "contains a control or format character")
    if not path.startswith("/"):
        raise InvalidSpec(field, "must be an absolute path")
    if ".." in path.split("/"):
        raise InvalidSpec(field, "must not contain '..' segments")
    return path
