"""Why a replica could not start, as the operator must read it: ``StartError``, and
``ListenError`` for a port that could not be had, naming the setting to change.

Apart from the composition root because the command line (ops/cli.py) turns these into exit
statuses and messages, and because finding out why a bind failed (grpc says only "Failed to
bind") is a job of its own: trying the bind with a plain socket.
"""

from __future__ import annotations

import errno
import socket


class StartError(RuntimeError):
    """The replica could not start; the message says what did not answer or could not be used."""


class ListenError(StartError):
    """A listener could not be opened: ``variable`` names the setting to change, ``detail``
    says what went wrong (the message is both)."""

    def __init__(self, *, variable: str, detail: str) -> None:
        super().__init__(f"{variable}: {detail}")
        self.variable = variable
        self.detail = detail


def bind_problem(host: str, port: int) -> OSError | None:
    """Why ``host:port`` cannot be bound, found by trying (grpc's own error says only "Failed
    to bind"); None when it can be bound now."""
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return exc
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                return exc
    return None


def listen_error(what: str, host: str, port: int, problem: OSError | None, *, host_var: str,
                 port_var: str) -> ListenError:
    """The error for a listener that could not be opened, naming the setting at fault."""
    where = f"{host}:{port}"
    if isinstance(problem, socket.gaierror):
        variable, why = host_var, f"{host!r} is not an address ({problem.strerror})"
    elif problem is not None and problem.errno == errno.EADDRINUSE:
        variable, why = port_var, f"port {port} is in use by another process"
    elif problem is not None and problem.errno == errno.EADDRNOTAVAIL:
        variable, why = host_var, f"{host} is not an address of this machine"
    elif problem is not None and problem.errno == errno.EACCES:
        variable, why = port_var, f"port {port} needs privileges this process does not have"
    else:
        variable = f"{host_var}/{port_var}"
        why = problem.strerror if problem is not None and problem.strerror else "bind failed"
    return ListenError(variable=variable, detail=f"the {what} cannot listen on {where}: {why}")
