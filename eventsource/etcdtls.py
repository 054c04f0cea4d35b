"""Client TLS for etcd: a CA to verify the members, and a client certificate for members run
with ``--client-cert-auth``.

The Go scheduler had no etcd TLS (docs/compatibility.md, "etcd TLS"), so
its state, including every node's address and every workload spec, crossed the network in the
clear to anyone who could reach port 2379. The files are read again for each new connection,
so rotated certificates are used without a restart (connections are kept alive, so that is
rare).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """``ca``: PEM bundle that signed the members' certificates (empty: the system's CAs);
    ``cert``/``key``: this client's certificate and key (empty: none presented)."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            context.load_cert_chain(self.cert, self.key or None)
        return context

    def requests_options(self) -> dict[str, Any]:
        """``verify`` and ``cert`` for a ``requests.Session`` (the watch streams). Without a
        CA file, the system's store, as the gateway client's ``ssl`` context uses (requests'
        own default would be certifi's bundle: a CA trusted only by the system would then
        pass every call but the watches)."""
        return {"verify": self.ca or system_ca(),
                "cert": (self.cert, self.key) if self.cert and self.key else self.cert or None}


def system_ca() -> str | bool:
    """The system's CA file or directory, as ``ssl.create_default_context`` finds it."""
    paths = ssl.get_default_verify_paths()
    return paths.cafile or paths.capath or True
