"""``persys``: the operator's command line for a persys scheduler.

It talks only gRPC (``persys.control.v1.AgentControl``) to any persys scheduler, this one or
the Go one for the RPCs it has, and imports nothing of the scheduler's own packages: what it
shows is what the API answers. Layout: ``main`` (the command tree and exit statuses),
``session`` (where to connect: flags, environment, contexts), ``client`` (one channel, status
codes translated to exit statuses), ``output`` (tables, JSON, YAML), ``specfiles`` (what
``apply`` reads) and ``commands/`` (one module per group of commands).
"""
