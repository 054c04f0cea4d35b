"""Who may call what, decided from the caller's client certificate (mTLS only).

The Go scheduler let any certificate its CA signed call every RPC, so an agent's certificate
could drain nodes, delete workloads or read bucket secrets, and register or heartbeat for any
node id, taking over another node's workloads (docs/compatibility.md,
"Certificate authorization"). Two rules close that, both decided here from plain values so they
can be tested with tables:

* **Agents call only agent RPCs.** A certificate whose common name is one of
  ``SCHEDULER_AGENT_CERT_NAMES`` (default ``compute-agent``, the Go agent's PKI role; names
  compare without regard to case) may call RegisterNode, Heartbeat and ControlStream, and
  nothing else. Neither may a certificate without a common name, which cannot be told from an
  agent's. ``SCHEDULER_OPERATOR_CERT_NAMES``, when set, is the list of the common names that
  may call the other RPCs (default: any other name, as the Go deployments' gateway, CLI and
  automation certificates have names this scheduler cannot know).
* **A node is bound to the certificate that speaks for it** (``SCHEDULER_NODE_BINDING``),
  whoever calls RegisterNode or Heartbeat:

  * ``endpoint`` (default): the certificate must name the host of the node's ``grpc_endpoint``
    as an IP or DNS subject alternative name. That is the name the scheduler checks when it
    dials the agent with TLS, so every Go agent whose scheduler can reach it already carries
    it. A node that is alive keeps its endpoint host: moving it to another host needs a
    certificate naming the old host too, or the node to be lost first (NotReady, or its
    liveness lease expired: a Draining node keeps its status when lost), so an agent cannot
    redirect a live node's workloads to itself. The commit that moves a node compares that
    its liveness key is still absent in etcd, so a projection running behind cannot mistake a
    live node for a lost one. This protects live nodes only: for a binding that holds while a
    node is down, issue one certificate per node and use ``name``.
  * ``name``: a PKI that issues one certificate per node (the Kubernetes node-authorizer
    model). The certificate must be an agent's (its common name one of
    ``SCHEDULER_AGENT_CERT_NAMES``, so a node's certificate never has operator rights), the
    node id must be one of its DNS names, compared exactly (node ids are case-sensitive etcd
    keys: the certificate of ``web-1`` does not speak for ``WEB-1`` or ``web-1.``), and, as in
    ``endpoint``, it must name the host of the ``grpc_endpoint`` it registers: otherwise an
    agent could register its own node at another node's agent, and drift would find that
    node's workloads on it. The common name never counts as a node name (every agent shares
    it).
  * ``off``: no binding, as in the Go version.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from collections.abc import Iterable, Mapping

#: the AgentControl RPCs an agent calls (the compute-agent's subset proto; docs/compatibility.md,
#: "Control API")
AGENT_METHODS = frozenset({"RegisterNode", "Heartbeat", "ControlStream"})
DEFAULT_AGENT_CERT_NAMES = ("compute-agent",)


class NodeBinding(enum.StrEnum):
    """How RegisterNode and Heartbeat are tied to the caller's certificate."""

    OFF = "off"
    ENDPOINT = "endpoint"
    NAME = "name"


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``name`` as an IP address (brackets and a zone id dropped, an IPv4-mapped IPv6
    address as its IPv4 address, as Go compares them), or None for a DNS name."""
    text = name.strip().strip("[]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _dns_key(name: str) -> str:
    return name.strip().rstrip(".").lower()


def _same_host(a: str, b: str) -> bool:
    ip_a, ip_b = _ip(a), _ip(b)
    if ip_a is not None or ip_b is not None:
        return ip_a == ip_b
    return _dns_key(a) == _dns_key(b)


@dataclasses.dataclass(frozen=True)
class Caller:
    """The identity a verified client certificate presents: its common name, and its IP and
    DNS subject alternative names, kept apart as TLS hostname checks keep them (an IP host is
    matched by IP SANs only, a DNS host by DNS SANs only)."""

    common_name: str = ""
    ips: frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address] = frozenset()
    dns_names: frozenset[str] = frozenset()
    #: why the certificate's identity is not one (several common names, which Go's x509 and
    #: grpc read differently: Go the last, grpc the first): such a caller is refused everything
    ambiguous: str = ""

    @classmethod
    def from_auth_context(cls, auth: Mapping[str, Iterable[bytes]]) -> Caller:
        """From ``ServicerContext.auth_context()`` (grpc splits the SANs into ``peer_ip`` and
        ``peer_dns``)."""

        def texts(key: str) -> list[str]:
            return [v.decode("utf-8", "replace") for v in auth.get(key, ())]

        common = texts("x509_common_name")
        ips = frozenset(ip for ip in map(_ip, texts("peer_ip")) if ip is not None)
        dns = frozenset(_dns_key(n) for n in texts("peer_dns"))
        subjects = texts("x509_subject")
        names = subject_common_names(subjects[0]) if subjects else common
        ambiguous = ""
        if len(names) > 1 or len(common) > 1:
            ambiguous = (f"the certificate's subject holds {max(len(names), len(common))} "
                         "common names, which TLS implementations read as different "
                         "identities; issue it with one")
        elif any(_has_control(n) for n in names):
            ambiguous = "the certificate's common name holds a control character"
        return cls(common_name=common[0] if common else "", ips=ips, dns_names=dns,
                   ambiguous=ambiguous)

    @classmethod
    def of(cls, common_name: str = "", names: Iterable[str] = ()) -> Caller:
        """A caller from plain names (IPs become IP SANs, the rest DNS SANs): for tests."""
        ips = {_ip(n) for n in names}
        return cls(common_name=common_name,
                   ips=frozenset(ip for ip in ips if ip is not None),
                   dns_names=frozenset(_dns_key(n) for n in names if _ip(n) is None))

    def describe(self) -> str:
        """For logs and refusals: the common name and names, never the certificate itself."""
        names = ",".join(sorted([*map(str, self.ips), *self.dns_names])) or "-"
        return f"CN={self.common_name or '-'} SAN={names}"

    def names_host(self, host: str) -> bool:
        """True if a SAN matches ``host``: an IP host an IP SAN; a DNS host a DNS SAN, exactly
        or by a leftmost ``*.`` wildcard."""
        if not host.strip():
            return False
        ip = _ip(host)
        if ip is not None:
            return ip in self.ips
        key = _dns_key(host)
        if key in self.dns_names:
            return True
        _, dot, parent = key.partition(".")
        return bool(dot) and f"*.{parent}" in self.dns_names


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def subject_common_names(subject: str) -> list[str]:
    """The CN values of an RFC 2253 subject (``CN=a,O=b+CN=c``), escapes honoured: grpc
    gives the subject so, and only the first common name apart."""
    attributes: list[str] = []
    current, escaped = "", False
    for char in subject:
        if escaped:
            current += char
            escaped = False
        elif char == "\\":
            current += char
            escaped = True
        elif char in ",+":
            attributes.append(current)
            current = ""
        else:
            current += char
    attributes.append(current)
    out = []
    for attribute in attributes:
        kind, sep, value = attribute.partition("=")
        if sep and kind.strip().upper() in ("CN", "2.5.4.3", "OID.2.5.4.3"):
            out.append(value)
    return out


def _names(names: Iterable[str]) -> frozenset[str]:
    return frozenset(n.strip().casefold() for n in names if n.strip())


def is_agent(caller: Caller, agent_names: Iterable[str]) -> bool:
    return caller.common_name.strip().casefold() in _names(agent_names)


def refuse_call(method: str, caller: Caller, agent_names: Iterable[str],
                operator_names: Iterable[str] = ()) -> str | None:
    """Why ``caller`` may not call ``method`` (its short name), or None if it may.

    Agent RPCs are open to every verified certificate (the node binding decides for which
    node). Every other RPC refuses agent certificates, certificates without a common name
    (which cannot be told from an agent's), and, when ``operator_names`` is not empty,
    every common name not in it. Names compare without regard to case.
    """
    if caller.ambiguous:
        return f"{caller.ambiguous} ({caller.describe()})"
    if method in AGENT_METHODS:
        return None
    if is_agent(caller, agent_names):
        return (f"an agent certificate ({caller.describe()}) may call only "
                f"{', '.join(sorted(AGENT_METHODS))}, not {method}")
    if not caller.common_name.strip():
        return f"a certificate without a common name ({caller.describe()}) may not call {method}"
    operators = _names(operator_names)
    if operators and caller.common_name.strip().casefold() not in operators:
        return (f"the certificate ({caller.describe()}) is not an operator's "
                f"(SCHEDULER_OPERATOR_CERT_NAMES) and may not call {method}")
    return None


def moves_node(caller: Caller, binding: NodeBinding, *, host: str,
               registered_host: str | None) -> bool:
    """True if registering at ``host`` takes a node from the host it is registered at, which
    the caller's certificate does not name: allowed only while the node is lost, so the commit
    must also check that its liveness key is still absent."""
    return (binding is NodeBinding.ENDPOINT and bool(registered_host)
            and not _same_host(host, registered_host or "")
            and not caller.names_host(registered_host or ""))


def refuse_registration(
    caller: Caller, binding: NodeBinding, *, node_id: str, host: str,
    registered_host: str | None, lost: bool,
    agent_names: Iterable[str] = DEFAULT_AGENT_CERT_NAMES,
) -> str | None:
    """Why ``caller`` may not register ``node_id`` at ``host``, or None if it may.

    ``registered_host``: the host of the node's current endpoint (None for a new node);
    ``lost``: the node is NotReady or its liveness lease expired, so its old agent no longer
    speaks for it.
    """
    if caller.ambiguous:
        return f"{caller.ambiguous} ({caller.describe()})"
    if binding is NodeBinding.OFF:
        return None
    if binding is NodeBinding.NAME:
        refusal = _refuse_name(caller, node_id, agent_names)
        if refusal is not None:
            return refusal
    if not caller.names_host(host):
        return (f"grpc_endpoint: host {host!r} is not named by the client certificate "
                f"({caller.describe()})")
    if binding is NodeBinding.NAME:
        return None  # the node is the certificate's own: it may move it to a host it names
    if not moves_node(caller, binding, host=host, registered_host=registered_host) or lost:
        return None
    return (f"grpc_endpoint: node {node_id!r} is alive at host {registered_host!r}; another "
            f"host may register it only once it is lost (NotReady, or its lease expired)")


def refuse_crowded_host(binding: NodeBinding, *, node_id: str, host: str,
                        live_at_host: Iterable[str], limit: int) -> str | None:
    """Why ``node_id`` may not join the ``live_at_host`` nodes (the other live nodes whose
    agent endpoint is at ``host``), or None if it may.

    In ``endpoint`` binding a certificate speaks for the nodes at the hosts it names, so one
    agent certificate could register any number of node ids at its own host and take every
    placement; a host holds at most ``limit`` live nodes (``SCHEDULER_NODES_PER_HOST``). A
    node already counted there re-registers freely, and a lost node does not count.
    """
    if binding is not NodeBinding.ENDPOINT:
        return None
    others = sorted(n for n in live_at_host if n != node_id)
    if len(others) < limit:
        return None
    shown = ", ".join(repr(n) for n in others[:5]) + (", ..." if len(others) > 5 else "")
    return (f"grpc_endpoint: host {host!r} already holds {len(others)} live node(s) ({shown}); "
            f"at most {limit} per agent endpoint host (SCHEDULER_NODES_PER_HOST)")


def refuse_heartbeat(caller: Caller, binding: NodeBinding, *, node_id: str,
                     registered_host: str,
                     agent_names: Iterable[str] = DEFAULT_AGENT_CERT_NAMES) -> str | None:
    """Why ``caller`` may not heartbeat for ``node_id`` (registered at
    ``registered_host``), or None if it may."""
    if caller.ambiguous:
        return f"{caller.ambiguous} ({caller.describe()})"
    if binding is NodeBinding.OFF:
        return None
    if binding is NodeBinding.NAME:
        return _refuse_name(caller, node_id, agent_names)
    if caller.names_host(registered_host):
        return None
    return (f"node {node_id!r} is registered at host {registered_host!r}, which the client "
            f"certificate ({caller.describe()}) does not name")


def _refuse_name(caller: Caller, node_id: str, agent_names: Iterable[str]) -> str | None:
    if not is_agent(caller, agent_names):
        return (f"node_id: {node_id!r} may be spoken for only by an agent certificate (common "
                f"name in SCHEDULER_AGENT_CERT_NAMES), not ({caller.describe()})")
    # DNS names are kept lower-cased without a trailing dot: an id that differs from its own
    # normal form (case, a trailing dot) is another etcd key and never a certificate's name
    if _dns_key(node_id) == node_id and node_id in caller.dns_names:
        return None
    return (f"node_id: {node_id!r} is not a DNS name of the client certificate "
            f"({caller.describe()}); node ids compare exactly")
