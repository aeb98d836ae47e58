"""Saving and loading the training state: writer assignment, the commit
protocol, async saves, retention, verification and resharding loads.

One thread, one process group: every checkpoint collective (planning,
writing and committing a save, verifying and loading at start-up) runs on
the checkpointer's own thread over a process group of its own, whether the
save is asynchronous or not. The training thread never issues a collective
on that group, and the save thread never on a training group, so no two
threads can pair the wrong calls (they did: an async save's barrier met the
loop's preemption all-reduce). The loop only waits for that thread, in short
slices, so a hang abort can still reach it.

The trainer is seen only through `TrainingState` (checkpoint/state.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.backends import Backend, get_backend
from megaresil.checkpoint.sharded import WEIGHTS, Rect, assign_writers
from megaresil.checkpoint.staging import StagingCopy
from megaresil.parallel.layout import use_device
from megaresil.checkpoint.state import RunState, TrainingState, training_rects, weight_rects

if TYPE_CHECKING:
    from megaresil.checkpoint.local_tier import LocalTier


class Collectives:
    """The few collectives checkpointing needs, degrading to no-ops in a
    single process without a process group. Each is issued on the group's
    owning thread (`owner`, a one-thread executor): a caller on another
    thread hands it over and waits. Only the collective hops: the reading,
    writing and allocating stay on the caller's thread (a new thread's
    allocations land in a new malloc arena, which in-process restarts would
    pile up)."""

    def __init__(self, group: Optional[dist.ProcessGroup],
                 owner: Optional[ThreadPoolExecutor] = None):
        self.group, self.owner = group, owner
        self.rank = dist.get_rank() if group is not None else 0
        self.world = dist.get_world_size() if group is not None else 1

    def _on_owner(self, fn: Callable, *args):
        if self.owner is None or getattr(_thread_role, "owns_checkpoint_group", False):
            return fn(*args)
        return wait_for(self.owner.submit(fn, *args))

    def all_gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        out = [None] * self.world
        self._on_owner(lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def gather(self, obj) -> Optional[list]:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        if self.group is None:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        self._on_owner(lambda: dist.gather_object(obj, out, group=self.group, group_dst=0))
        return out

    def barrier(self) -> None:
        if self.group is not None:
            self._on_owner(lambda: dist.barrier(group=self.group))

    def exchange(self, sends: list[tuple[int, int, torch.Tensor]],
                 recvs: list[tuple[int, int, torch.Tensor]]) -> None:
        """Point-to-point: send each (peer, tag, tensor), and fill each
        (peer, tag, tensor) from the send of that peer with that tag."""
        if self.group is None:
            return

        def run():
            works = [dist.isend(t, dst=peer, group=self.group, tag=tag) for peer, tag, t in sends]
            works += [dist.irecv(t, src=peer, group=self.group, tag=tag) for peer, tag, t in recvs]
            for work in works:
                work.wait()
        self._on_owner(run)

    def any(self, flag: bool) -> bool:
        if self.group is None:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, group=self.group)
        return bool(t.item())


def layout_plan(gathered: list[list[dict]]) -> dict[str, dict]:
    """Per key: global shape, dtype and all written rects (from every rank)."""
    plan: dict[str, dict] = {}
    for records in gathered:
        for r in records:
            entry = plan.setdefault(r["key"], {"global_shape": r["global_shape"],
                                               "dtype": r["dtype"], "rects": []})
            entry["rects"].append({"offset": r["offset"], "shape": r["shape"]})
    return plan


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def rect_record(rect: Rect) -> dict:
    """What the manifest says about a rect, before it is written."""
    return {"key": rect.key, "global_shape": list(rect.global_shape),
            "dtype": dtype_name(rect.tensor), "offset": list(rect.offset),
            "shape": list(rect.shape)}


def build_manifest(backend: str, state: RunState, all_written: list[list[dict]]) -> dict:
    """The manifest: format, backend, the non-tensor `state` and every rank's
    written rects (`all_written[r]`: records with rank, checksum, location)."""
    return {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "backend": backend,
            **state.to_manifest(), "tensors": tensor_table(all_written)}


def move_into_place(partial: Path, final: Path, make_room: Callable[[Path], None]) -> None:
    """Rename a durable `partial` directory to `final`; an existing `final`
    is first handed to `make_room`, which moves it away."""
    if final.exists():
        make_room(final)
    partial.rename(final)
    fmt.fsync_path(final.parent)


def commit(partial: Path, final: Path, manifest: dict, make_room: Callable[[Path], None]) -> None:
    """The commit protocol, once every shard under `partial` is durable: the
    manifest, the rename into place, the completion marker (with the
    manifest's digest) last."""
    digest = fmt.write_json_atomic(partial / fmt.MANIFEST, manifest)
    fmt.fsync_tree(partial, only=set())  # directories only: file data is already durable
    move_into_place(partial, final, make_room)
    fmt.write_marker(final, {fmt.MANIFEST: digest})


_thread_role = threading.local()


def save_thread_setup(device: torch.device) -> None:
    """First thing on the checkpointer's thread: it owns the checkpoint
    group, and works on the trainer's device."""
    _thread_role.owns_checkpoint_group = True
    use_device(device)


class SaveReport:
    """The `checkpoint_saved` event of one save: the save's figures come from
    the thread that commits it (rank 0), `blocking_seconds` from the loop,
    which was held by the save call and, for an async save, by its wait for
    the staging copy at its next update.

    The event goes out at the commit, and no thread waits for the other: a
    loop that has not reached its update by then will not wait at all (the
    copy is done before the commit), and a loop that is waiting at that
    moment sends the event itself when its wait ends."""

    def __init__(self, events, event: str = "checkpoint_saved"):
        self.events, self.event = events, event
        self.lock = threading.Lock()
        self.held = 0.0  # seconds the loop has been held so far
        self.waiting = False  # the loop is in `loop_waiting`
        self.figures: Optional[dict] = None  # the committed save's, until sent

    def loop_held(self, seconds: float) -> None:
        with self.lock:
            self.held += seconds
            self.waiting = False
            self._send()

    @contextlib.contextmanager
    def loop_waiting(self) -> Iterator[None]:
        """Around the loop's wait for the save: its duration counts as held."""
        with self.lock:
            self.waiting = True
        started = time.perf_counter()
        try:
            yield
        finally:
            self.loop_held(time.perf_counter() - started)

    def saved(self, **figures) -> None:
        with self.lock:
            self.figures = figures
            if not self.waiting:
                self._send()

    def _send(self) -> None:
        if self.figures is not None:
            self.events.emit(self.event, **self.figures, blocking_seconds=self.held)
            self.figures = None


class Checkpointer:
    def __init__(self, root: Path, backend: str, *, group: Optional[dist.ProcessGroup],
                 asynchronous: bool, keep: int, events, device: torch.device,
                 local: Optional[LocalTier] = None):
        self.root = root
        self.local = local  # the node-local tier (local_tier.py), on a thread of its own
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save",
                                           initializer=save_thread_setup, initargs=(device,))
        self.coll = Collectives(group, self.executor)
        self.backend: Backend = get_backend(backend)
        self.asynchronous, self.keep, self.events = asynchronous, keep, events
        self.device = device  # of the training state; the save thread works on it
        self.writers: Optional[dict[tuple, int]] = None
        self.layout_plan: Optional[dict[str, dict]] = None  # of the written rects, every rank's
        self.pending: Optional[Future] = None
        self.staged: Optional[threading.Event] = None  # async: set once the staging copy is done
        self.copy: Optional[StagingCopy] = None  # async: the staging copy in flight
        self.report: Optional[SaveReport] = None  # async: of the save in flight
        self.abandoned = False  # the job failed: the save in flight must not commit


    # --- saving ---------------------------------------------------------------

    def _my_writes(self, rects: list[Rect]) -> list[Rect]:
        """This rank's share: one replica of each rect writes it; the choice
        balances bytes over ranks and is made once (the layout is fixed), as
        is the plan of what every rank writes."""
        if self.writers is None:
            gathered = self.coll.all_gather([(r.identity(), r.nbytes, rect_record(r))
                                             for r in rects])
            self.writers = assign_writers([[(i, n) for i, n, _ in mine] for mine in gathered],
                                          self.coll.world)
            self.layout_plan = layout_plan([[record for i, _, record in mine
                                             if self.writers[i] == rank]
                                            for rank, mine in enumerate(gathered)])
        return [r for r in rects if self.writers[r.identity()] == self.coll.rank]

    @staticmethod
    def _stage(rects: list[Rect], copy: StagingCopy) -> list[Rect]:
        """Copy the rects into staging memory (enqueued on a GPU: see
        StagingCopy); once it is done, training may change them."""
        copies = copy.to_host([r.tensor for r in rects])
        return [Rect(r.key, r.global_shape, r.offset, c) for r, c in zip(rects, copies)]

    def save_training(self, state: TrainingState) -> None:
        """Checkpoint a trainer's state: its tensors, its run state and this
        rank's RNG state."""
        self.save(training_rects(state), state.run_state(), rank_state=state.rng_state())

    def save(self, rects: list[Rect], state: RunState, rank_state: dict) -> None:
        """Save `rects` (this rank's view of the training state), the
        non-tensor `state` (same on every rank) and this rank's `rank_state`
        as checkpoint `state.step`. At most one save is in flight.

        Asynchronous saves plan and copy the state to staging memory on the
        background thread too: the loop goes on with the next
        forward/backward, which does not touch the weights, and waits only if
        it reaches the next optimizer step (`before_update`) before the copy
        is done."""
        self.wait()
        started = time.perf_counter()
        report = SaveReport(self.events)
        if not self.asynchronous:
            self._save_now(rects, state, rank_state, started, report)
            return
        self.staged, self.report = threading.Event(), report
        self.copy = StagingCopy.of([r.tensor for r in rects])
        self.pending = self.executor.submit(self._stage_write_commit, rects, state, rank_state,
                                            started, self.copy, self.staged, report)
        report.loop_held(time.perf_counter() - started)

    def _save_now(self, rects: list[Rect], state: RunState, rank_state: dict, started: float,
                  report: SaveReport) -> None:
        mine = self._my_writes(rects)
        # On the CPU a synchronous save writes straight from the live tensors
        # (nothing changes them meanwhile); GPU tensors are copied.
        copy = StagingCopy.of([r.tensor for r in mine])
        if copy.on_gpu:
            mine = self._stage(mine, copy)
            copy.wait_on_host()
        self._write_and_commit(mine, state, rank_state, started, report)

    def local_due(self, step: int) -> bool:
        """Called once after each step: whether the local tier saves now."""
        return self.local is not None and self.local.due(step)

    def save_local(self, state: TrainingState, step: int) -> None:
        self.local.save(state, step)

    def before_update(self) -> None:
        """Call before anything modifies the saved tensors (the optimizer step):
        waits for an async save's staging copy (on a GPU: for it to be
        enqueued, then the training stream waits for it) and reports how long
        the loop was held."""
        if self.local is not None:
            self.local.before_update()
        if self.staged is None:
            return
        with self.report.loop_waiting():
            wait_for(self.staged)
        self.copy.order_before_update()
        self.staged = self.report = self.copy = None

    def wait(self) -> None:
        """Wait for an in-flight save; re-raises its failure."""
        self.before_update()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            wait_for(pending)

    def _stage_write_commit(self, rects: list[Rect], state: RunState, rank_state: dict,
                            started: float, copy: StagingCopy, staged: threading.Event,
                            report: SaveReport) -> None:
        try:
            copies = self._stage(self._my_writes(rects), copy)
        finally:
            staged.set()
        copy.wait_on_host()
        self._write_and_commit(copies, state, rank_state, started, report)

    def _write_and_commit(self, staged: list[Rect], state: RunState, rank_state: dict,
                          started: float, report: SaveReport) -> None:
        name = fmt.step_dir_name(state.step)
        partial = self.root / f"{name}.partial-0"
        if self.coll.rank == 0:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
            self.backend.prepare(partial, self.layout_plan)
        self.coll.barrier()
        done = self.backend.write(partial, staged, self.coll.rank)
        written = [{**rect_record(r), "rank": self.coll.rank, "checksum": fmt.checksum(r.tensor),
                    "location": done.locations[r.identity()]} for r in staged]
        done.durable()
        gathered = self.coll.gather((written, rank_state, done.note))
        if self.coll.rank == 0 and not self.abandoned:
            all_written, rank_states, notes = zip(*gathered)
            self.backend.finish(partial, list(notes))
            path = self._commit(name, partial, all_written,
                                dataclasses.replace(state, rank_states=list(rank_states)))
            per_rank = [sum(fmt.region_bytes(w["shape"], w["dtype"]) for w in ws) for ws in all_written]
            seconds = time.perf_counter() - started
            if not self.asynchronous:
                report.loop_held(seconds)
            report.saved(step=state.step, path=str(path), bytes=sum(per_rank),
                         bytes_per_rank=per_rank, seconds=seconds, backend=self.backend.name)
        self.coll.barrier()

    def _commit(self, name: str, partial: Path, all_written: list[list[dict]],
                state: RunState) -> Path:
        final = self.root / name
        commit(partial, final, build_manifest(self.backend.name, state, all_written),
               make_room=self._set_aside)
        fmt.update_latest(self.root, name)
        self._retain(final)
        return final

    def _set_aside(self, existing: Path) -> None:
        """A checkpoint of the same step exists (a run restarted from scratch
        with checkpoint.load=none): a valid one is never overwritten, so it
        is renamed aside; an invalid one is removed."""
        try:
            fmt.read_manifest(existing)
        except fmt.CheckpointError:
            shutil.rmtree(existing)
            return
        existing.rename(existing.with_name(f"{existing.name}.superseded-{int(time.time())}"))

    def _retain(self, newest: Path) -> None:
        if self.keep <= 0:
            return
        for old in fmt.committed_checkpoints(self.root)[self.keep:]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        if not self.abandoned:
            self.wait()
        self.executor.shutdown(wait=not self.abandoned)

    def abandon(self) -> None:
        """The job failed: do not wait for the save in flight (its peers may
        be gone, its collectives then wait out their timeout on the save
        thread) and do not let it commit; the newest committed checkpoint
        stands, and its partial directory is cleaned at the next start."""
        self.abandoned = True
        self.pending = self.staged = self.report = self.copy = None
        if self.local is not None:
            self.local.abandon()

    def barrier(self) -> None:
        """All ranks' checkpointers meet (start-up: after the partial saves
        of a dead run are cleaned)."""
        self.coll.barrier()

    # --- loading ----------------------------------------------------------------

    def verify(self, directory: Path, manifest: dict) -> Optional[str]:
        """None when every shard is present with its checksum, else the reason.
        Ranks split the shards between them and agree on the verdict."""
        shards = list(fmt.iter_shards(manifest))[self.coll.rank::self.coll.world]
        reason = verify_shards(get_backend(manifest["backend"]), directory, manifest, shards)
        reasons = self.coll.all_gather(reason)
        return next((r for r in reasons if r), None)

    def load(self, directory: Path, manifest: dict, targets: list[Rect]) -> None:
        """Fill `targets` (this rank's rects) from the checkpoint, after
        checking that its tensors are exactly those every rank together
        loads, at their shapes."""
        consumed = set().union(*self.coll.all_gather(sorted({t.key for t in targets})))
        check_shapes(manifest["tensors"], targets, consumed)
        get_backend(manifest["backend"]).read(directory, manifest, targets)

    def load_weights(self, source, state: TrainingState) -> None:
        """Fill a trainer's weights (not its optimizer state) from `source`, a
        TensorSource (a checkpoint's or a Hugging Face model's global
        tensors) of any layout, after checking that its weights are exactly
        those every rank together loads, at their shapes."""
        targets = weight_rects(state)
        consumed = set().union(*self.coll.all_gather(sorted({t.key for t in targets})))
        held = {key: entry for key, entry in source.tensors.items() if key.startswith(WEIGHTS)}
        check_shapes(held, targets, consumed)
        source.read(targets)

    def load_training(self, directory: Path, manifest: dict, state: TrainingState) -> RunState:
        """Load a checkpoint into a trainer's state, at whatever layout it was
        saved from (the rects reshard it); returns what it saved."""
        saved = RunState.from_manifest(manifest)
        if saved.weights_only:
            raise fmt.CheckpointError(
                f"{directory} holds weights only (no optimizer state), so training cannot resume "
                "from it exactly. Fix: start a new run from it with checkpoint.init_from="
                f"{directory} (fresh optimizer, step 0), or convert it again without "
                "--weights-only.")
        self.load(directory, manifest, training_rects(state, include_copies=True))
        state.restore(saved)
        return saved


