"""Hosts on one Linux machine: network namespaces on a bridge, for the cluster helpers.

Each "host" is a network namespace (``ip netns``) joined to a bridge by a veth pair, with
its own address in ``10.213.X.0/24`` (X picked free); the host side of the bridge is
``.1``. The Spark cluster (:mod:`.cluster`) puts its workers there, the Kafka cluster
(:mod:`.kafkacluster`) its brokers: every byte between them and the host side crosses
the bridge, so an address that only works on loopback fails here as it would on a real
network, and a host can be killed or cut off alone.

Needs root (or CAP_NET_ADMIN) and Debian's ``iproute2``. Everything a :class:`Bridge`
creates carries its random tag and is removed by :meth:`Bridge.down`; it never touches
an interface or namespace it did not create.
"""

from __future__ import annotations

import ipaddress
import secrets
import shutil
import subprocess
from dataclasses import dataclass

from twophase.testing.servers import ServerUnavailable

__all__ = ["Bridge", "Host", "NetnsUnavailable", "ip"]


class NetnsUnavailable(ServerUnavailable):
    """Namespaces or links could not be made (no ``ip``, no privileges)."""


def ip(*args: str, check: bool = True,
       error: type[ServerUnavailable] = NetnsUnavailable) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; a failure (when ``check``) raises ``error`` naming the cause."""
    binary = shutil.which("ip")
    if binary is None:
        raise error("the 'ip' command is missing; install Debian's iproute2: "
                    "apt-get install -y iproute2")
    res = subprocess.run([binary, *args], capture_output=True, text=True, check=False)
    if check and res.returncode != 0:
        raise error(f"ip {' '.join(args)} failed: {res.stderr.strip()} (the cluster helpers "
                    "need root or CAP_NET_ADMIN to create network namespaces)")
    return res


def free_subnet(error: type[ServerUnavailable] = NetnsUnavailable) -> int:
    """A third octet X such that no interface here has an address in 10.213.X.0/24."""
    used = ip("-4", "-o", "addr", "show", error=error).stdout
    for _ in range(200):
        x = secrets.randbelow(250) + 2
        if f"10.213.{x}." not in used:
            return x
    raise error("no free 10.213.X.0/24 subnet found")


@dataclass
class Host:
    """One namespace on the bridge: its name, address and the bridge-side veth end."""

    index: int
    netns: str
    address: str
    host_veth: str  # the bridge side: a link cut is ``ip link set host_veth down``

    def exec_prefix(self) -> list[str]:
        """The command prefix that runs a program inside this host's namespace."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.netns]

    def pids(self) -> list[int]:
        """Every process in this host's network namespace."""
        res = ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in res.stdout.split() if p.isdigit()]


class Bridge:
    """A bridge with the host side at ``10.213.X.1`` and namespaces added by
    :meth:`add_host` (``.10+n``). ``tag`` prefixes every name (<= 11 characters: Linux
    interface names stay within 15)."""

    def __init__(self, tag: str, *, error: type[ServerUnavailable] = NetnsUnavailable
                 ) -> None:
        self.tag = tag
        self.error = error
        self.subnet = 0
        self.name = f"{tag}br"
        self._netns: list[str] = []
        self._links: list[str] = []

    @property
    def host_address(self) -> str:
        return f"10.213.{self.subnet}.1"

    @property
    def network(self) -> str:
        return f"10.213.{self.subnet}.0/24"

    def contains(self, address: str) -> bool:
        return ipaddress.ip_address(address) in ipaddress.ip_network(self.network)

    def up(self) -> Bridge:
        self.subnet = free_subnet(self.error)
        ip("link", "add", self.name, "type", "bridge", error=self.error)
        self._links.append(self.name)
        ip("addr", "add", f"{self.host_address}/24", "dev", self.name, error=self.error)
        ip("link", "set", self.name, "up", error=self.error)
        return self

    def add_host(self, n: int, kind: str = "w") -> Host:
        """Namespace ``<tag><kind><n>`` at ``10.213.X.(10+n)``, linked to the bridge."""
        netns, host_veth, ns_veth = f"{self.tag}{kind}{n}", f"{self.tag}h{n}", f"{self.tag}n{n}"
        address = f"10.213.{self.subnet}.{10 + n}"
        e = self.error
        ip("netns", "add", netns, error=e)
        self._netns.append(netns)
        ip("link", "add", host_veth, "type", "veth", "peer", "name", ns_veth, error=e)
        self._links.append(host_veth)
        ip("link", "set", host_veth, "master", self.name, error=e)
        ip("link", "set", host_veth, "up", error=e)
        ip("link", "set", ns_veth, "netns", netns, error=e)
        ip("-n", netns, "addr", "add", f"{address}/24", "dev", ns_veth, error=e)
        ip("-n", netns, "link", "set", ns_veth, "up", error=e)
        ip("-n", netns, "link", "set", "lo", "up", error=e)
        return Host(n, netns, address, host_veth)

    def cut(self, host: Host) -> None:
        """Take the host's link to the bridge down: it is unreachable."""
        ip("link", "set", host.host_veth, "down", error=self.error)

    def restore(self, host: Host) -> None:
        ip("link", "set", host.host_veth, "up", error=self.error)

    def down(self) -> None:
        """Remove every link and namespace this bridge created (kill their processes
        first: a namespace with a process in it lingers until that process exits)."""
        for link in reversed(self._links):
            ip("link", "del", link, check=False)
        for ns in self._netns:
            ip("netns", "del", ns, check=False)
        self._links, self._netns = [], []
