"""What the watchdog reads of its own process: the training thread's CPU
clock and where it waits, the bytes its peer connections move, and the kind
of machine a calibration holds on."""
from __future__ import annotations

import fcntl
import os
import platform
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from megaresil.safe_files import private_dir

TORCH_DISTRIBUTED = os.path.dirname(dist.__file__)


def thread_cpu_clock(thread_id: int) -> Callable[[], float]:
    """CPU seconds used by one thread of this process (process CPU time where
    the platform has no per-thread clock)."""
    try:
        clock = time.pthread_getcpuclockid(thread_id)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return time.process_time
    return lambda: time.clock_gettime(clock)


def waiting_in_torch_distributed(thread_id: int) -> bool:
    """Whether the thread's innermost Python frame is torch.distributed's: it
    waits there on its peers (a collective, a group's creation, the store)."""
    frame = sys._current_frames().get(thread_id)
    return frame is not None and TORCH_DISTRIBUTED in frame.f_code.co_filename


# struct tcp_info (linux/tcp.h): tcpi_bytes_acked and tcpi_bytes_received, two
# u64 at byte 120, there since Linux 4.1 and 4.2.
TCP_INFO_BYTES = struct.Struct("=QQ")
TCP_INFO_BYTES_AT = 120
TCP_INFO_LEN = TCP_INFO_BYTES_AT + TCP_INFO_BYTES.size


def peer_bytes_counter(store_port: int | None) -> Callable[[], int]:
    """Bytes acknowledged by and received from the peers of this process's
    TCP connections, the store's (port `store_port`, at either end) left out: what a
    rank waiting in a gloo collective over a slow link still moves, and one
    cut off or waiting for a hung peer does not. Read from each socket's
    TCP_INFO through a duplicate of its descriptor (torch does not expose
    gloo's sockets); 0 where /proc is missing. NCCL's traffic (InfiniBand,
    NVLink) is not seen."""
    def count() -> int:
        total = 0
        for fd in socket_fds():
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if sock.type != socket.SOCK_STREAM or sock.family not in (
                            socket.AF_INET, socket.AF_INET6):
                        continue
                    if store_port in (sock.getpeername()[1], sock.getsockname()[1]):
                        continue  # the store's, as its client or (on its host) its server
                    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
            except OSError:  # closed meanwhile, not connected, not TCP
                continue
            if len(info) == TCP_INFO_LEN:
                total += sum(TCP_INFO_BYTES.unpack_from(info, TCP_INFO_BYTES_AT))
        return total
    return count


class NodeTraffic:
    """The bytes this job's ranks on this node move to their peers: each
    rank's own count (peer_bytes_counter) in its slot of one node-local file
    (`path`, node_traffic_path), summed. On a congested link one rank's own
    sockets can idle for seconds (a flow backing off after drops) while its
    node-mates' transfers keep the link busy; a node whose ranks all wait on
    a hung peer moves nothing. Without `path` (no /dev/shm), the rank's own
    count.

    The file lies in a directory of this user's own (safe_files.private_dir):
    its name is predictable, and /dev/shm is every user's. Each rank holds a
    shared lock on it while it counts (the kernel drops it when the process
    dies, however): close() removes the file when no other rank holds it,
    and a rank opening one first removes the files that no process holds,
    left by jobs killed before they could."""
    SLOT = struct.Struct("=Q")
    OPEN_ATTEMPTS = 10  # a file removed between our open and our lock is opened again

    def __init__(self, own: Callable[[], int], path: Path | None, local_rank: int):
        self.own, self.path, self.offset = own, path, local_rank * self.SLOT.size
        self.fd = None
        if path is not None:
            try:
                remove_unheld(private_dir(path.parent))
                self.fd = self._open_held(path)
            except OSError as err:
                self.path = None
                if local_rank == 0:  # once per node
                    print(f"megaresil: warning: the watchdog counts each rank's own traffic, "
                          f"not its node's: {err}", file=sys.stderr, flush=True)

    def _open_held(self, path: Path) -> int:
        """A descriptor of `path` (made 0600, never through a link) under
        a shared lock, the file still in place once the lock is held."""
        for _ in range(self.OPEN_ATTEMPTS):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if same_file(fd, path):
                return fd
            os.close(fd)  # another rank removed it as unheld before we locked it
        raise OSError(f"{path} kept being removed while opened")

    def __call__(self) -> int:
        value = self.own()
        if self.fd is None:
            return value
        os.pwrite(self.fd, self.SLOT.pack(value), self.offset)
        data = os.pread(self.fd, 1 << 16, 0)
        return sum(self.SLOT.unpack_from(data, at)[0]
                   for at in range(0, len(data) - self.SLOT.size + 1, self.SLOT.size))

    def close(self) -> None:
        if self.fd is None:
            return
        assert self.path is not None  # a file was opened: its path stands
        os.pwrite(self.fd, self.SLOT.pack(0), self.offset)
        remove_if_unheld(self.fd, self.path)
        os.close(self.fd)
        self.fd = None


def same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def remove_if_unheld(fd: int, path: Path) -> None:
    """Remove `path` (open as `fd`) when no other process holds a lock on it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # a node-mate still counts in it
    if same_file(fd, path):
        Path(path).unlink()


def remove_unheld(directory: Path) -> None:
    """Remove the traffic files in `directory` that no process holds."""
    for path in directory.glob("traffic-*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # removed meanwhile, or a link: not one of ours
        try:
            remove_if_unheld(fd, path)
        finally:
            os.close(fd)


def node_traffic_path(store_port: int | None, node_rank: int) -> Path | None:
    """The node-local file of a job's NodeTraffic (one per launch store and
    node: simulated nodes share one /dev/shm), in this user's directory
    there; None where there is no /dev/shm."""
    shm = Path("/dev/shm")
    return (shm / f"megaresil-{os.getuid()}" / f"traffic-{store_port}-{node_rank}"
            if store_port and shm.is_dir() else None)


def socket_fds() -> list[int]:
    fds: list[int] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.append(int(name))
        except OSError:
            continue
    return fds


def machine_kind() -> dict:
    """What a section's duration depends on besides the workload. The host
    name is not part of it: a relaunch onto other nodes of the same kind
    keeps its budgets."""
    cpu_model = platform.processor()
    try:
        cpu_model = next(line.split(":", 1)[1].strip() for line in
                         Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu_model, "cores": len(os.sched_getaffinity(0)),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
