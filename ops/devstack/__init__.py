"""Private etcd and Redis server processes on free loopback ports.

Why this exists: tests, benchmarks and the local dev stack need real servers (never mocks), each
with its own data directory and ports so that several can run side by side and any of them can be
killed, paused or restarted without touching anything else on the machine.

The modules: ``process`` (what every server process shares: spawning in its own session,
signalling by PID, liveness, free ports, log tails), one per server it starts (``etcd``,
``redis``), and ``etcdapi`` (the etcd JSON-gateway calls made on a running etcd). The other
servers of ``ops/`` (OpenBao, RGW, CoreDNS) reuse the ``process`` helpers.

Invariants:

* Servers listen on 127.0.0.1 only.
* Every process is started in its own session (``start_new_session=True``): a Ctrl-C delivered to
  the caller's process group reaches the caller only, and the caller decides how to stop its
  servers. There is no ``atexit`` hook; whoever calls ``start()`` calls ``stop()`` (or uses the
  object as a context manager).
* Only the process recorded in the object is ever signalled, by its PID.
* ``restart()`` reuses the same ports, data directory and flags, so clients keep their address.
* Liveness never trusts ``kill -0``: a zombie counts as dead (``/proc/PID/stat`` state ``Z``).

This package imports nothing from the rest of the project but ``eventsource.etcdtls`` (the TLS
files of an etcd started with TLS).
"""
