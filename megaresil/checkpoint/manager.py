"""Saving and loading the training state: writer assignment, the commit
protocol, async saves, retention, verification and resharding loads.

One thread, one process group: every checkpoint collective (planning,
writing and committing a save, verifying and loading at start-up) runs on
the checkpointer's own thread over a process group of its own, whether the
save is asynchronous or not (collectives.py); the save's lifecycle is
async_save.py's, shared with the local tier.

The trainer is seen only through `TrainingState` (checkpoint/state.py).
"""
from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.async_save import BackgroundSaves, SaveReport, SaveRequest
from megaresil.checkpoint.backends import get_backend
from megaresil.checkpoint.backends.base import Backend
from megaresil.checkpoint.keys import WEIGHTS
from megaresil.checkpoint.sharded import Rect, assign_writers
from megaresil.checkpoint.staging import StagingBuffers, StagingCopy
from megaresil.checkpoint.state import RunRecord, TrainingState, training_rects, weight_rects
from megaresil.checkpoint.validation import (
    check_shapes,
    nonfinite_keys,
    nonfinite_refusal,
    read_manifest,
    verify_shards,
)
from megaresil.fencing import Fence, Fenced


def layout_plan(gathered: list[list[dict]]) -> dict[str, dict]:
    """Per key: global shape, dtype and all written rects (from every rank)."""
    plan: dict[str, dict] = {}
    for records in gathered:
        for r in records:
            entry = plan.setdefault(r["key"], {"global_shape": r["global_shape"],
                                               "dtype": r["dtype"], "rects": []})
            entry["rects"].append({"offset": r["offset"], "shape": r["shape"]})
    return plan


def rect_record(rect: Rect) -> dict:
    """What the manifest says about a rect, before it is written."""
    return {"key": rect.key, "global_shape": list(rect.global_shape),
            "dtype": fmt.dtype_name(rect.tensor), "offset": list(rect.offset),
            "shape": list(rect.shape)}


def build_manifest(backend: str, state: RunRecord, all_written: list[list[dict]]) -> dict:
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
    # Written in place, fsynced together with the directories in one round:
    # until the rename, `partial` is nobody's checkpoint (a crash leaves it
    # to clean_partials), so the manifest needs no rename of its own.
    digest = fmt.write_json_new(partial / fmt.MANIFEST, manifest)
    fmt.fsync_tree(partial, only={fmt.MANIFEST})  # the shards are already durable
    move_into_place(partial, final, make_room)
    fmt.write_marker(final, {fmt.MANIFEST: digest})


