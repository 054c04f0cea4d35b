"""``persys-scheduler replay``: rebuild the projections and event views, and check them.

Replay means: the state projections rebuilt from etcd at one revision (every prefix listed at
that revision, no watch), and the event view rebuilt from the Redis stream alone. The command
prints what it rebuilt and checks the invariants that must hold at any revision:

* every node's allocation equals the sum of the requests of the workloads assigned to it;
* no allocation exceeds its node's capacity;
* every assigned workload has a spec and appears in its node's allocation.

A test shows a rebuilt projection equals the live one at the same revision.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from eventsource.errors import StoreError
from eventsource.etcd import AsyncEtcd
from eventsource.keys import KeyLayout
from eventsource.metrics import Metrics
from eventsource.stream.clients import redis_url, writer_client
from eventsource.stream.errors import StreamError
from eventsource.stream.eventlog import RedisEventLog
from handlers.settings.config import etcd_tls_from_env
from handlers.settings.reader import ConfigError
from projections.cluster import ClusterProjection
from projections.event_views import EventView


async def rebuild_cluster(etcd: AsyncEtcd, layout: KeyLayout, revision: int = 0
                          ) -> ClusterProjection:
    """A ClusterProjection loaded from etcd at ``revision`` (0 = now), all prefixes pinned."""
    if not revision:
        revision = await etcd.current_revision()
    cluster = ClusterProjection(etcd, layout, Metrics())
    for projection in cluster.projections:
        kvs, _ = await etcd.list_prefix(projection.prefix, revision=revision)
        projection.load(kvs, revision)
    return cluster


async def rebuild_events(log: RedisEventLog, *, capacity: int = 1_000_000,
                         page: int = 1000) -> EventView:
    view = EventView(capacity)
    after: str | None = None
    while True:
        entries = await log.range(after, page)
        view.extend(entries)
        if len(entries) < page:
            return view
        after = entries[-1].stream_id


def cluster_snapshot(cluster: ClusterProjection) -> dict[str, Any]:
    """A comparable picture of a projection: every item's id and mod revision per prefix."""
    return {p.name: sorted((k, v.mod_revision) for k, v in p.items.items())
            for p in cluster.projections}


def check_invariants(cluster: ClusterProjection) -> list[str]:
    from handlers.specs.stored import request_of

    problems: list[str] = []
    expected: dict[str, dict[str, tuple[int, int]]] = {}
    for wid, status in cluster.statuses.items.items():
        node = status.value.node_id
        spec = cluster.specs.get(wid)
        if not node:
            continue
        if spec is None:
            problems.append(f"workload {wid}: status without spec")
            continue
        expected.setdefault(node, {})[wid] = request_of(spec.value)
    for node_id, alloc in cluster.allocations.items.items():
        want = expected.get(node_id, {})
        have = {k: (v[0], v[1]) for k, v in alloc.value.workloads.items()}
        if have != want:
            missing = sorted(set(want) - set(have))
            extra = sorted(set(have) - set(want))
            problems.append(f"allocation {node_id}: missing {missing[:5]} extra {extra[:5]}")
        cpu = sum(v[0] for v in have.values())
        mem = sum(v[1] for v in have.values())
        if (cpu, mem) != (alloc.value.cpu_millicores, alloc.value.memory_mb):
            problems.append(f"allocation {node_id}: sums {alloc.value.cpu_millicores}m/"
                            f"{alloc.value.memory_mb}MB but entries add to {cpu}m/{mem}MB")
        node = cluster.nodes.get(node_id)
        if node is not None:
            if alloc.value.cpu_millicores > round(node.value.total_cpu * 1000):
                problems.append(f"node {node_id}: cpu overcommitted")
            if alloc.value.memory_mb > node.value.total_memory:
                problems.append(f"node {node_id}: memory overcommitted")
    for node_id in set(expected) - set(cluster.allocations.items):
        problems.append(f"node {node_id}: assigned workloads but no allocation record")
    return problems


async def replay(args: argparse.Namespace) -> int:
    """Exit 0: invariants hold; 1: violated; 2: could not check (bad input, unreachable)."""
    endpoints = [e for e in args.etcd.split(",") if e.strip()]
    if not endpoints:
        print("replay: --etcd: no endpoint given", file=sys.stderr)
        return 2
    if args.revision < 0:
        print("replay: --revision: must not be negative (0 = current)", file=sys.stderr)
        return 2
    try:
        tls = etcd_tls_from_env(os.environ)
    except ConfigError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    etcd = AsyncEtcd(endpoints, tls=tls)
    try:
        return await _replay(args, etcd)
    except (StoreError, StreamError) as exc:
        print(f"replay: could not read the state: {exc}", file=sys.stderr)
        return 2
    finally:
        etcd.close()


async def _replay(args: argparse.Namespace, etcd: AsyncEtcd) -> int:
    layout = KeyLayout(args.root)
    if args.revision:
        current = await etcd.current_revision()
        if args.revision > current:
            print(f"replay: --revision: {args.revision} is ahead of etcd's current revision "
                  f"{current}", file=sys.stderr)
            return 2
    cluster = await rebuild_cluster(etcd, layout, args.revision)
    report: dict[str, Any] = {
        "revision": cluster.nodes.revision,
        "nodes": len(cluster.nodes.items),
        "workloads": len(cluster.specs.items),
        "allocations": len(cluster.allocations.items),
        "alive": len(cluster.alive.items),
    }
    problems = check_invariants(cluster)
    report["problems"] = problems
    if args.redis:
        client = writer_client(redis_url(args.redis, os.environ.get("REDIS_PASSWORD", ""),
                                         args.redis_db))
        try:
            view = await rebuild_events(RedisEventLog(client, args.stream))
        finally:
            await client.aclose()
        types: dict[str, int] = {}
        for entry in view.entries:
            types[entry.type] = types.get(entry.type, 0) + 1
        report["events"] = len(view.entries)
        report["event_types"] = types
    print(json.dumps(report, indent=2))
    return 1 if problems else 0


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--etcd", default=os.environ.get("ETCD_ENDPOINTS", "localhost:2379"))
    parser.add_argument("--root", default=os.environ.get("SCHEDULER_ETCD_ROOT", ""))
    parser.add_argument("--revision", type=int, default=0, help="etcd revision (0 = current)")
    parser.add_argument("--redis", default=os.environ.get("REDIS_ADDR", ""))
    # converted by argparse, and only when replay runs: a bad REDIS_DB must not break the
    # other subcommands' parsing
    parser.add_argument("--redis-db", type=int, default=os.environ.get("REDIS_DB") or "0")
    parser.add_argument("--stream", default=os.environ.get("SCHEDULER_EVENT_STREAM",
                                                           "scheduler:events"))


def cmd_replay(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(replay(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
