"""The ``persys`` command tree, its global options, and its exit statuses.

Built on click (commands, options, shell completion) and rich (tables, progress, the live
view). Every failure ends in one line on stderr and an exit status from ``errors``; a
traceback only with ``PERSYS_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import click

from ops.persys import errors
from ops.persys.client import Client
from ops.persys.contexts import Config, load_config
from ops.persys.session import Target, resolve


@dataclass
class Session:
    """What every command gets: the resolved target and a client made on first use."""

    flags: dict[str, Any]
    context: str | None
    _config: Config | None = None
    _client: Client | None = None
    _target: Target | None = None
    closers: list[Any] = field(default_factory=list)

    @property
    def config(self) -> Config:
        if self._config is None:
            self._config = load_config()
        return self._config

    @property
    def target(self) -> Target:
        if self._target is None:
            self._target = resolve(self.flags, self.config, self.context)
        return self._target

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.target)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


pass_session = click.make_pass_decorator(Session)


@click.group(context_settings={"help_option_names": ["-h", "--help"],
                               "max_content_width": 100})
@click.option("--server", envvar="PERSYS_SERVER", metavar="HOST:PORT",
              help="Scheduler address [env PERSYS_SERVER; default 127.0.0.1:8085].")
@click.option("--ca", envvar="PERSYS_TLS_CA", metavar="FILE", help="CA bundle (mTLS).")
@click.option("--cert", envvar="PERSYS_TLS_CERT", metavar="FILE", help="Client certificate.")
@click.option("--key", envvar="PERSYS_TLS_KEY", metavar="FILE", help="Client key.")
@click.option("--insecure", is_flag=True, default=None, help="Plaintext, no TLS.")
@click.option("--tls-server-name", metavar="NAME", help="Name to check in the server's cert.")
@click.option("--context", "context_name", metavar="NAME", help="Context of the config file.")
@click.option("--timeout", type=float, metavar="SECONDS", help="Deadline of each call (15).")
@click.version_option(package_name="persys-scheduler", prog_name="persys")
@click.pass_context
def cli(ctx: click.Context, context_name: str | None, **flags: Any) -> None:
    """Drive a persys scheduler: nodes, workloads, events, placement explanations."""
    session = Session(flags=flags, context=context_name)
    ctx.obj = session
    ctx.call_on_close(session.close)


def main(argv: list[str] | None = None) -> None:
    """The console script: run the tree, map every failure to its exit status."""
    from ops.persys.commands import register

    register(cli)
    try:
        cli.main(args=argv, prog_name="persys", standalone_mode=False)
    except errors.CliError as exc:
        _fail(str(exc), exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(errors.INPUT if exc.exit_code in (1, 2) else exc.exit_code)
    except click.exceptions.Abort:
        _fail("aborted", 130)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
    except Exception as exc:
        if os.environ.get("PERSYS_DEBUG"):
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (PERSYS_DEBUG=1 shows where)",
              errors.REFUSED)
    sys.exit(0)


def _fail(message: str, code: int) -> None:
    click.echo(f"persys: {message}", err=True)
    sys.exit(code)
