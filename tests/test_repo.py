"""Tests about the repository itself: rules that keep the code base honest."""

from __future__ import annotations

import re
from pathlib import Path

from eventsource.events import CATALOGUE

ROOT = Path(__file__).resolve().parent.parent


def test_every_event_type_is_documented():
    table = (ROOT / "docs" / "events.md").read_text()
    documented = set(re.findall(r"^\| (\w+) \|", table, flags=re.M)) - {"type"}
    assert documented == set(CATALOGUE)


def test_no_sleeps_in_tests():
    pattern = re.compile(r"time\.sleep\(|asyncio\.sleep\([0-9.]*[1-9]")
    offenders = []
    for path in (ROOT / "tests").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and "# allowed:" not in line:
                offenders.append(f"{path.relative_to(ROOT)}:{n}")
    assert not offenders, offenders


def test_etcd3gw_watch_helpers_are_not_used():
    offenders = []
    for pkg in ("eventsource", "projections", "handlers", "ops"):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            if re.search(r"\.watch(_prefix|_once|_prefix_once)?\(", text) or "etcd3gw.watch" in \
                    text:
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_pure_deciders_do_not_do_io():
    pure = [ROOT / "handlers" / "placement" / "decision.py",
            ROOT / "handlers" / "cluster" / "modes.py",
            ROOT / "handlers" / "workloads" / "retry.py",
            *sorted((ROOT / "handlers" / "reconcile" / "planner").glob("*.py"))]
    banned = re.compile(r"^\s*(import|from)\s+(asyncio|etcd3gw|redis|grpc|time|random)\b",
                        re.M)
    for path in pure:
        assert not banned.search(path.read_text()), path.name


def test_layers_import_one_way():
    rules = {"eventsource": ("projections", "handlers", "ops", "proto", "grpc"),
             "projections": ("handlers", "ops", "proto", "grpc"),
             "handlers": ("ops",)}
    offenders = []
    for pkg, banned in rules.items():
        for path in (ROOT / pkg).rglob("*.py"):
            for line in path.read_text().splitlines():
                m = re.match(r"\s*(?:from|import)\s+([\w.]+)", line)
                if m and m.group(1).split(".")[0] in banned:
                    offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not offenders, offenders
