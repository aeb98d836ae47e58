"""Where a drill's nodes run: all on this machine as plain processes
(`local`, the default), or each in namespaces of its own (`netns`): a network
namespace with its own address on a bridge (through a veth pair), a UTS
namespace with its own hostname and a mount namespace with its own /dev/shm
(so its local checkpoint tier) and /etc/hosts, the run directory shared.
Agents then meet over the bridge, the local tier's replicas (when it is on)
cross a real link, and a lost node takes its /dev/shm with it. Namespaces
need root, iproute2's `ip` and util-linux (docs/fault-tolerance.md)."""
# mypy: ignore-errors
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
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
# A node's first process, in its new mount and UTS namespaces: its hostname, a
# /dev/shm and /etc/hosts of its own (the hosts file names every node, as a
# cluster's DNS would: gloo finds a node's address from its hostname), then it
# sleeps, holding the namespaces (and the /dev/shm) for the node's lifetime.
NODE_INIT = ('hostname "$1" && mount -t tmpfs tmpfs /dev/shm && mount --bind "$2" /etc/hosts '
             '&& echo ready && exec sleep infinity')


def netns_missing_reason() -> Optional[str]:
    """Why nodes cannot run in namespaces here, or None when they can."""
    if os.geteuid() != 0:
        return "netns needs root (it makes network and mount namespaces): run as root, as CI does"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if not shutil.which(tool)]
    if missing:
        return (f"netns needs {' and '.join(missing)}: install iproute2 and util-linux "
                "(`make cluster-deps` does, as root)")
    return None


class LocalHosts:
    """Every node a plain process tree on this machine, meeting on loopback
    (today's drills)."""
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

    def start(self, node: int, command: list[str], **popen) -> subprocess.Popen:
        self.procs[node] = subprocess.Popen(command, **popen)
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
    procs: list[subprocess.Popen]  # the node's init first, then what was started on it


