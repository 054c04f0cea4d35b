"""The Redis stream log of events: append, range, trim, and one shared tail per process.

Why it exists: ``scheduler:events`` is the durable, ordered log that ListEvents and WatchEvents
serve (docs/architecture.md, "Events and the stream"). Two pitfalls shape it: redis-py's default
retries would resend an XADD that may already have been applied, and one ``XREAD BLOCK`` per
subscriber would starve the shared pool. So appends use explicit ids on a writer client without
retries, and there is one blocking reader per process that fans entries out to bounded queues.
Both rules are in docs/architecture.md, "Client rules".

Invariants:

* Every entry we write has the explicit id ``"<revision>-<seq>"`` and one field ``data`` whose
  JSON carries ``eventId``. An XADD rejected as "equal or smaller than the target stream top
  item" counts as done only if ``XRANGE id id`` holds an entry with the same ``eventId``;
  anything else raises :class:`StreamIdConflict`. Appends are therefore idempotent and are
  retried only by the caller, never blindly by the client.
* Retention is MAXLEN ~ on XADD plus :meth:`RedisEventLog.trim_by_age` (``XTRIM MINID``). The
  key never gets an EXPIRE, and trimming never removes the newest entry, so "top below the
  relay's mark" always means that Redis lost data.
* Redis failures surface as :class:`RedisUnavailable` (a subclass of ``errors.Unavailable``);
  other stream trouble as :class:`StreamError` subclasses. Every call is bounded by
  ``op_timeout`` on top of the client's socket timeouts.
* :class:`StreamTailer` owns its task and its client's blocking connection; a
  :class:`Subscription` receives exactly the entries with ids strictly greater than its
  ``start_id`` (and its ``after_id``), in stream order, or an error that ends it. Its queue is
  bounded: a subscriber that falls ``queue_max`` entries behind is closed with ``overflowed``.

Modules: ``entries`` (stream ids and raw entries, pure), ``errors`` (the stream's failures),
``clients`` (how the Redis clients are configured), ``eventlog`` (``RedisEventLog``: append, read,
trim, move aside), ``tailer`` (``StreamTailer`` and its subscriptions), ``sentinel`` (following
the master Sentinel names: the watch, the pools, the relay's pin), ``replicas`` (how many
replicas an append waits for: ``WAIT``).
"""
