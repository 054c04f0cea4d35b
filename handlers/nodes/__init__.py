"""The node commands: RegisterNode, Heartbeat, drain/undrain, taints and labels; the liveness
leases they renew; the translation of agents' reports; usage telemetry and heartbeat times in
Redis (never in etcd).

May not place or move workloads itself: a drain asks ``handlers.workloads``' relocator.
"""