class NetnsHosts:
    """Nodes in namespaces of their own on a bridge (see the module
    docstring). Everything it creates is named after `prefix` and removed by
    close(), also when setting up fails part way or the drill is stopped
    (Ctrl-C, SIGTERM)."""
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
        self.slots = 0  # addresses handed out
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.saved_sigterm = None
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
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a CI timeout, `timeout`) unwinds like Ctrl-C, through close().
            self.saved_sigterm = signal.signal(signal.SIGTERM, stop_on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.saved_sigterm is not None:
            signal.signal(signal.SIGTERM, self.saved_sigterm)

    def address_of_host(self) -> str:
        """The bridge's address: the host seen from the nodes."""
        return f"{self.subnet}.254"

    def address(self, node: int) -> str:
        return self.nodes[node].address

    def hostname(self, node: int) -> str:
        return self.nodes[node].hostname

    def rendezvous_endpoint(self) -> str:
        return f"{self.address(0)}:{RENDEZVOUS_PORT}"

    def node_options(self, node: int) -> list[str]:
        """`megaresil train` options of the node's agent: its stores and
        workers on its own address."""
        return ["--local-addr", self.address(node)]

    def add(self, node: int) -> None:
        """Node `node` on the bridge: a namespace, a veth pair, an address,
        its init process."""
        self.slots += 1
        name = f"{self.prefix}n{self.slots}"
        n = self.nodes[node] = Node(name, f"{self.prefix}-node{node}",
                                    f"{self.subnet}.{self.slots}", f"{name}h", [])
        ip("netns", "add", name)
        ip("link", "add", n.host_link, "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("link", "set", n.host_link, "master", self.bridge, "up")
        ip("-n", name, "addr", "add", f"{n.address}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "link", "set", "lo", "up")
        self.write_hosts_file()
        init = subprocess.Popen(["ip", "netns", "exec", name, "unshare", "--mount", "--uts",
                                 "--propagation", "private", "--", "sh", "-c", NODE_INIT,
                                 "node", n.hostname, str(self.dir / "hosts")],
                                stdout=subprocess.PIPE, text=True)
        n.procs.append(init)
        if init.stdout.readline().strip() != "ready":
            raise RuntimeError(f"node {node}: its namespaces could not be set up "
                               f"(exit code {init.wait()})")
        init.stdout.close()

    def write_hosts_file(self) -> None:
        """Every node's name and address. Written in place: the nodes
        bind-mount this very file, so a replacement's name reaches them."""
        lines = [f"{LOOPBACK} localhost", *(f"{n.address} {n.hostname}"
                                            for n in self.nodes.values())]
        with open(self.dir / "hosts", "w") as f:
            f.write("\n".join(lines) + "\n")

    def command(self, node: int, command: list[str]) -> list[str]:
        """`command` as run on the node: in its init's namespaces, in this
        directory (the run directory and recipes are shared)."""
        init = self.nodes[node].procs[0]
        # The directory is entered inside the node's mount namespace (env
        # --chdir), not by nsenter --wd: that one stays on this namespace's
        # mount, so a rename between a relative and an absolute path in it
        # failed with EXDEV (two mounts of one filesystem).
        return ["nsenter", f"--target={init.pid}", "--net", "--mount", "--uts", "--",
                "env", f"--chdir={os.getcwd()}", *command]

    def start(self, node: int, command: list[str], **popen) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(node, command), **popen)
        self.nodes[node].procs.append(proc)
        return proc

    def cut(self, node: int) -> None:
        """A partition: the node's link goes down (a pulled cable, a dead
        switch port). Its processes live on and still see the shared disk;
        what they send is lost, so their connections stall without a reset."""
        ip("link", "set", self.nodes[node].host_link, "down")

    def heal(self, node: int) -> None:
        """The link back up (after cut or cap): stalled connections resume
        at their next retransmission."""
        n = self.nodes[node]
        ip("link", "set", n.host_link, "up")
        tc("qdisc", "del", "dev", n.host_link, "root", check=False)  # no cap: nothing to delete
        tc("qdisc", "del", "dev", "eth0", "root", netns=n.namespace, check=False)

    def cap(self, node: int, rate: str) -> None:
        """A slow link: a `tbf` bandwidth cap (`rate` as tc writes it, e.g.
        `8mbit`) on both directions of the node's link. The `netem` qdisc,
        which would add delay or loss, is not available on these kernels."""
        shape = ["root", "tbf", "rate", rate, "burst", "32kb", "latency", "400ms"]
        tc("qdisc", "add", "dev", self.nodes[node].host_link, *shape)
        tc("qdisc", "add", "dev", "eth0", *shape, netns=self.nodes[node].namespace)

    def link_bytes(self, node: int) -> tuple[int, int]:
        """Bytes the node has sent and received over its link so far (read
        on the bridge's end: what the node receives, it transmits)."""
        stats = Path("/sys/class/net", self.nodes[node].host_link, "statistics")
        return (int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))

    def pids(self, node: int) -> list[int]:
        """The processes running on the node."""
        out = ip("netns", "pids", self.nodes[node].namespace, check=False)
        return [int(pid) for pid in out.split()]

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
        n = self.nodes.pop(node)
        for started in n.procs:
            started.kill()  # one that had not entered the namespace yet
            started.wait()
        wait_gone(procs)
        ip("netns", "del", n.namespace, check=False)
        ip("link", "del", n.host_link, check=False)  # gone with the namespace, normally

    def close(self) -> None:
        """Remove every node, the bridge and the hosts file (idempotent)."""
        for node in list(self.nodes):
            self.lose(node)
        ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


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


def tc(*args: str, netns: Optional[str] = None, check: bool = True) -> None:
    """iproute2's `tc`, in the namespace `netns` when given."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    result = subprocess.run([*prefix, "tc", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {result.stderr.strip()}")


def open_hosts(mode: str, count: int):
    """The drill's hosts: `local` or `netns` with `count` nodes."""
    if mode not in HOSTS_MODES:
        raise ConfigError("--hosts", f"unknown hosts mode {mode!r}", f"one of {HOSTS_MODES}")
    return NetnsHosts(count) if mode == "netns" else LocalHosts()
