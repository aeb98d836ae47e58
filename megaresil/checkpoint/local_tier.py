"""The node-local checkpoint tier: frequent saves to fast node-local storage,
each rank's shard copied to peers on other nodes, so a killed rank or a lost
node costs at most the steps since the last local save.

    LOCAL_ROOT/                     checkpoint.local.dir (/dev/shm/megaresil/<run id>)
      node_<k>/                     one node's storage (simulated nodes each get one)
        step_0000012/
          rank_00003/               rank 3's shard at step 12 (its own, or a replica)
            data.bin                every tensor of the rank's state, back to back
            meta.json               step, layout, run state, RNG, each tensor's place + checksum
            COMMITTED               last thing written
          rank_00003.partial/       a write in progress (or one that died): never read

A shard is the rank's whole state at the step (every rect it holds, the
tied-embedding copy included), so a same-layout resume copies bytes back
with no resharding and is bit-exact. A shard is written under its `.partial`
name and renamed into place, then marked: a step counts only where the
owner's shard, or a replica of it, is committed and passes its checksums.
When the world changes shape (elastic shrink) the shards do not fit: the
restart takes the global tier, which reshards (checkpointing.resume).

Threads and groups as in manager.py: staging, writing, replication and the
start-up collectives run on the tier's own thread over its own process
group, never the training thread's nor the global checkpointer's.

Storage: files in /dev/shm, not a helper process's memory. They outlive a
killed or relaunched worker with no process to keep alive and no second
failure domain, cost no disk I/O, and die with the node, which is what the
replicas are for. Nothing is written under the global checkpoint root.

Full storage (a 64 MB Docker /dev/shm): the tier is optional, so it never
costs the run. At start-up it stays off for the run when one save cannot fit
in the free space; a save that fails to write (ENOSPC or any OSError) on any
rank is removed on every rank, and every rank pauses the tier until the same
step, agreed by the save's own collective, then retries (see Pause).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.compat import detach_process_group
from megaresil.checkpoint.manager import (Collectives, SaveReport, dtype_name, save_thread_setup,
                                          wait_for)
from megaresil.checkpoint.replication import (Choice, Holdings, Space, Topology, complete_step,
                                              decode_meta, encode_meta, header, space_shortfall,
                                              transfers)
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.staging import StagingCopy
from megaresil.checkpoint.state import RunState, TrainingState, training_rects
from megaresil.safe_files import own_dir

SHARD_FORMAT = "megaresil-local-shard"
DATA, META = "data.bin", "meta.json"
RANK_DIR = re.compile(r"^rank_(\d{5,})$")
BUDGET = 0.05  # the share of a step a local save may hold the loop for (interval 0)
DIR_KEY = "checkpoint.local.dir"  # what the tier's messages tell a user to point elsewhere
RETRY_FIRST_S, RETRY_MAX_S = 60.0, 1800.0  # a paused tier's back-off: doubling, capped
SHARD_SLACK = 64 * 1024  # a shard's bytes on disk beyond data.bin and meta.json (marker, blocks)


def local_root(local_dir: Optional[str], run_dir: str) -> Path:
    """checkpoint.local.dir, or its default for the run directory."""
    return Path(local_dir) if local_dir else default_root(run_dir)


def default_root(run_dir: str) -> Path:
    """/dev/shm/megaresil/<run id>: the run id is the run directory's name and
    a digest of its path, the same at every launch (a requeued job finds its
    shards) and different for every run directory."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    run = Path(run_dir).resolve()
    return base / "megaresil" / f"{run.name}-{hashlib.sha1(str(run).encode()).hexdigest()[:10]}"


def node_dir(root: Path, node: int) -> Path:
    """One node's directory under the local root."""
    return root / f"node_{node}"


def newest_complete_step(root: Path, world: int) -> Optional[int]:
    """The newest local step with a committed shard of every rank (its own
    or a replica) in the node directories visible here: the step a restart
    will try first (checksums are verified then, by every rank)."""
    owners: dict[int, set] = {}
    for node in root.glob("node_*"):
        store = NodeStore(node)
        for step, held in store.held().items():
            owners.setdefault(step, set()).update(
                o for o in held if (store.shard_dir(step, o) / fmt.MARKER).exists())
    return max((s for s, held in owners.items() if held >= set(range(world))), default=None)


