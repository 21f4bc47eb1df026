"""Finding nodes without an address list: a headless Service's DNS name, and the pod's own host.

`nodes = ["dns:NAME:PORT"]` names every address NAME resolves to (the A and AAAA records of a
Kubernetes headless Service are its pods' addresses), sorted, so that every node and client
that resolves it at the same moment sees the same list. It is resolved once, when the settings
are loaded (a node at start, a client when it connects): a node added later is seen by what
starts after it (with etcd, membership follows the live members instead).

Inside a pod (KUBERNETES_SERVICE_HOST is set) with no `nodes` setting anywhere, the node is the
one on the pod's own host: HOST_IP from the downward API (`status.hostIP`), where the DaemonSet's
node listens on the host network.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from kspeedfs.format.errors import InvalidArgument, NodeUnreachable
from kspeedfs.format.units import Address, parse_address

DNS_PREFIX = "dns:"
DEFAULT_PORT = 7420


def resolve_dns(entry: str, default_port: int = DEFAULT_PORT) -> list[Address]:
    """`dns:NAME[:PORT]`: one address per A/AAAA record of NAME, sorted (IPv4 first)."""
    spec = parse_address(entry[len(DNS_PREFIX) :], default_port)
    try:
        infos = socket.getaddrinfo(spec.host, spec.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise NodeUnreachable(f"{entry}: the name does not resolve: {e.strerror}") from None
    except UnicodeError:
        raise InvalidArgument(f"{entry}: not a DNS name") from None
    hosts = {str(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)}
    if not hosts:
        raise NodeUnreachable(f"{entry}: the name has no address")
    order = sorted(hosts, key=lambda h: (":" in h, socket.inet_pton(_family(h), h)))
    return [Address(h, spec.port) for h in order]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def pod_host_node(env: Mapping[str, str]) -> Address | None:
    """Inside a Kubernetes pod: the node on the pod's host (HOST_IP, port 7420); else None."""
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return None
    host = env.get("HOST_IP", "").strip()
    if not host:
        return None
    return Address(host, DEFAULT_PORT)
