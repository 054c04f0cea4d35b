"""The gRPC and HTTP faces of the scheduler: the ``AgentControl`` servicer (one method per RPC:
validate, call one handler, answer), record <-> protobuf conversion (and a stored spec back to
its request), ListEvents/WatchEvents, ExplainPlacement, the certificate interceptor, the gRPC
metrics interceptor, and the plaintext ``/metrics`` and ``/health`` endpoint.

Owns the wire: nothing below it knows a protobuf view. May not decide: every decision is a
command's or a pure decider's below; it never writes etcd itself.
"""