def rank_dir_name(rank: int) -> str:
    return f"rank_{rank:05d}"


# --- a shard in memory -----------------------------------------------------------------

@dataclass
class Shard:
    meta: dict  # SHARD_FORMAT's fields: step, owner, world, layout, run, rank_state, rects
    data: torch.Tensor  # flat uint8: every rect's bytes at its record's `start`

    @property
    def step(self) -> int:
        return self.meta["step"]

    @property
    def owner(self) -> int:
        return self.meta["owner"]


def stage(rects: list[Rect], buffer: Optional[torch.Tensor],
          copy: Optional[StagingCopy] = None) -> tuple[torch.Tensor, list[dict]]:
    """Copy `rects` back to back into `buffer` (reused when it fits) by
    `copy` (enqueued on a GPU: see StagingCopy); returns the buffer and each
    rect's record (checksums come later)."""
    copy = copy or StagingCopy.of([r.tensor for r in rects])
    records, size = rect_records(rects)
    if buffer is None or buffer.numel() != size:
        buffer = copy.host_empty((size,), torch.uint8)
    copy.into([view_of(buffer, rec) for rec in records], [r.tensor for r in rects])
    return buffer, records


def rect_records(rects: list[Rect]) -> tuple[list[dict], int]:
    """Each rect's record, back to back from byte 0, and the bytes of all."""
    records, start = [], 0
    for r in rects:
        records.append({"key": r.key, "global_shape": list(r.global_shape),
                        "offset": list(r.offset), "shape": list(r.shape),
                        "dtype": dtype_name(r.tensor), "start": start, "nbytes": r.nbytes})
        start += r.nbytes
    return records, start


def shard_meta(run: RunState, owner: int, world: int, rng: dict, records: list[dict]) -> dict:
    """A shard's meta.json (its records' checksums added once staged)."""
    return {"format": SHARD_FORMAT, "version": 1, "step": run.step, "owner": owner,
            "world": world, "layout": run.layout, "run": run.to_manifest(),
            "rank_state": rng, "rects": records}


def shard_bytes(state: TrainingState, owner: int, world: int) -> int:
    """What one shard of `state` takes in the local tier's storage."""
    records, size = rect_records(training_rects(state, include_copies=True))
    for rec in records:
        rec["checksum"] = "0" * 16  # an xxh3-64 digest's length
    meta = shard_meta(state.run_state(), owner, world, state.rng_state(), records)
    return size + len(json.dumps(meta, indent=1)) + SHARD_SLACK  # as write_json_atomic writes it


def filesystem_space(directory: Path) -> tuple[str, int]:
    """The filesystem `directory` is (or will be) on, by host and device,
    and its bytes free to this user."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    stats = os.statvfs(existing)
    return f"{socket.gethostname()}:{os.stat(existing).st_dev}", stats.f_bavail * stats.f_frsize


def view_of(data: torch.Tensor, record: dict) -> torch.Tensor:
    """The tensor a record describes, as a view into a shard's bytes."""
    raw = data[record["start"]: record["start"] + record["nbytes"]]
    return raw.view(fmt.torch_dtype(record["dtype"])).view(record["shape"])


def add_checksums(data: torch.Tensor, records: list[dict]) -> None:
    for rec in records:
        rec["checksum"] = fmt.checksum(data[rec["start"]: rec["start"] + rec["nbytes"]])


def shard_problem(shard: Shard) -> Optional[str]:
    """None when the shard's bytes match its checksums, else why not."""
    size = sum(rec["nbytes"] for rec in shard.meta["rects"])
    if shard.data.numel() != size:
        return f"holds {shard.data.numel()} bytes, its manifest says {size}"
    for rec in shard.meta["rects"]:
        if fmt.checksum(shard.data[rec["start"]: rec["start"] + rec["nbytes"]]) != rec["checksum"]:
            return f"checksum mismatch in {rec['key']} at offset {tuple(rec['offset'])}"
    return None