def wait_for(waitable: threading.Event | Future, slice_s: float = 0.1):
    """Wait for an event or a future in short slices: a thread blocked in
    one long C-level wait never runs bytecode, so an abort raised in it (the
    watchdog's HangAbort) would never land."""
    if isinstance(waitable, threading.Event):
        while not waitable.wait(slice_s):
            pass
        return None
    while True:
        try:
            return waitable.result(timeout=slice_s)
        except FutureTimeout:
            continue


def tensor_table(all_written: list[list[dict]]) -> dict:
    tensors: dict[str, dict] = {}
    for written in all_written:
        for w in written:
            entry = tensors.setdefault(w["key"], {"global_shape": w["global_shape"],
                                                  "dtype": w["dtype"], "shards": []})
            entry["shards"].append({k: w[k] for k in ("offset", "shape", "rank", "checksum",
                                                      "location")})
    return dict(sorted(tensors.items()))


def _named(keys: list[str], shown: int = 8) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{len(keys)} tensor(s) ({', '.join(keys[:shown])}{more})"


def check_keys(held: Iterable[str], consumed: set[str]) -> None:
    """Refuse a checkpoint whose tensor keys (`held`) are not exactly those
    the model consumes: a key left over would be silently ignored (a 4-layer
    checkpoint loading into a 2-layer model), a missing one left unset."""
    held = set(held)
    missing, unused = sorted(consumed - held), sorted(held - consumed)
    problems = []
    if missing:
        problems.append(f"lacks {_named(missing)} that the model needs")
    if unused:
        problems.append(f"holds {_named(unused)} that the model does not use")
    if problems:
        raise fmt.CheckpointError(f"the checkpoint {' and '.join(problems)}: it was saved from "
                                  "a different model. Fix: check model.* against the "
                                  "checkpoint's recipe (megaresil ckpt inspect)")


