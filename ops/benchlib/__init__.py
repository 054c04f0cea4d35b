"""Building blocks of ``persys-scheduler bench`` (see ``ops/bench.py`` and docs/benchmark.md).

Each module does one job: parse Prometheus text (``promtext``), compute quantiles
(``quantiles``), fetch over plain HTTP (``httpget``), account processes (``procs``), count etcd
writes from a watch (``etcdwatch``), build and send API requests (``workloads``, ``clients``),
start and stop the system under test (``stack``), and one module per scenario.
"""
