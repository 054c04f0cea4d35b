"""Where a workload goes: the pure decision (``decision``) and its explanation and refusal
counts, the shell that keeps the decision's inputs from the projections (``placer``), this
replica's in-flight reservations, and the batcher that commits many placements per etcd
transaction.

The decision, explanation, refusals and reservations are pure. May not commit anything but a
placement batch; what a placement means for a workload is ``handlers.workloads``'.
"""
