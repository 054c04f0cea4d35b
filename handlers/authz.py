"""Who may call what, decided from the caller's client certificate (mTLS only).

The Go scheduler let any certificate its CA signed call every RPC, so an agent's certificate
could drain nodes, delete workloads or read bucket secrets, and register or heartbeat for any
node id, taking over another node's workloads (persys-facts I.21). Two rules close that,
both decided here from plain values so they can be tested with tables:

* **Agents call only agent RPCs.** A certificate whose common name is one of
  ``SCHEDULER_AGENT_CERT_NAMES`` (default ``compute-agent``, the Go agent's PKI role) may call
  RegisterNode, Heartbeat and ControlStream, and nothing else.
* **A node is bound to the certificate that speaks for it** (``SCHEDULER_NODE_BINDING``),
  whoever calls RegisterNode or Heartbeat:

  * ``endpoint`` (default): the certificate must name the host of the node's ``grpc_endpoint``
    as an IP or DNS subject alternative name. That is the name the scheduler checks when it
    dials the agent with TLS, so every Go agent whose scheduler can reach it already carries
    it. A node that is alive keeps its endpoint host: moving it to another host needs a
    certificate naming the old host too, or the node to be lost first (NotReady, or its
    liveness lease expired: a Draining node keeps its status when lost), so an agent cannot
    redirect a live node's workloads to itself.
  * ``name``: the node id must be the certificate's common name or one of its DNS names (a
    PKI that issues one certificate per node; the Kubernetes node-authorizer model).
  * ``off``: no binding, as in the Go version.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from collections.abc import Iterable, Mapping

#: the AgentControl RPCs an agent calls (the compute-agent's subset proto, persys-facts B)
AGENT_METHODS = frozenset({"RegisterNode", "Heartbeat", "ControlStream"})
DEFAULT_AGENT_CERT_NAMES = ("compute-agent",)


class NodeBinding(enum.StrEnum):
    """How RegisterNode and Heartbeat are tied to the caller's certificate."""

    OFF = "off"
    ENDPOINT = "endpoint"
    NAME = "name"


def _host_key(name: str) -> str:
    """One spelling per host: IPs compressed (and without brackets), DNS names lowercased."""
    name = name.strip().strip("[]").rstrip(".").lower()
    try:
        return ipaddress.ip_address(name).compressed
    except ValueError:
        return name


@dataclasses.dataclass(frozen=True)
class Caller:
    """The identity a verified client certificate presents.

    ``hosts``: its IP and DNS subject alternative names, as :func:`_host_key` spells them.
    """

    common_name: str = ""
    hosts: frozenset[str] = frozenset()
    dns_names: frozenset[str] = frozenset()

    @classmethod
    def from_auth_context(cls, auth: Mapping[str, Iterable[bytes]]) -> Caller:
        """From ``ServicerContext.auth_context()`` (grpc splits the SANs into ``peer_ip`` and
        ``peer_dns``)."""

        def texts(key: str) -> list[str]:
            return [v.decode("utf-8", "replace") for v in auth.get(key, ())]

        common = texts("x509_common_name")
        dns = frozenset(_host_key(n) for n in texts("peer_dns"))
        ips = frozenset(_host_key(n) for n in texts("peer_ip"))
        return cls(common_name=common[0] if common else "", hosts=dns | ips, dns_names=dns)

    def describe(self) -> str:
        """For logs and refusals: the common name and names, never the certificate itself."""
        names = ",".join(sorted(self.hosts)) or "-"
        return f"CN={self.common_name or '-'} SAN={names}"

    def names_host(self, host: str) -> bool:
        """True if a SAN matches ``host``, exactly or by a leftmost ``*.`` wildcard."""
        key = _host_key(host)
        if key in self.hosts:
            return True
        _, dot, parent = key.partition(".")
        return bool(dot) and f"*.{parent}" in self.dns_names


def is_agent(caller: Caller, agent_names: Iterable[str]) -> bool:
    return caller.common_name in set(agent_names)


def refuse_call(method: str, caller: Caller, agent_names: Iterable[str]) -> str | None:
    """Why ``caller`` may not call ``method`` (its short name), or None if it may."""
    if method in AGENT_METHODS or not is_agent(caller, agent_names):
        return None
    return (f"an agent certificate ({caller.describe()}) may call only "
            f"{', '.join(sorted(AGENT_METHODS))}, not {method}")


def refuse_registration(
    caller: Caller, binding: NodeBinding, *, node_id: str, host: str,
    registered_host: str | None, lost: bool,
) -> str | None:
    """Why ``caller`` may not register ``node_id`` at ``host``, or None if it may.

    ``registered_host``: the host of the node's current endpoint (None for a new node);
    ``lost``: the node is NotReady or its liveness lease expired, so its old agent no longer
    speaks for it.
    """
    if binding is NodeBinding.OFF:
        return None
    if binding is NodeBinding.NAME:
        return _refuse_name(caller, node_id)
    if not caller.names_host(host):
        return (f"grpc_endpoint: host {host!r} is not named by the client certificate "
                f"({caller.describe()})")
    if registered_host is None or lost or _host_key(registered_host) == _host_key(host):
        return None
    if caller.names_host(registered_host):
        return None
    return (f"grpc_endpoint: node {node_id!r} is alive at host {registered_host!r}; another "
            f"host may register it only once it is lost (NotReady, or its lease expired)")


def refuse_heartbeat(caller: Caller, binding: NodeBinding, *, node_id: str,
                     registered_host: str) -> str | None:
    """Why ``caller`` may not heartbeat for ``node_id`` (registered at
    ``registered_host``), or None if it may."""
    if binding is NodeBinding.OFF:
        return None
    if binding is NodeBinding.NAME:
        return _refuse_name(caller, node_id)
    if caller.names_host(registered_host):
        return None
    return (f"node {node_id!r} is registered at host {registered_host!r}, which the client "
            f"certificate ({caller.describe()}) does not name")


def _refuse_name(caller: Caller, node_id: str) -> str | None:
    if node_id == caller.common_name or _host_key(node_id) in caller.dns_names:
        return None
    return (f"node_id: {node_id!r} is neither the common name nor a DNS name of the client "
            f"certificate ({caller.describe()})")
