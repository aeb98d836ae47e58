"""Free local ports, for a rendezvous or store on this machine."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A free TCP port on loopback, for a local rendezvous or store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