def check_meta(meta: dict) -> None:
    """Everything a recovery reads from a shard's meta.json, present and of
    the right kinds (its bytes are checked against the marker's digest
    first; this catches a shard written wrong, or without a digest)."""
    world = fmt.need_field(meta, "world", int, lambda v: v > 0)
    fmt.need_field(meta, "owner", int, lambda v: 0 <= v < world)
    fmt.need_field(meta, "layout", dict)
    fmt.need_field(meta, "rank_state", dict)
    fmt.check_run_fields(fmt.need_field(meta, "run", dict))
    start = 0
    for rec in fmt.need_field(meta, "rects", list):
        fmt.need_field(rec, "key", str)
        fmt.need_field(rec, "checksum", str)
        shape = fmt.checked_shape(rec.get("shape"), "a rect's shape")
        fmt.checked_shape(rec.get("offset"), "a rect's offset", len(shape))
        if fmt.need_field(rec, "start", int) != start or fmt.need_field(rec, "nbytes", int) != \
                fmt.region_bytes(shape, rec.get("dtype")):
            raise fmt.CheckpointError(f"rect {rec['key']!r}: its start or size does not match "
                                      "its place and shape")
        start += rec["nbytes"]


def unpack_into(shard: Shard, targets: list[Rect]) -> None:
    """Fill this rank's `targets` from its own shard, matched by identity."""
    saved = {(rec["key"], tuple(rec["offset"]), tuple(rec["shape"])): rec
             for rec in shard.meta["rects"]}
    wanted = {t.identity() for t in targets}
    if wanted != set(saved):
        differ = sorted(str(i[0]) for i in wanted ^ set(saved))
        raise fmt.CheckpointError(f"the local shard of rank {shard.owner} at step {shard.step} "
                                  f"does not hold this rank's tensors ({', '.join(differ[:4])}); "
                                  "Fix: set checkpoint.local.enabled=false for this restart")
    with torch.no_grad():
        for t in targets:
            t.tensor.copy_(view_of(shard.data, saved[t.identity()]))


def saved_run_state(shard: Shard) -> RunState:
    """The shard's run state, its owner's RNG state placed at the owner's
    rank (the only one a rank restores)."""
    saved = RunState.from_manifest(shard.meta["run"])
    saved.rank_states = [None] * shard.meta["world"]
    saved.rank_states[shard.owner] = shard.meta["rank_state"]
    return saved


# --- one node's directory --------------------------------------------------------------

