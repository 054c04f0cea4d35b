"""Domain errors raised by the storage layer.

One translation point (``eventsource.etcd``) turns transport failures into these, so the layers
above never see ``requests`` or ``etcd3gw`` exceptions and can map each case to a caller-facing
answer (in-band field or gRPC status) in exactly one place.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error raised by the storage layer."""


class Conflict(StoreError):
    """A compare-and-swap transaction lost: a key changed since it was read.

    ``revision`` is the store revision the failed transaction saw: a projection that has reached
    it reflects the write that won, so the loser can re-decide on fresh state.
    """

    def __init__(self, message: str = "conflict", *, revision: int = 0) -> None:
        super().__init__(message)
        self.revision = revision


class Unavailable(StoreError):
    """etcd (or Redis) could not be reached or answered with a server error."""


class OutcomeUnknown(Unavailable):
    """A write reached an etcd endpoint, and no answer says whether it was applied (a timeout,
    a 503 "request timed out" or "leader changed"). It is not sent to another endpoint: it
    might be applied twice."""


class Compacted(StoreError):
    """A watch or a read at a revision that etcd has already compacted away."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted (compact_revision={compact_revision})")
        self.compact_revision = compact_revision


class WatchCanceled(StoreError):
    """The server canceled a watch for a reason other than compaction."""


class LeaseLost(StoreError):
    """A lease expired or was revoked: whatever it protected is gone."""


class NotLeader(StoreError):
    """A leader-only write was attempted without (or after losing) leadership."""