def check_shapes(tensors: dict[str, dict], targets: list[Rect], consumed: set[str]) -> None:
    """Refuse a checkpoint (its tensor table `tensors`) unless its keys are
    exactly `consumed` (what every rank of the layout loads, together) and
    each of `targets` (the rects loaded here) has its global shape."""
    check_keys(tensors, consumed)
    for target in sorted(targets, key=lambda t: t.key):
        saved = tensors[target.key]
        if tuple(saved["global_shape"]) != tuple(target.global_shape):
            raise fmt.CheckpointError(
                f"{target.key}: the checkpoint holds shape {tuple(saved['global_shape'])}, the "
                f"model expects {tuple(target.global_shape)}; check model.* against the "
                "checkpoint's recipe (megaresil ckpt inspect)")


def verify_shards(backend: Backend, directory: Path, manifest: dict,
                  shards: list[tuple[str, dict, dict]]) -> Optional[str]:
    """Read each shard back and compare its checksum; None if all match."""
    targets = [Rect(key, tuple(entry["global_shape"]), tuple(shard["offset"]),
                    torch.empty(shard["shape"], dtype=fmt.torch_dtype(entry["dtype"])))
               for key, entry, shard in shards]
    try:
        backend.read(directory, manifest, targets)
    except Exception as err:  # a missing or truncated file: say which checkpoint is bad
        return f"reading shards failed: {type(err).__name__}: {err}"
    for target, (key, _, shard) in zip(targets, shards):
        if fmt.checksum(target.tensor) != shard["checksum"]:
            return (f"checksum mismatch in {key} at offset {tuple(shard['offset'])} "
                    f"(written by rank {shard['rank']})")
    return None
