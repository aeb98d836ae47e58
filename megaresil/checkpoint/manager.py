"""Saving and loading the training state: writer assignment, the commit
protocol, async saves, retention, verification and resharding loads.

All checkpoint collectives run on a process group of their own, so an async
save's background thread never interleaves its messages with the training
loop's collectives.
"""
from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.backends import Backend, get_backend
from megaresil.checkpoint.sharded import Rect, assign_writers


class Collectives:
    """The few collectives checkpointing needs, degrading to no-ops in a
    single process without a process group."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self.rank = dist.get_rank() if group is not None else 0
        self.world = dist.get_world_size() if group is not None else 1

    def all_gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj) -> Optional[list]:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        if self.group is None:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, group=self.group, group_dst=0)
        return out

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

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


def build_manifest(backend: str, state: dict, all_written: list[list[dict]]) -> dict:
    """The manifest: format, backend, the non-tensor `state` and every rank's
    written rects (`all_written[r]`: records with rank, checksum, location)."""
    return {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "backend": backend,
            **state, "tensors": tensor_table(all_written)}


def move_into_place(partial: Path, final: Path, make_room: Callable[[Path], None]) -> None:
    """Rename a durable `partial` directory to `final`; an existing `final`
    is first handed to `make_room`, which moves it away."""
    if final.exists():
        make_room(final)
    partial.rename(final)
    fmt.fsync_path(final.parent)


def commit(partial: Path, final: Path, manifest: dict, make_room: Callable[[Path], None]) -> None:
    """The commit protocol, once every shard under `partial` is durable: the
    manifest, the rename into place, the completion marker last."""
    fmt.write_json_atomic(partial / fmt.MANIFEST, manifest)
    fmt.fsync_tree(partial, only=set())  # directories only: file data is already durable
    move_into_place(partial, final, make_room)
    fmt.write_text_atomic(final / fmt.MARKER, "ok\n")


class Checkpointer:
    def __init__(self, root: Path, backend: str, *, group: Optional[dist.ProcessGroup],
                 asynchronous: bool, keep: int, events):
        self.root = root
        self.coll = Collectives(group)
        self.backend: Backend = get_backend(backend)
        self.asynchronous, self.keep, self.events = asynchronous, keep, events
        self.writers: Optional[dict[tuple, int]] = None
        self.layout_plan: Optional[dict[str, dict]] = None  # of the written rects, every rank's
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self.pending: Optional[Future] = None
        self.staged: Optional[threading.Event] = None  # async: the staging copy is done
        self.stalled: Optional[float] = None  # async: seconds the loop waited for it
        self.call_seconds = 0.0  # async: seconds the save call itself held the loop

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
    def _stage(rects: list[Rect]) -> list[Rect]:
        """Copy the rects into staging memory: after this, training may go on."""
        pin = torch.cuda.is_available()
        staged = []
        for r in rects:
            copy = torch.empty(r.tensor.shape, dtype=r.tensor.dtype, pin_memory=pin)
            copy.copy_(r.tensor, non_blocking=pin)
            staged.append(Rect(r.key, r.global_shape, r.offset, copy))
        if pin:
            torch.cuda.synchronize()
        return staged

    def save(self, step: int, rects: list[Rect], state: dict, rank_state: dict) -> None:
        """Save `rects` (this rank's view of the training state), the
        non-tensor `state` (same on every rank) and this rank's `rank_state`
        as checkpoint `step`. At most one save is in flight.

        Asynchronous saves plan and copy the state to staging memory on the
        background thread too: the loop goes on with the next
        forward/backward, which does not touch the weights, and waits only if
        it reaches the next optimizer step (`before_update`) before the copy
        is done."""
        self.wait()
        started = time.perf_counter()
        state = {**state, "rank_state": rank_state}
        if not self.asynchronous:
            mine = self._my_writes(rects)
            # On the CPU a synchronous save writes straight from the live
            # tensors (nothing changes them meanwhile); GPU tensors are copied.
            on_cpu = all(r.tensor.device.type == "cpu" for r in mine)
            self._write_and_commit(step, mine if on_cpu else self._stage(mine), state, started)
            return
        self.staged, self.stalled = threading.Event(), None
        self.call_seconds = time.perf_counter() - started
        self.pending = self.executor.submit(self._stage_write_commit, step, rects, state, started)

    def before_update(self) -> None:
        """Call before anything modifies the saved tensors (the optimizer step):
        waits for an async save's staging copy and records the stall."""
        if self.staged is None or self.stalled is not None:
            return
        waited = time.perf_counter()
        self.staged.wait()
        self.stalled = time.perf_counter() - waited

    def wait(self) -> None:
        """Wait for an in-flight save; re-raises its failure."""
        self.before_update()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def _stage_write_commit(self, step: int, rects: list[Rect], state: dict,
                            started: float) -> None:
        try:
            staged = self._stage(self._my_writes(rects))
        finally:
            self.staged.set()
        self._write_and_commit(step, staged, state, started)

    def _blocking_seconds(self, seconds: float) -> float:
        """How long the loop was held: all of a synchronous save; for an async
        one, its wait at the next update (recorded by then in practice: the
        write and commit take longer than a forward/backward)."""
        if not self.asynchronous:
            return seconds
        deadline = time.perf_counter() + 10.0
        while self.stalled is None and time.perf_counter() < deadline:
            time.sleep(0.005)
        return self.call_seconds + (self.stalled or 0.0)

    def _write_and_commit(self, step: int, staged: list[Rect], state: dict,
                          started: float) -> None:
        name = fmt.step_dir_name(step)
        partial = self.root / f"{name}.partial-0"
        rank_state = state.pop("rank_state")
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
        if self.coll.rank == 0:
            all_written, rank_states, notes = zip(*gathered)
            self.backend.finish(partial, list(notes))
            path = self._commit(name, partial, all_written, {**state, "rank_states": rank_states})
            per_rank = [sum(fmt.region_bytes(w["shape"], w["dtype"]) for w in ws) for ws in all_written]
            seconds = time.perf_counter() - started
            self.events.emit("checkpoint_saved", step=step, path=str(path), bytes=sum(per_rank),
                             bytes_per_rank=per_rank, seconds=seconds,
                             blocking_seconds=self._blocking_seconds(seconds),
                             backend=self.backend.name)
        self.coll.barrier()

    def _commit(self, name: str, partial: Path, all_written: list[list[dict]], state: dict) -> Path:
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
        self.wait()
        self.executor.shutdown()

    # --- loading ----------------------------------------------------------------

    def verify(self, directory: Path, manifest: dict) -> Optional[str]:
        """None when every shard is present with its checksum, else the reason.
        Ranks split the shards between them and agree on the verdict."""
        shards = list(fmt.iter_shards(manifest))[self.coll.rank::self.coll.world]
        reason = verify_shards(get_backend(manifest["backend"]), directory, manifest, shards)
        reasons = self.coll.all_gather(reason)
        return next((r for r in reasons if r), None)

    def load(self, directory: Path, manifest: dict, targets: list[Rect]) -> None:
        check_shapes(manifest, targets)
        get_backend(manifest["backend"]).read(directory, manifest, targets)


def tensor_table(all_written: list[list[dict]]) -> dict:
    tensors: dict[str, dict] = {}
    for written in all_written:
        for w in written:
            entry = tensors.setdefault(w["key"], {"global_shape": w["global_shape"],
                                                  "dtype": w["dtype"], "shards": []})
            entry["shards"].append({k: w[k] for k in ("offset", "shape", "rank", "checksum",
                                                      "location")})
    return dict(sorted(tensors.items()))


def check_shapes(manifest: dict, targets: list[Rect]) -> None:
    """Fail on the first key the checkpoint lacks or holds at another shape."""
    tensors = manifest["tensors"]
    for target in sorted(targets, key=lambda t: t.key):
        saved = tensors.get(target.key)
        if saved is None:
            raise fmt.CheckpointError(f"the checkpoint has no tensor {target.key!r} (it was saved "
                                      "from a different model); check model.* against the "
                                      "checkpoint's recipe (megaresil ckpt inspect)")
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
