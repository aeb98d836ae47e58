"""A real single-member etcd for drills, tests and benches: Debian's
`etcd-server` binary, its data in a directory of its own, serving the v2 API
that TorchElastic's etcd rendezvous speaks (`--enable-v2`; etcd 3.4 serves
only v3 without it). On loopback with free ports, or on a node of
`--hosts netns` (its own address: its link can be cut like any node's)."""
# mypy: ignore-errors
from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from megaresil.ports import LOOPBACK, free_port

CLIENT_PORT, PEER_PORT = 2379, 2380  # etcd's own, free on a node of its own


def etcd_missing_reason() -> Optional[str]:
    """Why etcd cannot start here, or None when it can."""
    if shutil.which("etcd") is None:
        return "etcd is not installed: apt-get install etcd-server (make test does this as root)"
    return None


class EtcdServer:
    """`start()` runs it through `launch` (subprocess.Popen, or a node's
    `start`) and returns once it answers; `stop()` ends it."""

    def __init__(self, directory: Path, address: str = LOOPBACK,
                 ports: Optional[tuple[int, int]] = None):
        self.directory = directory
        self.client_port, self.peer_port = ports or (free_port(), free_port())
        self.endpoint = f"{address}:{self.client_port}"
        self.peer_url = f"http://{address}:{self.peer_port}"
        self.log = directory / "etcd.log"
        self.proc: Optional[subprocess.Popen] = None

    def command(self) -> list[str]:
        client = f"http://{self.endpoint}"
        return ["etcd", "--name", "megaresil", "--data-dir", str(self.directory / "data"),
                "--enable-v2", "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls",
                self.peer_url, "--initial-cluster", f"megaresil={self.peer_url}"]

    def start(self, launch: Callable[..., subprocess.Popen] = subprocess.Popen,
              timeout_s: float = 30) -> "EtcdServer":
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = launch(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd did not come up on {self.endpoint}\n{self.logs()}")
            time.sleep(0.2)
        return self

    def answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited with {self.proc.returncode}\n{self.logs()}")
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/v2/keys", timeout=1):
                return True
        except OSError:
            return False

    def logs(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