class Checkpointer(BackgroundSaves):
    def __init__(self, root: Path, backend: str, *, group: Optional[dist.ProcessGroup],
                 asynchronous: bool, keep: int, events, device: torch.device,
                 fence: Optional[Fence] = None):
        super().__init__("ckpt-save", group, device)
        self.root = root
        self.fence = fence  # None: no restarts (library use): every commit is this job's
        self.backend: Backend = get_backend(backend)
        self.asynchronous, self.keep, self.events = asynchronous, keep, events
        self.writers: Optional[dict[tuple, int]] = None
        self.staging = StagingBuffers()  # used on the save thread (on the loop's if synchronous)

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
            self.backend.plan(layout_plan([[record for i, _, record in mine
                                            if self.writers[i] == rank]
                                           for rank, mine in enumerate(gathered)]))
        return [r for r in rects if self.writers[r.identity()] == self.coll.rank]

    def _stage(self, rects: list[Rect], copy: StagingCopy) -> list[Rect]:
        """Copy the rects into staging memory (enqueued on a GPU: see
        StagingCopy); once it is done, training may change them."""
        copies = self.staging.copy(copy, [r.tensor for r in rects])
        return [Rect(r.key, r.global_shape, r.offset, c) for r, c in zip(rects, copies)]

    def _write_staged(self, staged: list[Rect], state: RunRecord, rank_state: dict,
                      started: float, report: SaveReport) -> None:
        """Write and commit a staging copy, then keep its memory for the next."""
        self._write_and_commit(staged, state, rank_state, started, report)
        self.staging.give_back([r.tensor for r in staged])

    def save_training(self, state: TrainingState) -> None:
        """Checkpoint a trainer's state: its tensors, its run state and this
        rank's RNG state."""
        self.save(training_rects(state), state.run_record(), rank_state=state.rng_state())

    def save(self, rects: list[Rect], state: RunRecord, rank_state: dict) -> None:
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
        request = SaveRequest(StagingCopy.of([r.tensor for r in rects]), report)
        self._submit(request, self._stage_write_commit, rects, state, rank_state, started)
        report.loop_held(time.perf_counter() - started)

    def _save_now(self, rects: list[Rect], state: RunRecord, rank_state: dict, started: float,
                  report: SaveReport) -> None:
        mine = self._my_writes(rects)
        # On the CPU a synchronous save writes straight from the live tensors
        # (nothing changes them meanwhile); GPU tensors are copied.
        copy = StagingCopy.of([r.tensor for r in mine])
        if not copy.on_gpu:
            self._write_and_commit(mine, state, rank_state, started, report)
            return
        staged = self._stage(mine, copy)
        copy.wait_on_host()
        self._write_staged(staged, state, rank_state, started, report)

    def _stage_write_commit(self, rects: list[Rect], state: RunRecord, rank_state: dict,
                            started: float, request: SaveRequest) -> None:
        with request.holding_update():
            copies = self._stage(self._my_writes(rects), request.copy)
        request.copy.wait_on_host()
        self._write_staged(copies, state, rank_state, started, request.report)

    def _write_and_commit(self, staged: list[Rect], state: RunRecord, rank_state: dict,
                          started: float, report: SaveReport) -> None:
        name = fmt.step_dir_name(state.step)
        # Named by the generation: ranks a re-formed job left behind never
        # write into the directory the job now saves the same step in.
        partial = self.root / f"{name}.partial-{self.fence.name() if self.fence else 0}"
        if self.coll.rank == 0:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
            self.backend.prepare(partial)
        self.coll.barrier()
        done = self.backend.write(partial, staged, self.coll.rank)
        written = [{**rect_record(r), "rank": self.coll.rank, "checksum": fmt.checksum(r.tensor),
                    "location": done.locations[r.identity()]} for r in staged]
        # Whether this rank's writes hold a NaN or inf rides in the gather the
        # commit needs anyway: such a state is refused, never committed. Its
        # pass over the data, as the checksums', overlaps the flush to disk.
        refusing = nonfinite_keys(staged)
        done.durable()
        gathered = self.coll.gather((written, rank_state, done.note, refusing))
        if gathered is not None and not self.abandoned:  # rank 0: it holds the gather
            all_written, rank_states, notes, nonfinite = zip(*gathered)
            refused = [key for keys in nonfinite for key in keys]
            if refused:
                self._refuse(state.step, partial, refused)
            else:
                self._commit_gathered(name, partial, state, all_written, rank_states, notes,
                                      started, report)
        self.coll.barrier()

    def _commit_gathered(self, name: str, partial: Path, state: RunRecord, all_written,
                         rank_states, notes, started: float, report: SaveReport) -> None:
        self.backend.finish(partial, list(notes))
        path = self._commit(name, partial, all_written,
                            dataclasses.replace(state, rank_states=list(rank_states)))
        per_rank = [sum(fmt.region_bytes(w["shape"], w["dtype"]) for w in ws) for ws in all_written]
        seconds = time.perf_counter() - started
        if not self.asynchronous:
            report.loop_held(seconds)
        report.saved(step=state.step, path=str(path), bytes=sum(per_rank),
                     bytes_per_rank=per_rank, seconds=seconds, backend=self.backend.name)

    def _refuse(self, step: int, partial: Path, keys: list[str]) -> None:
        """Drop a save whose state is not finite: the previous checkpoint (and
        `latest`) stay, and retention, which runs only at a commit, deletes
        nothing."""
        shutil.rmtree(partial, ignore_errors=True)
        if self.events is not None:
            self.events.emit("checkpoint_refused", step=step, reason=nonfinite_refusal(keys))

    def _commit(self, name: str, partial: Path, all_written: list[list[dict]],
                state: RunRecord) -> Path:
        final = self.root / name
        self._check_fence(f"the commit of {name}", partial)
        commit(partial, final, build_manifest(self.backend.name, state, all_written),
               make_room=self._set_aside)
        fmt.update_latest(self.root, name)
        self._retain(final)
        return final

    def _check_fence(self, write: str, partial: Path) -> None:
        """A save of a generation the job re-formed without is dropped, not
        committed (fencing.py): it raises Fenced."""
        if self.fence is None:
            return
        try:
            self.check_fence(self.fence, write)
        except Fenced:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def _set_aside(self, existing: Path) -> None:
        """A checkpoint of the same step exists (a run restarted from scratch
        with checkpoint.load=none): a valid one is never overwritten, so it
        is renamed aside; an invalid one is removed."""
        try:
            read_manifest(existing)
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

    def load_training(self, directory: Path, manifest: dict, state: TrainingState) -> RunRecord:
        """Load a checkpoint into a trainer's state, at whatever layout it was
        saved from (the rects reshard it); returns what it saved."""
        saved = RunRecord.from_manifest(manifest)
        if saved.weights_only:
            raise fmt.CheckpointError(
                f"{directory} holds weights only (no optimizer state), so training cannot resume "
                "from it exactly. Fix: start a new run from it with checkpoint.init_from="
                f"{directory} (fresh optimizer, step 0), or convert it again without "
                "--weights-only.")
        self.load(directory, manifest, training_rects(state, include_copies=True))
        state.restore(saved)
        return saved


def tensor_table(all_written: list[list[dict]]) -> dict:
    tensors: dict[str, dict] = {}
    for written in all_written:
        for w in written:
            entry = tensors.setdefault(w["key"], {"global_shape": w["global_shape"],
                                                  "dtype": w["dtype"], "shards": []})
            entry["shards"].append({k: w[k] for k in ("offset", "shape", "rank", "checksum",
                                                      "location")})
    return dict(sorted(tensors.items()))
