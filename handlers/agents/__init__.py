"""The scheduler's client of the compute agents: one pooled gRPC channel per node, deadlines
and leader checks on every call, and the Go names of status codes its metrics use.

Owns: ``pool`` (channels, calls, TLS files), ``codes``. May not touch: etcd, the projections or
any command; callers decide what an answer means.
"""
