"""The command groups; ``register`` adds them all to the root command."""

from __future__ import annotations

import click


def register(cli: click.Group) -> None:
    from ops.persys.commands import (
        config,
        events,
        explain,
        node_control,
        reads,
        storage,
        top,
        workload_control,
    )

    for module in (reads, workload_control, node_control, events, explain, storage, top,
                   config):
        for command in module.COMMANDS:
            cli.add_command(command)