class NodeStore:
    """One node's local directory (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = root

    def shard_dir(self, step: int, owner: int) -> Path:
        return self.root / fmt.step_dir_name(step) / rank_dir_name(owner)

    def write(self, shard: Shard) -> None:
        final = self.shard_dir(shard.step, shard.owner)
        partial = final.with_name(final.name + ".partial")
        with fmt.naming_write_errors(partial, DIR_KEY):
            for directory in (self.root, final.parent):  # in /dev/shm: anyone may plant a link
                own_dir(directory)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            self.write_data(partial / DATA, shard.data)
            digest = fmt.write_json_atomic(partial / META, shard.meta)
            if final.exists():  # the step saved again after a restart: same state
                shutil.rmtree(final)
            partial.rename(final)
            fmt.fsync_path(final.parent)
            fmt.write_marker(final, {META: digest})

    def write_data(self, path: Path, data: torch.Tensor) -> None:
        """A shard's data.bin, durable before its meta.json names it."""
        with open(path, "wb") as f:
            f.write(memoryview(data.numpy()))
            f.flush()
            os.fsync(f.fileno())

    def read_meta(self, step: int, owner: int) -> dict:
        directory = self.shard_dir(step, owner)
        if not (directory / fmt.MARKER).exists():
            raise fmt.CheckpointError("its save did not finish (no marker)")
        meta = fmt.read_covered_json(directory, META)
        if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT \
                or meta.get("step") != step or meta.get("owner") != owner:
            raise fmt.CheckpointError(f"its {META} is not a local shard of rank {owner} at "
                                      f"step {step}")
        try:
            check_meta(meta)
        except fmt.CheckpointError as err:
            raise fmt.CheckpointError(f"{directory}/{META}: {err}") from None
        return meta

    def read(self, step: int, owner: int) -> Shard:
        meta = self.read_meta(step, owner)
        data = np.fromfile(self.shard_dir(step, owner) / DATA, dtype=np.uint8)
        return Shard(meta, torch.from_numpy(data))

    def held(self) -> dict[int, list[int]]:
        """{step: [owner ranks]} of the shard directories here (not validated)."""
        found: dict[int, list[int]] = {}
        for step_dir in fmt.committed_checkpoints(self.root):
            step = int(fmt.STEP_DIR.match(step_dir.name).group(1))
            try:
                names = [p.name for p in step_dir.iterdir()]
            except FileNotFoundError:
                continue  # retired meanwhile by another rank's retention
            found[step] = sorted(int(m.group(1)) for n in names if (m := RANK_DIR.match(n)))
        return found

    def report(self, layout: dict, world: int) -> Holdings:
        """What this node holds: each shard's problem, or None when it looks
        usable at this layout (checksums are verified later, for the step
        chosen)."""
        report: Holdings = {}
        for step, owners in self.held().items():
            for owner in owners:
                try:
                    meta = self.read_meta(step, owner)
                    problem = None if meta["layout"] == layout and meta["world"] == world else (
                        f"saved at another layout ({describe(meta['layout'])}, now "
                        f"{describe(layout)})")
                except fmt.CheckpointError as err:
                    problem = str(err)
                report.setdefault(step, {})[owner] = problem
        return report

    def remove(self, step: int, owners: list[int]) -> None:
        """Remove `owners`' shards at `step`, and the step once it is empty."""
        for owner in owners:
            for name in (rank_dir_name(owner), rank_dir_name(owner) + ".partial"):
                shutil.rmtree(self.root / fmt.step_dir_name(step) / name, ignore_errors=True)
        try:
            (self.root / fmt.step_dir_name(step)).rmdir()
        except OSError:
            pass  # other ranks' shards are still there (or it is gone)

    def retain(self, keep: int, owner: int, owners: list[int]) -> None:
        """Keep the newest `keep` steps of `owner`'s own shard; older steps
        lose the shards of `owners` (what this rank writes)."""
        steps = [s for s, held in self.held().items() if owner in held]
        for step in sorted(steps, reverse=True)[keep:]:
            self.remove(step, owners)

    def discard_after(self, step: int, owners: list[int]) -> None:
        """Shards of steps after the one resumed from: an abandoned future."""
        for later in [s for s in self.held() if s > step]:
            self.remove(later, owners)

    def clean_partials(self, owners: list[int]) -> None:
        """Remove what saves that died left of `owners`' shards: `.partial`
        directories and shards without their marker, which are never read
        and only fill the node's memory."""
        for step in self.held():
            for owner in owners:
                final = self.shard_dir(step, owner)
                shutil.rmtree(final.with_name(final.name + ".partial"), ignore_errors=True)
                if final.is_dir() and not (final / fmt.MARKER).exists():
                    shutil.rmtree(final, ignore_errors=True)
            self.remove(step, [])  # the step's directory, once nothing is left in it


def describe(layout: dict) -> str:
    return "x".join(f"{k}{layout.get(k)}" for k in ("tp", "pp", "dp"))


# --- when to save ----------------------------------------------------------------------

