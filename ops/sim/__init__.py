"""A simulated compute-agent fleet: thousands of fake nodes in one process.

Why this exists: the scheduler must be exercised (tests, ``persys-scheduler sim``, the
benchmark in ``docs/benchmark.md``) against fleets of 1,000-5,000 agents without running real
ones. Each simulated node behaves towards the scheduler like a Go compute-agent: it registers over
``persys.control.v1.AgentControl``, heartbeats with its usage and one status per local workload,
re-registers after a rejection or a failed heartbeat, and serves ``persys.agent.v1.AgentService``
on its own port with the agent's asynchronous apply (answer PENDING with a ``task_id`` at once,
RUNNING / FAILED / STOPPED after ``apply_latency_s``). The simulator is also the benchmark's
witness: it counts agent RPCs, refused wrong-node calls, applies carrying a stale leader term and
nodes holding more than their capacity.

The modules, by job:

* ``config``: what a node is told to be (:class:`~ops.sim.config.NodeBehaviour`: capacity,
  timings, failure injection) and its certificates (:class:`~ops.sim.config.SimTls`).
* ``runtime``: the node behaviour model, what a simulated agent's runtime does with an apply or
  a delete (the asynchronous apply state machine on the fleet's timer, capacity in use).
* ``node``: one simulated agent as the scheduler sees it: its ``AgentService`` methods, its
  server's lifecycle (crash, restart) and what it reports in RegisterNode and Heartbeat.
* ``control``: the registration/heartbeat client loop of every node of a fleet.
* ``fleet``: many nodes in one process: building, starting and stopping them, and their stats.
* ``clock``: the fleet's single timer; ``counters``: the fleet-wide witness counters.
* ``stats``: ``GET /stats`` over plain asyncio; ``cli``: ``persys-scheduler sim``.

Invariants:

* One ``grpc.aio`` server per simulated node, on 127.0.0.1 and a port the kernel picked (bind to
  port 0). A node keeps its port across ``crash()`` / ``restart()``; ``grpc.so_reuseport`` is off
  so two servers can never silently share a port.
* A node refuses an agent call only when ``x-persys-node-id`` is present and names another node
  (``PERMISSION_DENIED`` "wrong node", counted as ``wrong_node_refused``). Calls without the
  metadata are served: Go schedulers send none.
* ``double_applies`` follows docs/benchmark.md: an ApplyWorkload whose
  ``x-persys-leader-term`` is lower than the highest term any node of this fleet has already
  seen. The same check per node is reported as ``double_applies_node_scope``: with
  active-active shards every shard has its own leader key (its own create revision), so only
  the per-node figure is meaningful there.
* Time is driven by ONE heap of due times and ONE dispatcher task per fleet
  (:class:`~ops.sim.clock.DueHeap`): apply completions, registration retries and heartbeats.
  Control RPCs run on a fixed pool of worker tasks (``concurrency``, by default one per node: a
  real agent's heartbeat never waits for another agent's, so a smaller pool would stretch every
  heartbeat interval whenever the scheduler answers slowly; an idle worker costs about 1.2 KB).
  There is no task per workload. Cancellation is lazy: a timer entry carries the generation it
  was made for and is ignored when the node (crash, restart) or workload (re-apply, delete)
  moved on.
* Each node has at most one control action (register or heartbeat) scheduled, queued or in
  flight, so the work queue never holds more than one entry per node.
* A node's capacity use is what its PENDING and RUNNING workloads request in the agent spec:
  container ``resources.cpu_shares`` (millicores) and ``resources.memory_bytes``; vm
  ``vcpus * 1000`` and ``memory_mb``; compose requests nothing.
* Every task belongs to a :class:`~ops.sim.fleet.Fleet` (or
  :class:`~ops.sim.stats.StatsServer`); ``stop()`` cancels and awaits them, stops every server
  and closes the scheduler channels.

Deliberate deviations from the Go agent, for a simulator: re-applying the revision a workload
already runs answers ``applied=True, skipped=True`` at once (the asynchronous Go agent queues a
task that skips later); DeleteWorkload removes the workload at once (Go answers "submitted" and
deletes later); ListWorkloads includes workloads whose apply is still PENDING (Go lists persisted
statuses only); GetWorkloadStatus of an unknown workload fails with ``NOT_FOUND`` "workload <id>
not found" (Go returns a plain error; the scheduler matches the text); a RUNNING or STOPPED
status carries no message (the Go scheduler appends every non-empty heartbeat message to the
workload's logs).

Measured cost (2-core machine, CPython 3.11.7, grpcio 1.85.1; a fake AgentControl and a
scheduler-like client, one channel per node, each in its own process):

* 1,000 nodes: servers up in 0.8 s, all registered after 1.4 s; +43 MiB RSS when idle, i.e.
  about 44 KiB per node, and one descriptor per node (its listening socket). With the client
  connected to every node and 20,000 workloads applied: +79 MiB and 2,009 descriptors.
* 5,000 nodes: servers up in 4.1 s, all registered after 8.7 s; +194 MiB when idle (about
  40 KiB per node). With the client connected to every node and 20,000 workloads: +320 MiB and
  10,009 descriptors, half of this machine's open-file limit (20,000). So 5,000 separate servers
  fit in one process and no multi-process mode is offered.
* A heartbeat costs about 0.7 ms of simulator CPU: 5,000 nodes every 10 s (500/s) keep 35% of a
  core busy; at the Go scheduler's 60 s interval, about 6%.
"""
