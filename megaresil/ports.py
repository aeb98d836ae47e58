"""Free local ports and local addresses, for a rendezvous or store."""
from __future__ import annotations

import ipaddress
import socket
from typing import Optional

import psutil

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A free TCP port on loopback, for a local rendezvous or store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address_towards(host: str, port: int) -> Optional[str]:
    """This machine's address on the interface that reaches host:port (what
    a connection there would come from; no packet is sent), or None when no
    route leads there."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        return None


def is_loopback_name(host: str) -> bool:
    """`localhost`, or a loopback address written out (127.0.0.1, ::1)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 ("lo" on Linux)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return "lo"
