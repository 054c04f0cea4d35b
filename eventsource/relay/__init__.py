"""The outbox relay: the only writer of the event stream.

Why it exists: events are committed to etcd as outbox keys in the same transaction as the state
change that caused them; this relay moves them to the Redis stream in commit order, exactly once
per stream id, and deletes what it moved. There is no "write etcd, then XADD" dual write.
See docs/architecture.md, "Events and the stream".

How: the relay holds its own election at ``layout.relay_election`` (any replica, either HA
mode). As leader it checks the stream (foreign or lost data), lists the outbox at revision R
(every page pinned), relays it sorted by ``(mod_revision, seq)``, then follows a NODELETE watch
from R+1 (re-list after compaction, resume after a dropped watch). Each batch is one pipelined
XADD with explicit ids ``"<mod_revision>-<seq>"`` followed by fenced etcd transactions that
advance the high-water mark ``layout.relay_mark`` and delete the relayed outbox keys (at most
128 operations each, the mark put in every one). The marks are committed by one marker task
while the relay goes on appending: what is appended while a mark transaction is in flight is
owed and rides in the next one. An etcd write then costs the stream no latency (at hundreds of
events per second most of commit-to-delivery time was the relay waiting for its marks), and a
burst costs a few mark transactions instead of one per batch.

Invariants:

* Order: the stream receives outbox records in ``(revision, seq)`` order; a record is deleted
  from the outbox only in a fenced transaction that also moves the mark past it, after its XADD
  succeeded. A crash anywhere leaves the record in the outbox, and the re-append is idempotent
  (``RedisEventLog.append_batch``'s "equal or smaller" rule), so nothing is lost or duplicated.
  With marking pipelined, at most two batches are appended but not yet marked (past one batch
  the relay waits for the marker), which keeps them within the range ``take_over`` reads back to
  find gaps already written.
* ``prev`` of every entry is the id of the entry before it in the stream.
* Gaps are explicit: Redis losing entries (stream top below the mark) and outbox overflow
  (``outbox_max`` exceeded while Redis is down; the oldest whole revisions are deleted and
  counted in ``events_dropped``) each produce ONE ``EventsGap`` entry before the next real
  event. Pending gaps live in the mark's JSON, so they survive a relay crash or failover.
  Details: ``from`` and ``to`` are the first and last stream ids that may be missing
  (inclusive), ``dropped`` the exact count when known (overflow).
* Gap ids (the scheme): a gap is written only at a revision boundary, i.e. when the next record
  to relay has a revision greater than that of the position P = max(stream top, mark), or when
  every record up to a revision >= P's has been relayed. It takes the id ``<P.rev>-<P.seq+1>``.
  This id is above everything in the stream, and no real event can ever take it: the feed is
  ordered, so at a boundary no record of revision P.rev is still to come, and real events of
  later revisions sort above it. Several gaps in a row take consecutive seqs. P includes the
  mark because records at or below it are gone from the outbox. A gap's ``eventId`` is stable
  (stored with the owed gap, or derived from the lost range), so re-appending it after a crash
  is recognised like any other entry.
* Foreign streams (top entry without ``eventId``, a key that is not a stream, or a top whose
  revision is ahead of etcd) are renamed aside with a warning and ``foreign_streams``, never
  appended to. An id conflict at append time is treated the same way.
* The relay stops relaying as soon as its lease is lost (the leadership work is cancelled and
  awaited), checks its renew deadline before every XADD (which etcd cannot fence), fences every
  etcd write with its election key, and re-campaigns with a new lease.
* Only the relay trims: MAXLEN ~ ``max_entries`` on XADD, and ``trim_by_age`` every
  ``trim_interval`` seconds while leading.

Modules, by job: ``outbox`` (outbox records), ``marks`` (the mark and the gaps owed), ``plan``
(one batch planned: pure), ``view`` (the leader's view of stream and mark), ``takeover`` (the
checks on taking over), ``pump`` (outbox to stream), ``marker`` (the fenced mark transactions),
``pruning`` (overflow and undecodable keys), ``retention`` (trim by age), ``lifecycle`` (the
:class:`~eventsource.relay.lifecycle.Relay`: election, start and stop).
"""
