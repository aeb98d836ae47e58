"""A real single-member etcd on loopback for the `test_etcd_*` tests: Debian's
`etcd-server` binary with its data in a temporary directory and ports picked
free, serving the v2 API that TorchElastic's etcd rendezvous speaks
(`--enable-v2`; etcd 3.4 serves only v3 without it)."""
from __future__ import annotations

import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Optional

from tests.harness.daemons import wait_until
from megaresil.ports import free_port


def missing_reason() -> Optional[str]:
    """Why etcd cannot start here, or None when it can."""
    if shutil.which("etcd") is None:
        return "etcd is not installed: apt-get install etcd-server (make test does this as root)"
    return None


class LocalEtcd:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.log = directory / "etcd.log"
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 30) -> "LocalEtcd":
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["etcd", "--name", "megaresiltest", "--data-dir", str(self.directory / "data"),
                 "--enable-v2", "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"megaresiltest={peer}"],
                stdout=log, stderr=subprocess.STDOUT)
        self._wait_healthy(timeout)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        wait_until(self._answers, timeout, 0.2,
                   lambda: f"etcd did not come up on {self.endpoint}\n{self.logs()}")

    def _answers(self) -> bool:
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
