"""The workload commands: ApplyWorkload (create, update, desired state, pending storage),
DeleteWorkload, RetryWorkload, relocation; the agent calls that follow a commit (dispatcher) and
the evidence that an agent let a workload go; the retry budget and re-apply guard; agent
metadata merging; the persistence class.

May not run leader loops (``handlers.reconcile`` calls these) or answer RPCs.
"""
