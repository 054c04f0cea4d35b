"""The pure reconcile deciders: what to do with each workload, node and drift, decided from data.

Why a package: everything here is a synchronous function of (records, agents' listings, node
views, now, policy) that returns data: actions, findings, plans. No I/O, no clock reads, no
asyncio (the import contract "pure deciders do no I/O" covers the whole package). The rest of
``handlers.reconcile`` is the shell that gathers these inputs and carries out the answers.

- ``inputs``: what the deciders are given (agents' listings, node views, state names);
- ``workload``: the per-workload decision (``plan_workload``, and ``steady_running``);
- ``cycle``: the plan of one cycle, node by node, and the steady-node memo;
- ``drift``: drift classification and its de-duplication window;
- ``monitor``: which nodes the node monitor loses and removes.
"""
