"""Calls to a running etcd's JSON gateway: its revision, compaction, the member list.

Apart from the process launcher because tests, the benchmark and ``EtcdProcess``'s own
"is this our member" check call these on any etcd URL, started here or not.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any


class EtcdError(RuntimeError):
    """The etcd JSON gateway answered a helper call with an error."""


def etcd_post(url: str, path: str, body: dict[str, Any], *, timeout: float,
              context: ssl.SSLContext | None = None) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url`` + ``path``; the decoded reply, or :class:`EtcdError`."""
    request = urllib.request.Request(
        f"{url.rstrip('/')}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:
            payload = resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", errors="replace")
        raise EtcdError(f"POST {path} -> HTTP {exc.code}: {detail}") from exc
    decoded = json.loads(payload or b"{}")
    if not isinstance(decoded, dict):
        raise EtcdError(f"POST {path}: unexpected reply {decoded!r}")
    if "error" in decoded and "header" not in decoded:
        raise EtcdError(f"POST {path}: {decoded}")
    return decoded


def etcd_revision(url: str, *, timeout: float = 5.0) -> int:
    """The store's current revision (``header.revision`` of ``/v3/maintenance/status``)."""
    reply = etcd_post(url, "/v3/maintenance/status", {}, timeout=timeout)
    return int(reply["header"]["revision"])


def etcd_compact(url: str, revision: int, *, timeout: float = 10.0) -> None:
    """Compact the key-value history up to ``revision`` and wait for it to be applied (physical).

    Raises:
        EtcdError: e.g. the revision is already compacted or is in the future.
    """
    etcd_post(
        url,
        "/v3/kv/compaction",
        {"revision": str(int(revision)), "physical": True},
        timeout=timeout,
    )
