"""Prometheus text exposition -> a snapshot the bench can subtract, sum and query.

Why its own parser: the bench reads only counters and histogram buckets, needs snapshots it can
subtract (a figure is always a delta over the measured window) and add (several replicas), and
must tell "the target does not export this metric" (null figure with a reason) from "exported,
still zero". A few lines of parsing do that without depending on how a client library names
families.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_TYPE = re.compile(r"^#\s*TYPE\s+(\S+)\s+(\S+)")

Labels = tuple[tuple[str, str], ...]


def _unescape(value: str) -> str:
    return value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def _value(text: str) -> float:
    lowered = text.lower()
    if lowered in ("+inf", "inf"):
        return math.inf
    if lowered == "-inf":
        return -math.inf
    return float(text)


@dataclass
class MetricsSnapshot:
    """Samples by name, then by their sorted label pairs. ``families`` holds every family name
    the target declared (``# TYPE``), so a labelled counter without children still counts as
    exported."""

    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)
    families: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        """Parse exposition text; malformed lines are skipped (a scrape is best effort)."""
        snap = cls()
        for raw in text.splitlines():
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                typed = _TYPE.match(line)
                if typed:
                    snap.families.add(typed.group(1))
                continue
            match = _LINE.match(line)
            if match is None:
                continue
            name, label_text, value_text = match.groups()
            try:
                value = _value(value_text)
            except ValueError:
                continue
            labels: Labels = ()
            if label_text:
                labels = tuple(sorted((k, _unescape(v)) for k, v in _LABEL.findall(label_text)))
            snap.samples.setdefault(name, {})[labels] = value
        return snap

    @classmethod
    def merge(cls, snapshots: Iterable[MetricsSnapshot]) -> MetricsSnapshot:
        """The sum of several targets' snapshots (replicas of one system)."""
        out = cls()
        for snap in snapshots:
            out.families |= snap.families
            for name, series in snap.samples.items():
                mine = out.samples.setdefault(name, {})
                for labels, value in series.items():
                    mine[labels] = mine.get(labels, 0.0) + value
        return out

    def minus(self, earlier: MetricsSnapshot) -> MetricsSnapshot:
        """Counter deltas since ``earlier``; a series absent earlier counts from zero."""
        out = MetricsSnapshot(families=set(self.families))
        for name, series in self.samples.items():
            before = earlier.samples.get(name, {})
            out.samples[name] = {k: v - before.get(k, 0.0) for k, v in series.items()}
        return out

    def exports(self, name: str) -> bool:
        """Whether the target exports ``name`` (a sample name or a family name)."""
        if name in self.samples or name in self.families:
            return True
        for suffix in ("_total", "_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name[: -len(suffix)] in self.families:
                return True
        return False

    def _matching(self, name: str, match: Mapping[str, str]) -> Iterable[tuple[Labels, float]]:
        for labels, value in self.samples.get(name, {}).items():
            if match:
                as_dict = dict(labels)
                if any(as_dict.get(k) != v for k, v in match.items()):
                    continue
            yield labels, value

    def total(self, name: str, **match: str) -> float:
        """Sum of every series of ``name`` whose labels include ``match``."""
        return sum(value for _, value in self._matching(name, match))

    def by_label(self, name: str, label: str, **match: str) -> dict[str, float]:
        """Sums of ``name`` grouped by one label's value."""
        out: dict[str, float] = {}
        for labels, value in self._matching(name, match):
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + value
        return out

    def buckets(self, family: str, **match: str) -> list[tuple[float, float]]:
        """Cumulative ``(le, count)`` of histogram ``family``, summed over other labels."""
        sums: dict[float, float] = {}
        for labels, value in self._matching(f"{family}_bucket", match):
            le = dict(labels).get("le")
            if le is None:
                continue
            bound = _value(le)
            sums[bound] = sums.get(bound, 0.0) + value
        return sorted(sums.items())
