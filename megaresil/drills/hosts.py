"""Where a drill's nodes run: all on this machine as plain processes
(`local`, the default), or each in namespaces of its own (`netns`): a network
namespace with its own address on a bridge (through a veth pair), a UTS
namespace with its own hostname and a mount namespace with its own /dev/shm
(so its local checkpoint tier) and /etc/hosts, the run directory shared.
Agents then meet over the bridge, the local tier's replicas cross a real
link, and a lost node takes its /dev/shm with it. Namespaces need root and
iproute2's `ip`."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from megaresil.config import ConfigError
from megaresil.drills.run import kill_tree
from megaresil.drills.scenarios import HOSTS_MODES
from megaresil.ports import LOOPBACK, free_port

RENDEZVOUS_PORT = 29400  # free in node 0's fresh namespace
# Run inside the node's new mount and UTS namespaces: its hostname, a /dev/shm
# and /etc/hosts of its own (the hosts file names every node, as a cluster's
# DNS would: gloo finds a node's address from its hostname), then the command.
NODE_SHELL = ('hostname "$1" && mount -t tmpfs tmpfs /dev/shm && mount --bind "$2" /etc/hosts '
              '&& shift 2 && exec "$@"')


def netns_missing_reason() -> Optional[str]:
    """Why nodes cannot run in namespaces here, or None when they can."""
    if os.geteuid() != 0:
        return "netns needs root (it makes network and mount namespaces): run as root, as CI does"
    missing = [tool for tool in ("ip", "unshare") if not shutil.which(tool)]
    if missing:
        return (f"netns needs {' and '.join(missing)}: install iproute2 and util-linux "
                "(`make cluster-deps` does, as root)")
    return None


class LocalHosts:
    """Every node a plain process tree on this machine, meeting on loopback
    (today's drills)."""
    mode = "local"

    def __init__(self):
        self.procs: dict[int, subprocess.Popen] = {}

    def __enter__(self) -> "LocalHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rendezvous_endpoint(self) -> str:
        return f"{LOOPBACK}:{free_port()}"

    def node_options(self, node: int) -> list[str]:
        return []  # each agent finds its address towards the endpoint: loopback

    def start(self, node: int, command: list[str]) -> subprocess.Popen:
        self.procs[node] = subprocess.Popen(command)
        return self.procs[node]

    def lose(self, node: int) -> None:
        proc = self.procs.pop(node)
        kill_tree(proc.pid)
        proc.wait()

    def close(self) -> None:
        for node in list(self.procs):
            self.lose(node)


@dataclass
class Node:
    namespace: str
    hostname: str
    address: str
    host_link: str  # the veth end on the bridge


class NetnsHosts:
    """Nodes in namespaces of their own on a bridge (see the module
    docstring). Everything it creates is named after `prefix` and removed by
    close(), also when setting up fails part way."""
    mode = "netns"

    def __init__(self, count: int, prefix: Optional[str] = None):
        reason = netns_missing_reason()
        if reason:
            raise ConfigError("--hosts", reason)
        # Link names have 15 characters at most: a short prefix, unique per process.
        self.prefix = prefix or f"mr{os.getpid() % 100000}"
        pid = os.getpid()
        self.subnet = f"10.{200 + pid // 256 % 50}.{pid % 256}"
        self.bridge = f"{self.prefix}br"
        self.nodes: dict[int, Node] = {}
        self.procs: dict[int, subprocess.Popen] = {}
        self.slots = 0  # addresses handed out: a replacement gets a new one
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.address_of_host()}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for node in range(count):
                self.add(node)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "NetnsHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def address_of_host(self) -> str:
        """The bridge's address: the host seen from the nodes."""
        return f"{self.subnet}.254"

    def address(self, node: int) -> str:
        return self.nodes[node].address

    def namespace(self, node: int) -> str:
        return self.nodes[node].namespace

    def rendezvous_endpoint(self) -> str:
        return f"{self.address(0)}:{RENDEZVOUS_PORT}"

    def node_options(self, node: int) -> list[str]:
        """`megaresil train` options of the node's agent: its stores and
        workers on its own address."""
        return ["--local-addr", self.address(node)]

    def add(self, node: int) -> None:
        """Node `node` on the bridge: a namespace, a veth pair, an address."""
        self.slots += 1
        name = f"{self.prefix}n{self.slots}"
        self.nodes[node] = Node(name, f"{self.prefix}-node{node}",
                                f"{self.subnet}.{self.slots}", f"{name}h")
        ip("netns", "add", name)
        ip("link", "add", f"{name}h", "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("link", "set", f"{name}h", "master", self.bridge, "up")
        ip("-n", name, "addr", "add", f"{self.subnet}.{self.slots}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "link", "set", "lo", "up")
        self.write_hosts_file()

    def write_hosts_file(self) -> None:
        """Every node's name and address. Written in place: the nodes
        bind-mount this very file, so a replacement's name reaches them."""
        lines = [f"{LOOPBACK} localhost", *(f"{n.address} {n.hostname}"
                                            for n in self.nodes.values())]
        with open(self.dir / "hosts", "w") as f:
            f.write("\n".join(lines) + "\n")

    def command(self, node: int, command: list[str]) -> list[str]:
        """`command` as run on the node, in its namespaces."""
        n = self.nodes[node]
        return ["ip", "netns", "exec", n.namespace, "unshare", "--mount", "--uts",
                "--propagation", "private", "--", "sh", "-c", NODE_SHELL, "node",
                n.hostname, str(self.dir / "hosts"), *command]

    def start(self, node: int, command: list[str], **popen) -> subprocess.Popen:
        self.procs[node] = subprocess.Popen(self.command(node, command), **popen)
        return self.procs[node]

    def pids(self, node: int) -> list[int]:
        """The processes running on the node."""
        return [int(pid) for pid in ip("netns", "pids", self.namespace(node)).split()]

    def lose(self, node: int) -> None:
        """The node dies: SIGKILL every process in its namespace, then the
        namespace goes, with its veth and (its last process gone) its /dev/shm.
        The processes are gone first, so their peers see the connections
        close, as when today's local drills kill a node's processes."""
        if node not in self.nodes:
            return
        procs = [psutil.Process(pid) for pid in self.pids(node) if psutil.pid_exists(pid)]
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if node in self.procs:
            self.procs.pop(node).wait()
        wait_gone(procs)
        n = self.nodes.pop(node)
        ip("netns", "del", n.namespace, check=False)
        ip("link", "del", n.host_link, check=False)  # gone with the namespace, normally

    def replace(self, node: int) -> None:
        """A fresh machine in the lost node's place: its hostname, a new
        namespace and address, an empty /dev/shm."""
        self.add(node)

    def close(self) -> None:
        """Remove every node, the bridge and the hosts file (idempotent)."""
        for node in list(self.nodes):
            self.lose(node)
        ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_gone(procs: list[psutil.Process], timeout_s: float = 10.0) -> None:
    """Until the killed processes have exited (a zombie has: its sockets are
    closed; whoever adopted it reaps it)."""
    deadline = time.time() + timeout_s
    while not all(map(exited, procs)) and time.time() < deadline:
        time.sleep(0.05)


def exited(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def open_hosts(mode: str, count: int):
    """The drill's hosts: `local` or `netns` with `count` nodes."""
    if mode not in HOSTS_MODES:
        raise ConfigError("--hosts", f"unknown hosts mode {mode!r}", f"one of {HOSTS_MODES}")
    return NetnsHosts(count) if mode == "netns" else LocalHosts()