class Cadence:
    """When the local tier saves: every `interval` steps or, with interval 0,
    every step while a save holds the loop for at most BUDGET of a step, else
    the smallest interval that keeps it there (re-measured at every save).

    Every rank must save at the same steps (a save is collective), but each
    measures its own hold: a rank's measure is its proposal, the save's
    thread agrees on the largest (the slowest rank holds every rank's loop),
    and the next save applies it, once every rank has it."""

    def __init__(self, interval: int):
        self.fixed = interval
        self.every = max(1, interval)
        self.proposal = self.every  # this rank's measure, agreed on by the save in flight
        self.agreed: Optional[int] = None  # by every rank, at the last save
        self.last: Optional[int] = None  # step of the last save
        self.step_s: deque = deque(maxlen=16)  # recent step times, saves' holds left out
        self.ticked: Optional[float] = None
        self.held_since_tick = 0.0
        self.held_by_save = 0.0  # the loop's hold for the last save, so far

    def due(self, step: int) -> bool:
        """Called once per step, after it."""
        now = time.perf_counter()
        if self.ticked is not None:
            self.step_s.append(now - self.ticked - self.held_since_tick)
        self.ticked, self.held_since_tick = now, 0.0
        if self.fixed:
            return step % self.fixed == 0
        return self.last is None or step - self.last >= self.every

    def held(self, seconds: float) -> None:
        self.held_since_tick += seconds
        self.held_by_save += seconds

    def saving(self, step: int) -> None:
        """A save starts at `step`, after the previous one ended: the interval
        agreed then takes effect, and the previous save's hold, complete
        now, is this rank's next proposal."""
        if not self.fixed:
            self.every = self.agreed or self.every
            if self.last is not None and self.step_s:
                budget = BUDGET * self.step_seconds()
                self.proposal = (max(1, math.ceil(self.held_by_save / budget))
                                 if budget > 0 else 1)
        self.last, self.held_by_save = step, 0.0

    def agree(self, proposals: list[int]) -> None:
        """On the save's thread, with every rank's proposal."""
        self.agreed = max(proposals)

    def step_seconds(self) -> Optional[float]:
        """The median of the recent step times (None before one is measured)."""
        return statistics.median(self.step_s) if self.step_s else None


# --- when a save fails ----------------------------------------------------------------

@dataclass
class Pause:
    """The tier stopped saving: since which step, why, and the step from
    which it saves again (None: not in this run). Every rank holds the same
    Pause: a failed save's is agreed by the save's own collective, the
    start-up check's by its own; so no rank saves (and waits on a peer's
    replication) while another is paused."""
    step: int
    reason: str
    retry_at: Optional[int]
    failures: int = 1  # failed saves in a row

    def holds(self, step: int) -> bool:
        return self.retry_at is None or step < self.retry_at


def retry_step(step: int, failures: int, step_s: Optional[float]) -> tuple[int, float]:
    """Where a tier whose `failures`-th save in a row failed at `step` tries
    again, and after how long: RETRY_FIRST_S, doubled at each failure up to
    RETRY_MAX_S, in steps of `step_s` (with no step measured yet, the next
    step, whose failure then backs off by time)."""
    backoff = min(RETRY_FIRST_S * 2.0 ** min(failures - 1, 32), RETRY_MAX_S)
    return step + (max(1, math.ceil(backoff / step_s)) if step_s else 1), backoff


@dataclass
class Outcome:
    """One rank's side of a local save, gathered by every rank at its end."""
    bytes: int
    replica_bytes: int
    seconds: float
    replication_seconds: float
    proposal: int  # the interval this rank proposes (Cadence)
    problem: Optional[str]  # why this rank's writes failed, None when they did not
    retry_at: int  # the step this rank proposes to retry at, should any rank have failed
    retry_after_s: float


# --- the tier ----------------------------------------------------------------------------

@dataclass
class Found:
    """The local step chosen at start-up, and this rank's shard of it."""
    choice: Choice
    shard: Optional[Shard] = None  # this rank's, once `recover` has it
    path: Optional[Path] = None  # where the owner of rank 0's shard was read


