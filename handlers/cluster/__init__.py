"""This replica's place in the cluster: leadership and the leader gate (shard elections,
fencing, the leader-only loops' scheduler), the shard topology every replica agrees on, the
operating modes and their supervisor, per-replica CoreDNS records, the server's TLS files and
its Vault PKI certificate.

May not touch workloads or nodes: other packages ask it whether they lead, own a node, or may
write.
"""
