"""``persys config ...`` (named contexts) and ``persys completion bash|zsh``."""

from __future__ import annotations

from typing import Any

import click
from click.shell_completion import get_completion_class

from ops.persys.commands.common import output_option
from ops.persys.errors import InputError
from ops.persys.main import Session, pass_session
from ops.persys.output import emit, new_table


@click.group("config")
def config() -> None:
    """Named contexts: which scheduler, with which certificates."""


@config.command("view")
@output_option
@pass_session
def config_view(session: Session, fmt: str) -> None:
    """The configuration file and its contexts."""
    cfg = session.config

    def table() -> Any:
        t = new_table("CURRENT", "NAME", "SERVER", "TLS")
        for name, ctx in sorted(cfg.contexts.items()):
            tls = "insecure" if ctx.get("insecure") or not ctx.get("ca") else "mTLS"
            t.add_row("*" if name == cfg.current else "", name, str(ctx.get("server", "")), tls)
        return [f"# {cfg.path}", t]

    emit(fmt,
         {"current-context": cfg.current, "contexts": cfg.contexts, "path": str(cfg.path)},
         table)


@config.command("use")
@click.argument("name")
@pass_session
def config_use(session: Session, name: str) -> None:
    """Make NAME the current context."""
    cfg = session.config
    if name not in cfg.contexts:
        raise InputError(f"context {name!r} not found in {cfg.path} "
                         f"(known: {', '.join(sorted(cfg.contexts)) or 'none'})")
    cfg.current = name
    cfg.save()
    click.echo(f"current context: {name}")


@config.command("set-context")
@click.argument("name")
@click.option("--server", metavar="HOST:PORT")
@click.option("--ca", metavar="FILE")
@click.option("--cert", metavar="FILE")
@click.option("--key", metavar="FILE")
@click.option("--insecure/--tls", default=None)
@click.option("--tls-server-name", metavar="NAME")
@click.option("--use", "use_it", is_flag=True, help="Also make it the current context.")
@pass_session
def config_set_context(session: Session, name: str, use_it: bool, **values: Any) -> None:
    """Create or change a context (only the options given change)."""
    cfg = session.config
    ctx = cfg.contexts.setdefault(name, {})
    for key, value in values.items():
        if value is not None:
            ctx[key] = value
    if use_it or not cfg.current:
        cfg.current = name
    cfg.save()
    click.echo(f"context {name} saved in {cfg.path}")


@config.command("delete-context")
@click.argument("name")
@pass_session
def config_delete_context(session: Session, name: str) -> None:
    cfg = session.config
    if cfg.contexts.pop(name, None) is None:
        raise InputError(f"context {name!r} not found in {cfg.path}")
    if cfg.current == name:
        cfg.current = ""
    cfg.save()
    click.echo(f"context {name} deleted")


@click.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh"]))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script: eval "$(persys completion bash)"."""
    root = ctx.find_root().command
    cls = get_completion_class(shell)
    assert cls is not None
    click.echo(cls(root, {}, "persys", "_PERSYS_COMPLETE").source())


COMMANDS = [config, completion]
