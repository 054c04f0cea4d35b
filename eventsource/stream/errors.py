"""The stream's failures, as the layers above catch them.

Why apart: the log, the tailer and their callers (the relay, ListEvents/WatchEvents) all raise
or catch these; ``RedisUnavailable`` is an ``errors.Unavailable``, the rest are store errors
that say the stream is not in the state our ids assume, or that a subscription has ended.
"""

from __future__ import annotations

from eventsource.errors import StoreError, Unavailable


class RedisUnavailable(Unavailable):
    """Redis could not be reached or did not answer in time."""


class StreamError(StoreError):
    """The stream is not in the state our ids assume."""


class StreamIdConflict(StreamError):
    """An id we append is taken (or was passed) by an entry that is not the same event."""


class StreamWrongType(StreamError):
    """The stream key holds something that is not a stream."""


class StreamReset(StreamError):
    """The stream was replaced (moved aside or recreated) under a tailer's cursor."""


class SubscriptionClosed(StoreError):
    """The subscription was closed by its owner or by the tailer's shutdown."""


class SubscriptionOverflow(StoreError):
    """The subscriber fell too far behind and was dropped (answer RESOURCE_EXHAUSTED)."""


class ReplicasBehind(RedisUnavailable):
    """Fewer replicas than required acknowledged an append in time (``WAIT``): the entries are
    on the master but may not survive its failover, so the relay keeps them in the outbox."""


class NothingSent(RedisUnavailable):
    """An append failed before any of it reached Redis (no connection could be made, or a
    pinned client refused a new master): a later attempt is the first, not a repeat."""
