"""Fault injection for tests, chaos runs and users' own drills.

A fault (config's `FaultSpec`: kind, rank, step, section, seconds, mode,
generation, replacement) fires on its rank as the training loop enters its
section of its step. A `fault_injected` event is written before it acts, and
each fires once per run directory; `generation` holds it back until that many
restarts, `replacement` until a live replacement's process runs the rank.
docs/fault-tolerance.md ("Injected faults", "How a fault fires") lists the
kinds and what each does."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import psutil
import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.local.store import DATA, NodeStore
from megaresil.compat import spin_cuda_kernel
from megaresil.config import (
    STEP_FAULT_KINDS,
    ConfigError,
    FaultKind,
    FaultSpec,
    HangMode,
    parse_fault,
    parse_faults,
)
from megaresil.errors import MegaresilError
from megaresil.events import EventLog, read_events
from megaresil.resilience.step_faults import StepFaults

# A fault as the recipe writes it (drills build these) or as the schema types it.
FaultLike = Union[FaultSpec, Mapping[str, Any]]


def check_device_faults(faults: Iterable[FaultLike], gpus: int) -> None:
    """A device hang needs a kernel to hang on: refuse it before any worker starts
    (`megaresil train` and `chaos` call it)."""
    device_hangs = [i for i, f in enumerate(parse_faults(faults)) if f.mode == HangMode.device]
    if device_hangs and gpus == 0:
        raise ConfigError(f"faults[{device_hangs[0]}].mode", "device hangs a CUDA kernel and "
                          "this node sees no GPU.", "use mode: native (or sleep) on a CPU machine.")


def check_fault_ranks(faults: Iterable[FaultLike], world: int) -> None:
    """A fault on a rank the job does not have would never fire: a drill that
    tests nothing. Checked by the launcher against the world it starts, not
    by the recipe's validation, which also runs when an elastic job re-forms
    smaller (a fault aimed at a lost node's rank has done its work then)."""
    for i, fault in enumerate(parse_faults(faults)):
        if fault.rank >= world:
            raise ConfigError(f"faults[{i}].rank", f"{fault.rank} is not a rank of this job "
                              f"(tp*pp*dp = {world}: ranks 0..{world - 1}).",
                              f"give a rank below {world}.")


def fault_id(fault: FaultLike) -> str:
    """The name a `fault_injected` event records, which keeps it from firing twice."""
    spec = parse_fault(fault, "faults")
    name = f"{spec.kind.value}@rank{spec.rank}/step{spec.step}/{spec.fires_in}"
    name += "" if spec.generation is None else f"/gen{spec.generation}"
    return name + ("/replacement" if spec.replacement else "")


class FaultInjector:
    """Fires this rank's faults (recipe mappings or `FaultSpec`s) as the loop
    enters their sections."""

    def __init__(self, faults: Iterable[FaultLike], *, rank: int, run_dir: Path,
                 checkpoint_root: Path, events: EventLog, local_node_dir: Optional[Path] = None,
                 replacement: bool = False):
        # Rank 0 records a restart before the rendezvous of the generation it
        # starts, so every rank counts the same restarts here.
        history = read_events(run_dir)
        fired = {e.get("fault") for e in history if e["event"] == "fault_injected"}
        restarts = sum(e["event"] == "restart" for e in history)
        specs = parse_faults(faults)
        mine = [f for f in specs if f.rank == rank and fault_id(f) not in fired
                and f.restarts_needed <= restarts and (replacement or not f.replacement)]
        # The faults on a step's numbers fire where the trainer asks
        # (`step_faults`), not at a section's start.
        self.pending = [f for f in mine if f.kind not in STEP_FAULT_KINDS]
        self.numeric_faults = [f for f in mine if f.kind in STEP_FAULT_KINDS]
        # Persistent NaN faults by the first sample of the batch they hit.
        self.bad_batches: dict[int, FaultSpec] = {}
        self.lasting: list[FaultSpec] = []  # spikes with `steps`, once fired
        self.slow_seconds = 0.0
        self.events, self.checkpoint_root = events, checkpoint_root
        # None when the local tier is off (config refuses local faults then).
        self.rank, self.local_node_dir = rank, local_node_dir
        # Every rank takes part in creating the group a collective hang blocks
        # on; afterwards only the faulty rank ever enters it.
        wants_group = any(f.kind == FaultKind.hang and f.mode == HangMode.collective
                          for f in specs)
        self.hang_group = (dist.new_group(backend="gloo")
                           if wants_group and dist.is_initialized() else None)
        self.actions: dict[FaultKind, Callable[[FaultSpec], object]] = {
            FaultKind.kill: lambda f: os.kill(os.getpid(), signal.SIGKILL),
            FaultKind.raise_: self._raise,
            FaultKind.hang: lambda f: hang(f.hang_mode, self.hang_group),
            FaultKind.slow: self._slow_down,
            FaultKind.sigterm: lambda f: os.kill(os.getpid(), signal.SIGTERM),
            FaultKind.corrupt_checkpoint: lambda f: corrupt_newest(self.checkpoint_root),
            FaultKind.corrupt_local_checkpoint: self._corrupt_local,
            FaultKind.lose_local_node: lambda f: lose_node(self._node_dir()),
        }

    def on_section(self, section: str, step: int) -> None:
        """Called as the loop enters a section; fires the faults due there."""
        if self.slow_seconds and section == "data":
            compute_for(self.slow_seconds)
        for fault in list(self.pending):
            if fault.step == step and fault.fires_in == section:
                self.pending.remove(fault)
                self.announce(fault, step)
                self.actions[fault.kind](fault)

    def step_faults(self, step: int, position: int) -> StepFaults:
        """The faults due in this attempt of `step`, on the global batch
        starting at sample `position`: each once, on the first attempt of its
        step, except a persistent NaN, which hits every attempt of the batch
        it first hit (skipping that batch is the cure), and a spike with
        `steps`, which hits every attempt of its steps, whatever the batch
        (no skip cures it)."""
        due = [f for f in self.numeric_faults if f.step == step]
        for fault in due:
            self.numeric_faults.remove(fault)
            if fault.every_attempt:
                self.bad_batches[position] = fault
            if fault.steps is not None:
                self.lasting.append(fault)
        # Bit flips and router NaNs say what they hit when they hit it.
        announced = [f for f in due if f.kind not in (FaultKind.bitflip, FaultKind.router_nan)]
        for fault in announced:
            self.announce(fault, step, persistent=fault.every_attempt)
        if position in self.bad_batches and self.bad_batches[position] not in due:
            due.append(self.bad_batches[position])
        due += [f for f in self.lasting if f.lasts_at(step) and f not in due]
        return StepFaults(due, lambda fault, **details: self.announce(fault, step, **details))

    def announce(self, fault: FaultSpec, step: int, **details) -> None:
        self.events.emit("fault_injected", fault=fault_id(fault), kind=fault.kind.value,
                         step=step, section=fault.fires_in, **details)

    def _raise(self, fault: FaultSpec) -> None:
        raise InjectedFault(f"injected exception ({fault_id(fault)})")

    def _slow_down(self, fault: FaultSpec) -> None:
        self.slow_seconds = fault.slow_seconds
        compute_for(self.slow_seconds)

    def _node_dir(self) -> Path:
        """The node's local directory, for the faults on the local tier."""
        assert self.local_node_dir is not None  # config refuses them without a local tier
        return self.local_node_dir

    def _corrupt_local(self, fault: FaultSpec) -> None:
        for shard in own_local_shards(self._node_dir(), self.rank):
            try:
                flip_middle_byte(shard / DATA)
            except FileNotFoundError:
                pass  # retired by retention meanwhile: nothing left to damage


# Run apart from the workers: wait for the given processes to end, then
# delete the directory (argv: directory, timeout, pids). A zombie has ended
# (it holds no file and writes nothing) though its parent has not reaped it
# yet, so it counts as gone: waiting on it would wait out the timeout.
DELETE_AFTER = """
import shutil, sys, time, psutil
def running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
pids = [int(p) for p in sys.argv[3:]]
deadline = time.monotonic() + float(sys.argv[2])
while any(running(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""
SIBLINGS_STOP_S = 30.0  # the launcher stops a dead worker's siblings within a few seconds


def lose_node(node_dir: Path) -> None:
    """Kill this worker and delete its node's local directory once it and its
    sibling workers (the node's other ranks, which the launcher stops after a
    death) are gone, so no save they had in flight writes anything back: the
    node comes back empty, as a replaced machine would."""
    parent = psutil.Process().parent()
    pids = [str(p.pid) for p in (parent.children() if parent else []) if is_worker(p)]
    pids = pids or [str(os.getpid())]
    subprocess.Popen([sys.executable, "-c", DELETE_AFTER, str(node_dir), str(SIBLINGS_STOP_S),
                      *pids], start_new_session=True)
    os.kill(os.getpid(), signal.SIGKILL)


def is_worker(proc: psutil.Process) -> bool:
    """A training worker (TorchElastic gives each its LOCAL_RANK), not another
    child of the same parent, such as multiprocessing's resource tracker,
    which lives as long as its parent and would be waited on in vain."""
    try:
        return "LOCAL_RANK" in proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


DEVICE_HANG_CYCLES = 2**62  # GPU clock cycles: centuries at any clock rate


class InjectedFault(MegaresilError, RuntimeError):
    pass


def compute_for(seconds: float) -> None:
    """Keep the CPU busy: a slow rank computes (a sleeping one looks stuck
    to the watchdog, which tells them apart by the thread's CPU time)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(10_000))


def hang(mode: HangMode, group: Optional[dist.ProcessGroup]) -> None:
    """Block forever: in Python (sleep), inside a collective nobody else joins
    (collective), in C code that holds the GIL (gil), in C code that released
    it (native), or on a CUDA kernel that never ends (device)."""
    if mode == HangMode.collective and group is not None:
        dist.barrier(group=group)  # peers never arrive
    if mode == HangMode.gil:
        # libc sleep through PyDLL keeps the GIL: no other thread of this process runs.
        ctypes.PyDLL(None).sleep(10**6)
    if mode == HangMode.native:
        # Through CDLL the GIL is released: the monitor runs, but no exception
        # raised in this thread is seen until the call returns.
        ctypes.CDLL(None).sleep(10**6)
    if mode == HangMode.device:
        # The host thread waits in a synchronize (spinning, so it looks busy).
        spin_cuda_kernel(DEVICE_HANG_CYCLES)
        torch.cuda.synchronize()
    while True:  # short sleeps, so an asynchronous exception can get in
        time.sleep(0.05)


def corrupt_newest(root: Path) -> Optional[Path]:
    """Flip bytes in the newest committed checkpoint's largest data file."""
    checkpoints = fmt.committed_checkpoints(root)
    if not checkpoints:
        return None
    files = [p for p in checkpoints[0].rglob("*") if p.is_file()
             and p.name not in (fmt.MANIFEST, fmt.MARKER, ".metadata", "zarr.json")]
    target = max(files, key=lambda p: p.stat().st_size)
    flip_middle_byte(target)
    return target


def own_local_shards(node_dir: Path, rank: int) -> list[Path]:
    """This rank's own committed local shards in its node's directory."""
    store = NodeStore(node_dir)
    return [d for step, owners in store.held().items() if rank in owners
            and ((d := store.shard_dir(step, rank)) / fmt.MARKER).exists()]


def flip_middle_byte(target: Path) -> None:
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
