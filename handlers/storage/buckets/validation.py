"""Bucket names and request inputs: the checks every command makes before any call, and the
name of a bucket's RGW user, which is derived from the bucket's.

Pure (no I/O, no clients): a bad input is refused with INVALID_ARGUMENT naming the request
field before RGW or Vault is asked anything, and the rules can be read (and tested) alone.
"""

from __future__ import annotations

import re

from handlers.storage.buckets.model import BucketError

_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
USER_PREFIX = "persys-bkt-"
DEFAULT_MAX_KEYS = 100
MAX_KEYS_CAP = 1000


def bucket_name(raw: str, field: str) -> str:
    """The canonical bucket name (trimmed, lower-cased) or INVALID_ARGUMENT naming ``field``."""
    name = raw.strip().lower()
    if not name:
        raise BucketError("INVALID_ARGUMENT", f"{field}: required")
    if not _NAME.match(name):
        raise BucketError(
            "INVALID_ARGUMENT",
            f"{field}: {raw.strip()[:80]!r} is not a bucket name (3-63 characters: lower-case "
            "letters, digits, '.' and '-', starting and ending with a letter or digit)")
    if ".." in name or re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name):
        raise BucketError("INVALID_ARGUMENT",
                          f"{field}: {name!r} has '..' or looks like an IP address")
    return name


def user_for(bucket: str) -> str:
    """The RGW user that owns a bucket's credentials."""
    return f"{USER_PREFIX}{bucket}"


def check_region(requested: str, served: str) -> None:
    """INVALID_ARGUMENT unless ``requested`` is empty or the region this RGW ``served``."""
    wanted = requested.strip()
    if wanted and wanted != served:
        raise BucketError(
            "INVALID_ARGUMENT",
            f"region: this RGW serves region {served!r}, not {wanted!r}")


def page_size(max_keys: int) -> int:
    """How many keys a ListBucketObjects page asks for (0: the default; capped)."""
    if max_keys < 0:
        raise BucketError("INVALID_ARGUMENT", "max_keys: must not be negative")
    return min(max_keys or DEFAULT_MAX_KEYS, MAX_KEYS_CAP)
