"""What several command modules share: the ``-o`` option and in-band refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ops.persys.errors import Refused
from ops.persys.output import FORMATS

F = TypeVar("F", bound=Callable[..., Any])


def output_option(func: F) -> F:
    decorated: F = click.option(
        "-o", "--output", "fmt", type=click.Choice(FORMATS), default="table",
        show_default=True, help="table, wide (more columns), json or yaml.")(func)
    return decorated


def require_accepted(answer: Any, what: str) -> None:
    """The persys RPCs answer refusals in-band (``accepted``/``success`` false, a message)."""
    ok = getattr(answer, "accepted", None)
    if ok is None:
        ok = getattr(answer, "success", True)
    if not ok:
        message = (getattr(answer, "message", "") or getattr(answer, "error_message", "")
                   or "refused")
        raise Refused(f"{what}: {message}")
