"""Finding nodes without an address list: a headless Service's DNS name, and the pod's own host.

`nodes = ["dns:NAME:PORT"]` names every address NAME resolves to (the A and AAAA records of a
Kubernetes headless Service are its pods' addresses), sorted, so that every node and client
that resolves it at the same moment sees the same list. It is resolved when the settings are
loaded, and again every `dns_refresh` seconds by what lives long: a node without etcd places
new data over the list it resolved last (node/discovery.py), a ClusterReader asks the nodes of
the last lookup (NodeWatch here). A lookup that fails keeps the last list. With etcd,
membership follows the live members instead.

Inside a pod (KUBERNETES_SERVICE_HOST is set) with no `nodes` setting anywhere, the node is the
one on the pod's own host: HOST_IP from the downward API (`status.hostIP`), where the DaemonSet's
node listens on the host network.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kspeedfs.format.errors import InvalidArgument, KSpeedError, NodeUnreachable
from kspeedfs.format.units import Address, parse_address

log = logging.getLogger(__name__)

DNS_PREFIX = "dns:"
DEFAULT_PORT = 7420


class ResolvedNodes(list[Address]):
    """A `nodes` setting with dns: entries, as resolved last; `entries` (as given) are what is
    looked up again."""

    def __init__(self, addresses: Iterable[Address] = (), entries: Sequence[Any] = ()):
        super().__init__(addresses)
        self.entries = tuple(entries)


def resolve_nodes(entries: Sequence[Any], to_address: Callable[[Any], Address]) -> ResolvedNodes:
    """Every entry's addresses, in order, each once: dns:NAME[:PORT] all of NAME's, others
    through `to_address`. NodeUnreachable when a name does not resolve."""
    out: list[Address] = []
    for x in entries:
        if isinstance(x, str) and x.startswith(DNS_PREFIX):
            out.extend(a for a in resolve_dns(x) if a not in out)
        else:
            address = to_address(x)
            if address not in out:
                out.append(address)
    return ResolvedNodes(out, entries)


def lookup_again(nodes: Sequence[Address]) -> list[Address]:
    """`nodes` resolved now when it came from dns: entries (as is otherwise)."""
    if not isinstance(nodes, ResolvedNodes) or not nodes.entries:
        return list(nodes)
    return list(resolve_nodes(nodes.entries, lambda x: parse_address(str(x))))


def follows_dns(nodes: Sequence[Address], interval: float) -> bool:
    return isinstance(nodes, ResolvedNodes) and bool(nodes.entries) and interval > 0


class NodeWatch:
    """The node list of a long-lived client: the one resolved last, looked up again in a
    thread of its own once it is `interval` seconds old (the caller never waits on DNS)."""

    def __init__(self, nodes: Sequence[Address], interval: float):
        self.nodes = list(nodes)
        self._given = nodes
        self.interval = interval
        self.follows = follows_dns(nodes, interval)
        self._looked_up = time.monotonic()
        self._looking = False
        self._error = ""
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def current(self) -> list[Address]:
        if self.follows and os.getpid() != self._pid:  # forked (a DataLoader worker)
            self._pid, self._looking, self._lock = os.getpid(), False, threading.Lock()
        if self.follows and time.monotonic() - self._looked_up >= self.interval:
            with self._lock:
                start = not self._looking
                self._looking = True
            if start:
                threading.Thread(target=self._look_up, daemon=True, name="dns nodes").start()
        return self.nodes

    def _look_up(self) -> None:
        try:
            found = lookup_again(self._given)
        except KSpeedError as e:
            if str(e) != self._error:
                log.warning("nodes: %s; keeping %s", e, ", ".join(map(str, self.nodes)))
            self._error = str(e)
        else:
            if found != self.nodes:
                log.info(
                    "nodes: %s (were %s)",
                    ", ".join(map(str, found)),
                    ", ".join(map(str, self.nodes)),
                )
            self.nodes, self._error = found, ""
        finally:
            self._looked_up = time.monotonic()
            self._looking = False


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
