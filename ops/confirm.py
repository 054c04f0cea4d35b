"""``persys-scheduler confirm-empty-state``: the operator says the empty cluster state is real.

Why: a replica enters recovery mode when etcd holds the ``initialized`` marker but no node,
workload or assignment, because that is what lost state looks like and writing into it would
make the loss permanent. When the state is empty on purpose (a cluster drained to nothing, a
deliberate wipe), the operator confirms it once, for every replica: this command deletes the
marker (compare-and-swap on the marker it read) after checking that the state is still empty.
Every replica's next mode probe then sees a new cluster and returns to normal; the marker is
written again as soon as state appears. The command never touches state keys.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from eventsource.errors import StoreError
from eventsource.etcd import AsyncEtcd, Compare, Delete
from eventsource.keys import KeyLayout
from handlers.cluster.supervisor import has_state
from handlers.settings.config import etcd_tls_from_env
from handlers.settings.reader import ConfigError


def add_confirm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--etcd", default=os.environ.get("ETCD_ENDPOINTS", "localhost:2379"),
                        help="etcd endpoints, comma-separated (default: $ETCD_ENDPOINTS)")
    parser.add_argument("--root", default=os.environ.get("SCHEDULER_ETCD_ROOT", ""),
                        help="key root (default: $SCHEDULER_ETCD_ROOT)")


async def confirm_empty_state(etcd: AsyncEtcd, layout: KeyLayout) -> tuple[int, str]:
    """(exit code, message): 0 when the marker is gone (or was never there), 1 when refused."""
    marker = await etcd.get(layout.initialized)
    if marker is None:
        return 0, "no initialized marker: replicas already treat this cluster as new"
    if await has_state(etcd, layout):
        return 1, ("refused: etcd holds nodes, workloads or assignments, so the state is not "
                   "empty and recovery mode does not apply")
    result = await etcd.txn([Compare.mod(layout.initialized, marker.mod_revision)],
                            [Delete(layout.initialized, category="mode")])
    if not result.succeeded:
        return 1, "refused: the initialized marker changed meanwhile; run the command again"
    return 0, ("confirmed: initialized marker deleted; replicas return to normal mode at their "
               "next mode probe (every few seconds)")


async def _run(args: argparse.Namespace) -> int:
    try:
        tls = etcd_tls_from_env(os.environ)
    except ConfigError as exc:
        print(f"confirm-empty-state: {exc}", file=sys.stderr)
        return 2
    endpoints = [e for e in args.etcd.split(",") if e.strip()]
    if not endpoints:
        print("confirm-empty-state: --etcd: no endpoint given", file=sys.stderr)
        return 2
    etcd = AsyncEtcd(endpoints, tls=tls)
    try:
        code, message = await confirm_empty_state(etcd, KeyLayout(args.root))
    except StoreError as exc:
        code, message = 2, f"etcd: {exc}"
    finally:
        etcd.close()
    print(message, file=sys.stdout if code == 0 else sys.stderr)
    return code


def cmd_confirm(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
