"""Where to connect, resolved once per invocation: flags, then environment, then context.

``--server`` (``PERSYS_SERVER``), ``--ca``/``--cert``/``--key`` (``PERSYS_TLS_CA``,
``PERSYS_TLS_CERT``, ``PERSYS_TLS_KEY``), ``--insecure``, then the context named by
``--context`` or the configuration's current one, then ``127.0.0.1:8085`` in plaintext (the
dev stack's address). With a CA, certificate or key the channel is mTLS; ``--insecure`` forces
plaintext. The client is made on first use, so ``persys config ...`` never dials.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.persys.contexts import Config
from ops.persys.errors import InputError

DEFAULT_SERVER = "127.0.0.1:8085"


@dataclass(frozen=True)
class Target:
    server: str
    ca: str = ""
    cert: str = ""
    key: str = ""
    insecure: bool = True
    tls_server_name: str = ""
    #: seconds a unary call may take
    timeout_s: float = 15.0

    def read_tls(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(ca, key, cert) bytes; a missing file is an input error naming it."""
        def read(path: str, what: str) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).expanduser().read_bytes()
            except OSError as exc:
                raise InputError(f"{what} {path}: {exc.strerror}") from exc
        return read(self.ca, "--ca"), read(self.key, "--key"), read(self.cert, "--cert")


def resolve(flags: dict[str, Any], config: Config, context: str | None) -> Target:
    """``flags`` holds what click read from the command line or the environment (None where
    neither said anything)."""
    ctx = config.context(context)

    def pick(name: str) -> Any:
        value = flags.get(name)
        return value if value not in (None, "") else ctx.get(name)

    server = str(pick("server") or DEFAULT_SERVER)
    if ":" not in server.rsplit("]", 1)[-1]:
        raise InputError(f"--server {server!r}: expected HOST:PORT")
    ca, cert, key = (str(pick(n) or "") for n in ("ca", "cert", "key"))
    if bool(cert) != bool(key):
        raise InputError("--cert and --key go together")
    insecure_flag = flags.get("insecure")
    insecure = bool(insecure_flag) if insecure_flag else bool(ctx.get("insecure", False))
    if not (ca or cert):
        insecure = True
    timeout = float(flags.get("timeout") or ctx.get("timeout", 15.0))
    return Target(server=server, ca=ca, cert=cert, key=key, insecure=insecure,
                  tls_server_name=str(pick("tls_server_name") or ""), timeout_s=timeout)
