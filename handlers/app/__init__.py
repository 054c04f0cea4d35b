"""The process: the composition root (``server``: settings -> objects -> owned tasks, the start
and shutdown order), the gRPC endpoint, the Redis clients, start errors, owned tasks, logging,
the event loop choice and the loop-lag and GC probes.

Owns the lifetime of everything; nothing imports it. May not hold behaviour of its own: it
builds and wires the packages below.
"""