class LocalTier:
    def __init__(self, root: Path, topology: Topology, *, group: Optional[dist.ProcessGroup],
                 interval: int, keep: int, events, device: torch.device):
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-local",
                                           initializer=save_thread_setup, initargs=(device,))
        self.device = device  # of the training state; the tier's thread works on it
        self.coll = Collectives(group, self.executor)
        self.topology, self.keep, self.events = topology, keep, events
        self.rank = self.coll.rank
        self.store = NodeStore(node_dir(root, topology.node_of(self.rank)))
        self.mine = [self.rank, *topology.sources(self.rank)]  # the shards this rank writes
        self.cadence = Cadence(interval)
        self.buffer: Optional[torch.Tensor] = None  # staging, reused by every save
        self.recv_buffers: dict[int, torch.Tensor] = {}
        self.pending: Optional[Future] = None
        self.staged: Optional[threading.Event] = None
        self.copy: Optional[StagingCopy] = None  # the staging copy in flight
        self.report: Optional[SaveReport] = None
        self.abandoned = False
        self.loaded: dict[int, Shard] = {}  # start-up: shards of the chosen step, by owner
        self.pause: Optional[Pause] = None  # set and cleared by saves' agreement (and start-up)

    # --- saving --------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.cadence.due(step)

    def save(self, state: TrainingState, step: int) -> None:
        """Start saving this rank's state after `step` as a local step:
        staged, written, replicated and committed on the tier's thread; the
        loop waits only for the staging copy, at its next optimizer step."""
        started = time.perf_counter()
        self.wait()  # after it, every rank knows the same pause
        if self.pause is not None and self.pause.holds(step):
            return
        self.cadence.saving(step)
        # The RNG is global to the process: read it here, before the next
        # step draws from it. The rest is read on the tier's thread before
        # the staging copy is done, which the next optimizer step awaits.
        rng = state.rng_state()
        self.staged, self.report = threading.Event(), SaveReport(self.events,
                                                                  "local_checkpoint_saved")
        self.copy = StagingCopy(self.device)
        failures = self.pause.failures + 1 if self.pause else 1
        retry = retry_step(step, failures, self.cadence.step_seconds())  # should this one fail
        self.pending = self.executor.submit(self._stage_write_replicate, [state], rng, started,
                                            self.copy, self.staged, self.report, retry)
        self._held(time.perf_counter() - started, self.report)

    def _held(self, seconds: float, report: SaveReport) -> None:
        report.loop_held(seconds)
        self.cadence.held(seconds)

    def before_update(self) -> None:
        """Before the optimizer changes the weights: the staging copy must be done."""
        if self.staged is None:
            return
        started = time.perf_counter()
        with self.report.loop_waiting():
            wait_for(self.staged)
        self.copy.order_before_update()
        self.cadence.held(time.perf_counter() - started)
        self.staged = self.report = self.copy = None

    def wait(self) -> None:
        self.before_update()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            started = time.perf_counter()
            wait_for(pending)
            self.cadence.held(time.perf_counter() - started)

    def _stage_write_replicate(self, holder: list[TrainingState], rng: dict, started: float,
                               copy: StagingCopy, staged: threading.Event,
                               report: SaveReport, retry: tuple[int, float]) -> None:
        # The state comes in a holder emptied once staged: a save abandoned
        # with a job blocks in its collectives until their timeout, and must
        # not keep the job's model (and its process groups, whose sockets
        # tell peers blocked on them that this rank left) alive meanwhile.
        state = holder.pop()
        try:
            run = state.run_state()
            self.buffer, records = stage(training_rects(state, include_copies=True),
                                         self.buffer, copy)
            meta = shard_meta(run, self.rank, self.coll.world, rng, records)
        finally:
            del state
            staged.set()
        copy.wait_on_host()
        add_checksums(self.buffer, meta["rects"])
        own = Shard(meta, self.buffer)
        # Every rank goes through the replication and the final gather
        # whatever its writes did, so none waits on a peer that gave up; the
        # gather tells every rank whether the step stands.
        problem = self._written([own])
        replica_started = time.perf_counter()
        received = self._replicate(own)
        problem = problem or self._damaged(received) or self._written(received)
        outcome = Outcome(own.data.numel(), sum(s.data.numel() for s in received),
                          time.perf_counter() - started, time.perf_counter() - replica_started,
                          self.cadence.proposal, problem, *retry)
        gathered = self.coll.all_gather(outcome)
        if self.abandoned:
            # The job failed meanwhile: the next generation may be reading
            # this node's shards; what this save left is retired by its
            # retention (or cleaned at the next start-up).
            return
        self.cadence.agree([g.proposal for g in gathered])
        failed = {rank: g.problem for rank, g in enumerate(gathered) if g.problem}
        if failed:
            self.store.remove(own.step, self.mine)
            self._paused(own.step, failed, max(g.retry_at for g in gathered), retry[1])
            return
        self.pause = None
        self.store.retain(self.keep, self.rank, self.mine)
        if self.rank == 0:
            report.saved(step=own.step, bytes=sum(g.bytes for g in gathered),
                         replica_bytes=sum(g.replica_bytes for g in gathered),
                         seconds=max(g.seconds for g in gathered),
                         replication_seconds=max(g.replication_seconds for g in gathered),
                         replicas=self.topology.copies, path=str(self.store.root.parent),
                         interval=self.cadence.every)

    def _written(self, shards: list[Shard]) -> Optional[str]:
        """Write `shards` here; None, or why a write failed (full storage,
        any OSError): the tier pauses then, the run goes on."""
        try:
            for shard in shards:
                self.store.write(shard)
        except (OSError, fmt.CheckpointError) as err:
            return str(err)
        return None

    @staticmethod
    def _damaged(received: list[Shard]) -> Optional[str]:
        """Why a replica that arrived is not what its owner sent, if it is
        not: never committed, so the previous step's replica stands."""
        for shard in received:
            problem = shard_problem(shard)
            if problem:
                return (f"the replica of rank {shard.owner}'s step {shard.step} arrived "
                        f"damaged: {problem}")
        return None

    def _paused(self, step: int, failed: dict[int, str], retry_at: int, backoff_s: float) -> None:
        """Every rank, after a failed save: its shards of the step are gone;
        pause until `retry_at`; rank 0 reports it."""
        failures = self.pause.failures + 1 if self.pause else 1
        first = min(failed)
        reason = f"rank {first}: {failed[first]}"
        self.pause = Pause(step, reason, retry_at, failures)
        if self.rank == 0:
            self.events.emit("local_tier_paused", step=step, reason=reason, ranks=sorted(failed),
                             retry_at_step=retry_at, retry_after_s=backoff_s, failures=failures,
                             path=str(self.store.root.parent))

    def _replicate(self, own: Shard) -> list[Shard]:
        """Send this rank's shard to its peers and take in its sources'."""
        peers, sources = self.topology.peers(self.rank), self.topology.sources(self.rank)
        if not peers:
            return []
        meta = encode_meta(own.meta)
        heads = {src: torch.empty(2, dtype=torch.int64) for src in sources}
        self.coll.exchange([(p, 0, header(meta, own.data)) for p in peers],
                           [(s, 0, heads[s]) for s in sources])
        metas = {s: torch.empty(int(heads[s][0]), dtype=torch.uint8) for s in sources}
        for s in sources:
            size = int(heads[s][1])
            if s not in self.recv_buffers or self.recv_buffers[s].numel() != size:
                self.recv_buffers[s] = torch.empty(size, dtype=torch.uint8)
        self.coll.exchange([x for p in peers for x in ((p, 1, meta), (p, 2, own.data))],
                           [x for s in sources for x in ((s, 1, metas[s]),
                                                         (s, 2, self.recv_buffers[s]))])
        return [Shard(decode_meta(metas[s]), self.recv_buffers[s]) for s in sources]

    # --- start-up ------------------------------------------------------------------

    def find(self, layout: dict) -> Choice:
        """Collective: the newest local step every rank can recover at this
        layout, checksums verified; this rank keeps what it holds of it."""
        self.store.clean_partials(self.mine)
        reports = self.coll.all_gather(self.store.report(layout, self.coll.world))
        verified: set[int] = set()
        while True:
            choice = complete_step(reports, self.coll.world)
            if choice.step is None or choice.step in verified:
                return choice
            step = choice.step
            self.loaded.clear()  # of a step found wanting
            mine = {owner: self._verified(step, owner)
                    for owner, problem in reports[self.rank].get(step, {}).items()
                    if problem is None}
            for rank, found in enumerate(self.coll.all_gather(mine)):
                if found:
                    reports[rank][step].update(found)
            verified.add(step)

    def _verified(self, step: int, owner: int) -> Optional[str]:
        try:
            shard = self.store.read(step, owner)
        except (OSError, ValueError, fmt.CheckpointError) as err:
            return f"reading it failed: {err}"
        problem = shard_problem(shard)
        if problem is None:
            self.loaded[owner] = shard
        return problem

    def recover(self, choice: Choice, state: TrainingState) -> RunState:
        """Collective: shards move from holders to owners whose own copy is
        missing or bad; each rank loads its own."""
        sends, recvs, heads = [], [], {}
        for holder, owner in transfers(choice.sources):
            if holder == self.rank:
                meta = encode_meta(self.loaded[owner].meta)
                sends.append((owner, 0, header(meta, self.loaded[owner].data)))
                sends += [(owner, 1, meta), (owner, 2, self.loaded[owner].data)]
            if owner == self.rank:
                heads[holder] = torch.empty(2, dtype=torch.int64)
                recvs.append((holder, 0, heads[holder]))
        # Headers first (sizes), then payloads; sends of both go out at once.
        self.coll.exchange([s for s in sends if s[1] == 0], recvs)
        payload = []
        for holder, head in heads.items():
            payload += [(holder, 1, torch.empty(int(head[0]), dtype=torch.uint8)),
                        (holder, 2, torch.empty(int(head[1]), dtype=torch.uint8))]
        self.coll.exchange([s for s in sends if s[1] > 0], payload)
        shard = self._own_shard(choice, payload)
        unpack_into(shard, training_rects(state, include_copies=True))
        saved = saved_run_state(shard)
        state.restore(saved)
        self.loaded.clear()
        return saved

    def _own_shard(self, choice: Choice, payload: list) -> Shard:
        holder = choice.sources[self.rank]
        if holder == self.rank:
            return self.loaded[self.rank]
        (_, _, meta), (_, _, data) = payload  # from the one holder of this rank's shard
        shard = Shard(decode_meta(meta), data)
        problem = shard_problem(shard)
        if problem:
            raise fmt.CheckpointError(f"rank {self.rank}'s shard of step {choice.step} arrived "
                                      f"from rank {holder} damaged: {problem}")
        self.store.write(shard)  # this node holds its own shard again
        return shard

    def check_space(self, state: TrainingState) -> None:
        """Collective, at start-up (after the resume, which retired later
        steps): the tier stays off for this run when one save does not fit
        in the free space of checkpoint.local.dir, counting on each
        filesystem the shards of every rank writing there, replicas too."""
        filesystem, free = filesystem_space(self.store.root)
        mine = Space(filesystem, str(self.store.root), free,
                     shard_bytes(state, self.rank, self.coll.world))
        short = space_shortfall(self.coll.all_gather(mine), self.topology)
        if short is None:
            return
        step, root = state.run_state().step, self.store.root.parent
        reason = (f"{DIR_KEY}={root}: {short}. Fix: free space there, point {DIR_KEY} at "
                  "storage with room (in Docker, a larger --shm-size), or set "
                  "checkpoint.local.enabled=false")
        self.pause = Pause(step, reason, retry_at=None)
        if self.rank == 0:
            self.events.emit("local_tier_paused", step=step, reason=reason, ranks=[],
                             retry_at_step=None, retry_after_s=None, failures=0, path=str(root))

    def discard_after(self, step: Optional[int]) -> None:
        """The run resumed from `step` (None: from scratch): later local steps
        are from an abandoned future and must never be chosen. Shards read
        at start-up are let go."""
        self.loaded.clear()
        self.store.discard_after(-1 if step is None else step, self.mine)

    # --- ending ----------------------------------------------------------------------

    def remove_all(self) -> None:
        """The run finished with a global checkpoint of its last step: this
        rank's local shards are no longer needed (they hold memory)."""
        self.discard_after(None)
        for path in (self.store.root, self.store.root.parent):
            try:
                path.rmdir()
            except OSError:
                pass  # other ranks' shards still there

    def close(self) -> None:
        if not self.abandoned:
            self.wait()
        self.executor.shutdown(wait=not self.abandoned)

    def abandon(self) -> None:
        """The job failed: do not wait for the save in flight (its peers may be
        gone) and do not report it; the committed local steps stand."""
        self.abandoned = True
        self.pending = self.staged = self.report = self.copy = None
        # A save every step is nearly always in flight when a job fails: its
        # blocked collective must not hold up the generation's teardown.
        if self.coll.group is not None:
            detach_process_group(self.coll.group)
