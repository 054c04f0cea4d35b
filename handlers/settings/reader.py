"""Reading the environment: typed values, Go durations, and a ``ConfigError`` naming the
variable for any value that does not parse.

Why apart: every settings module (the scheduler's, the bucket API's, tracing, the Vault PKI)
reads variables the same way, and none of them guesses a default for an invalid value.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TypeVar


class ConfigError(ValueError):
    """An environment variable has an invalid value."""


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0,
}


def parse_duration(name: str, text: str) -> float:
    """Seconds from a Go duration (``90s``, ``1m30s``, ``24h``) or an integer of seconds."""
    value = text.strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", value):
        return float(value)
    if not value:
        raise ConfigError(f"{name}: empty duration")
    pos = 0
    total = 0.0
    for match in _DURATION_PART.finditer(value):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(value):
        raise ConfigError(f"{name}: {text!r} is not a duration (e.g. 30s, 5m, 24h, or seconds)")
    return total


N = TypeVar("N", int, float)


def _convert(name: str, value: str, convert: Callable[[str], N], what: str) -> N:
    try:
        return convert(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {value!r} is not {what}") from exc


class EnvReader:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def raw(self, name: str) -> str | None:
        value = self.env.get(name)
        if value is None or value.strip() == "":
            return None
        return value.strip()

    def text(self, name: str, default: str) -> str:
        value = self.raw(name)
        return default if value is None else value

    def integer(self, name: str, default: int, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
        value = self.raw(name)
        if value is None:
            return default
        number = _convert(name, value, int, "an integer")
        if minimum is not None and number < minimum:
            raise ConfigError(f"{name}: {number} is below the minimum {minimum}")
        if maximum is not None and number > maximum:
            raise ConfigError(f"{name}: {number} is above the maximum {maximum}")
        return number

    def number(self, name: str, default: float, *, minimum: float, maximum: float) -> float:
        value = self.raw(name)
        if value is None:
            return default
        number = _convert(name, value, float, "a number")
        if not minimum <= number <= maximum:  # NaN fails this too
            raise ConfigError(f"{name}: {value!r} is outside {minimum:g}..{maximum:g}")
        return number

    def duration(self, name: str, default: float, *, allow_zero: bool = True) -> float:
        value = self.raw(name)
        if value is None:
            return default
        seconds = parse_duration(name, value)
        if seconds < 0 or (seconds == 0 and not allow_zero):
            raise ConfigError(f"{name}: {value!r} must be positive")
        return seconds

    def flag(self, name: str, default: bool) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        lowered = value.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"{name}: {value!r} is not a boolean (true/false)")
