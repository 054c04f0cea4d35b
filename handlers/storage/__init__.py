"""Storage for workloads: the disk API (standalone volumes), disks attached to workloads, and
the bucket API (Ceph RGW buckets, credentials in Vault).

May not place workloads: attachments say which node a workload's disks pin it to, placement
decides.
"""
