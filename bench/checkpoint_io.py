"""Checkpoint save/load throughput of our backends against plain DCP and raw file writes.

One run spawns a group of gloo processes laid out like tensor parallel 2 x data
parallel (ranks/2) and gives every rank a GPT-like training state: N layers of
[qkv (3h x h), proj (h x h), fc (4h x h), proj2 (h x 4h)] fp32 weights plus
their two AdamW moments, each matrix split over the 2 "tp" ranks (along dim 0
or 1, as Megatron's column/row-parallel layers) and replicated over the "dp"
ranks. h and N are chosen so the unique bytes (one copy of each replica set)
match a target size. The same state is then saved and loaded with:

  raw         each rank writes raw tensor bytes to one file (f.write, os.fsync);
              every replicated tensor is split evenly between its dp replicas,
              so the unique bytes are written once, perfectly balanced. The
              floor: no format, no metadata, no checksums. Load reads them back
              (readinto, no copy).
  raw_writeback
              raw, with the disk writing each file's pages while later ones
              are still being copied in (posix_fadvise every 16 MiB, as our
              torch_dist writer does; megaresil.checkpoint.backends.dcp_write):
              the floor for a writer that overlaps copying and flushing. Load
              as raw.
  plain_dcp   torch.distributed.checkpoint as a user would call it:
              dcp.save/dcp.load of each rank's local tensors (one key per tp
              shard, the same keys on dp replicas, which DCP's default planner
              deduplicates), FileSystemWriter/Reader defaults.
  torch_dist  our Checkpointer with the torch_dist backend (DCP files behind our
              planner, plus writer assignment, xxHash checksums, manifest and
              the atomic commit).
  zarr        our Checkpointer with the zarr backend.

and finally three asynchronous saves in turn on one checkpointer, with our
default backend, torch_dist: the time training is blocked (the
`checkpoint_saved` event's `blocking_seconds`: the save call plus the wait at
the next optimizer step for the staging copy) against the full save
(`seconds`). The next step's forward/backward is emulated by a 0.3 s sleep for
the first save (staging into new memory) and the second (into the memory the
first kept), and left out for the third: its optimizer step comes at once and
waits for the whole copy.

Our checkpointers are made once per backend and size, outside the timing, and
save every repeat, as a trainer keeps one; so is the recipe record a save
carries.

Reading the results. "size GB" is the unique state (1 GB = 1e9 bytes); every
GB/s figure is that size over the time, for saves and loads alike. A load has
every rank fill its whole local view, so the bytes read are dp times the
unique size for every method (the replicas read the same data); the ratios are
unaffected. "files" counts what the method left on disk, metadata included.
"vs raw" is the method's GB/s divided by raw's: 1.00 is as fast as
raw bytes, 0.50 takes twice as long. Raw is the floor in work done, not a hard
limit on time: a method can come out above 1.00 where its I/O pattern suits
the disk better, or by noise. Every operation is timed between two barriers
(the slowest rank's time), each method `--repeats` times round-robin, and the
fastest repeat is reported. The page cache is flushed and dropped before each
operation when the benchmark may (as root); otherwise the output says "warm
cache" and loads may be served from memory. Each loaded tensor is compared
with the saved one (outside the timing).

    python bench/checkpoint_io.py [--ranks 4] [--sizes 0.55 2.0] [--repeats 3]
        [--methods raw raw_writeback plain_dcp torch_dist zarr] [--out bench/results] [--dir /tmp] [--quick]

The defaults take about 2 minutes on a 2-core box and need ~12 GB of memory
(the ranks' state, load targets and async staging copies at 2 GB). They are
the sizes of the issue's goals (0.55 GB and >= 2 GB); its other reference
point, `--sizes 4.3`, needs ~25 GB.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shutil
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.validation import read_manifest
from megaresil.checkpoint.backends.dcp_write import EarlyWriteback
from megaresil.checkpoint.manager import Checkpointer
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.state import RunRecord
from megaresil.config import RecipeConfig, to_dict
from megaresil.events import EventLog, read_events
from megaresil.ports import free_port

GB = 1e9
TP = 2
STEP = 1
# (name, rows and columns in units of h, the dim tensor parallelism splits)
MATRICES = (("attn.qkv", 3, 1, 0), ("attn.proj", 1, 1, 1), ("mlp.fc", 4, 1, 0),
            ("mlp.proj", 1, 4, 1))
STATES = ("model/", "optim/exp_avg/", "optim/exp_avg_sq/")  # weights + two AdamW moments
# Unique bytes per layer per h^2: 12 h^2 parameters, fp32, three copies (weights, moments).
BYTES_PER_LAYER_H2 = sum(r * c for _, r, c, _ in MATRICES) * 4 * len(STATES)
TARGET_LAYERS = 8  # h is sized for about this many layers, then N is fitted to the size
METHODS = ("raw", "raw_writeback", "plain_dcp", "torch_dist", "zarr")
ASYNC_BACKEND = "torch_dist"  # checkpoint.backend's default
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int

    @property
    def nbytes(self) -> int:
        return BYTES_PER_LAYER_H2 * self.layers * self.hidden ** 2


def shape_for(size_gb: float) -> ModelShape:
    """h (a multiple of 64, as real widths are) for ~TARGET_LAYERS layers of
    `size_gb`, then the layer count that comes closest to it."""
    target = size_gb * GB
    hidden = max(64, 64 * round(math.sqrt(target / (BYTES_PER_LAYER_H2 * TARGET_LAYERS)) / 64))
    return ModelShape(hidden, max(1, round(target / (BYTES_PER_LAYER_H2 * hidden ** 2))))


@dataclass
class Run:
    """One save and load with one method."""
    save_s: float
    load_s: float
    disk_bytes: int  # what the method left on disk, metadata included
    files: int
    cold: bool  # the page cache was dropped before both


@dataclass
class Row:
    method: str
    size_gb: float  # unique bytes of the state / 1e9
    hidden: int
    layers: int
    save_s: float  # the fastest repeat
    load_s: float
    save_runs_s: list[float]
    load_runs_s: list[float]
    disk_bytes: int
    files: int


@dataclass
class AsyncRow:
    backend: str
    size_gb: float
    blocking_first_s: float  # blocking_seconds of a checkpointer's first save (new staging memory)
    blocking_s: float  # the checkpoint_saved event's blocking_seconds of a later save
    blocking_now_s: float  # the same, with the optimizer step right after the save call
    full_s: float  # its seconds: staging to commit
    wall_s: float  # save() + wait() between barriers, as timed for the other rows
    full_runs_s: list[float]  # full_s of every repeat; the row is the fastest one's


@dataclass
class Rank:
    """This process's place in the tp x dp layout, and its state."""
    rank: int
    world: int
    ckpt_group: dist.ProcessGroup
    rects: list[Rect]
    targets: list[Rect] = field(default_factory=list)  # what a load fills, only during loads
    savers: dict[str, Checkpointer] = field(default_factory=dict)  # per backend, for all repeats

    @property
    def tp_rank(self) -> int:  # tp is the inner dimension, as in Megatron's rank order
        return self.rank % TP

    @property
    def dp_rank(self) -> int:
        return self.rank // TP

    @property
    def dp(self) -> int:
        return self.world // TP


# --- the state -------------------------------------------------------------------


def build_rects(shape: ModelShape, tp_rank: int) -> list[Rect]:
    """This tp rank's blocks of every matrix, with random values that are the
    same on every dp replica (seeded by key and offset)."""
    rects = []
    h = shape.hidden
    for layer in range(shape.layers):
        for name, rows, cols, dim in MATRICES:
            global_shape = (rows * h, cols * h)
            local = list(global_shape)
            local[dim] //= TP
            offset = [0, 0]
            offset[dim] = tp_rank * local[dim]
            for state in STATES:
                key = f"{state}layers.{layer}.{name}.weight"
                seed = zlib.crc32(f"{key}@{offset}".encode())
                tensor = torch.randn(local, generator=torch.Generator().manual_seed(seed))
                rects.append(Rect(key, global_shape, tuple(offset), tensor))
    return rects


def zeroed_like(rects: list[Rect]) -> list[Rect]:
    """Load targets: views of one zeroed buffer (so a load that skips a
    tensor is caught), a single allocation that goes back to the system when
    dropped, so that load buffers do not linger in memory during saves."""
    flat = torch.zeros(sum(r.tensor.numel() for r in rects), dtype=torch.float32)
    targets, start = [], 0
    for r in rects:
        view = flat[start:start + r.tensor.numel()].view(r.tensor.shape)
        targets.append(Rect(r.key, r.global_shape, r.offset, view))
        start += r.tensor.numel()
    return targets


@functools.cache
def recipe_record() -> dict:
    """A recipe as a trainer's state holds it: made once (it takes ~0.06 s of
    CPU, which a timed save would otherwise pay)."""
    return to_dict(RecipeConfig())


def manifest_state(me: Rank, step: int = STEP) -> RunRecord:
    """The non-tensor state a trainer's save passes, with placeholder values."""
    layout = {"tp": TP, "pp": 1, "dp": me.dp, "vpp": 1, "sequence_parallel": False,
              "world_size": me.world, "distributed_optimizer": False}
    return RunRecord(step=step, layout=layout, recipe=recipe_record(), consumed_samples=0,
                    optimizer_steps=1)


def check_loaded(method: str, me: Rank) -> None:
    for saved, loaded in zip(me.rects, me.targets):
        if not torch.equal(saved.tensor, loaded.tensor):
            raise RuntimeError(f"{method}: loading {saved.key} at {saved.offset} returned "
                               "other values than were saved")


# --- the methods: each returns the operation to time -------------------------------


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable and without a copy."""
    return memoryview(tensor.numpy()).cast("B")


def dp_part(nbytes: int, dp_rank: int, dp: int) -> slice:
    return slice(nbytes * dp_rank // dp, nbytes * (dp_rank + 1) // dp)


def raw_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.bin"


def raw_saver(me: Rank, directory: Path, early_writeback: bool) -> Callable[[], None]:
    def save() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        with open(raw_file(directory, me.rank), "wb") as f:
            writeback = EarlyWriteback(f) if early_writeback else None
            for rect in me.rects:
                f.write(byte_view(rect.tensor)[dp_part(rect.nbytes, me.dp_rank, me.dp)])
                if writeback:
                    writeback.written()
            f.flush()
            os.fsync(f.fileno())
    return save


def raw_loader(me: Rank, directory: Path) -> Callable[[], None]:
    def load() -> None:
        # Each dp replica of this tp rank wrote one part of every tensor, in
        # order. Starting with its own file spreads the ranks over all files.
        for dp_rank in [(me.dp_rank + i) % me.dp for i in range(me.dp)]:
            with open(raw_file(directory, dp_rank * TP + me.tp_rank), "rb") as f:
                for target in me.targets:
                    part = byte_view(target.tensor)[dp_part(target.nbytes, dp_rank, me.dp)]
                    if f.readinto(part) != len(part):
                        raise RuntimeError(f"{f.name} is shorter than was written")
    return load


def plain_state_dict(me: Rank, rects: list[Rect]) -> dict[str, torch.Tensor]:
    """One key per tp shard; dp replicas share keys, so DCP deduplicates them."""
    return {f"{r.key}.tp{me.tp_rank}": r.tensor for r in rects}


def plain_dcp_saver(me: Rank, directory: Path) -> Callable[[], None]:
    return lambda: dcp.save(plain_state_dict(me, me.rects),
                            storage_writer=dcp.FileSystemWriter(str(directory)))


def plain_dcp_loader(me: Rank, directory: Path) -> Callable[[], None]:
    return lambda: dcp.load(plain_state_dict(me, me.targets),
                            storage_reader=dcp.FileSystemReader(str(directory)))


def checkpointer(me: Rank, backend: str, root: Path, asynchronous: bool) -> Checkpointer:
    return Checkpointer(root, backend, group=me.ckpt_group, asynchronous=asynchronous, keep=1,
                        events=EventLog(root, me.rank), device=torch.device("cpu"))


def ours_saver(me: Rank, backend: str, root: Path) -> Callable[[], None]:
    # One checkpointer per backend for every repeat, as a trainer keeps one:
    # only its first save gathers the plan of which rank writes what.
    if backend not in me.savers:
        me.savers[backend] = checkpointer(me, backend, root, asynchronous=False)
    ckpt = me.savers[backend]
    return lambda: ckpt.save(me.rects, manifest_state(me), rank_state={})


def ours_loader(me: Rank, backend: str, root: Path) -> Callable[[], None]:
    # The trainer reads (and verifies) the manifest before it loads: not timed.
    directory = root / fmt.step_dir_name(STEP)
    manifest = read_manifest(directory)
    ckpt = checkpointer(me, backend, root, asynchronous=False)
    return lambda: ckpt.load(directory, manifest, me.targets)


def saver(method: str, me: Rank, directory: Path) -> Callable[[], None]:
    if method in ("raw", "raw_writeback"):
        return raw_saver(me, directory, early_writeback=method == "raw_writeback")
    if method == "plain_dcp":
        return plain_dcp_saver(me, directory)
    return ours_saver(me, method, directory)


def loader(method: str, me: Rank, directory: Path) -> Callable[[], None]:
    if method in ("raw", "raw_writeback"):  # the same files
        return raw_loader(me, directory)
    if method == "plain_dcp":
        return plain_dcp_loader(me, directory)
    return ours_loader(me, method, directory)


# --- timing ----------------------------------------------------------------------


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the page cache, so that a load reads
    the disk and a save does not pay for the previous one's writeback.
    Only root may; False when not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def settle(me: Rank) -> bool:
    """Rank 0 drops the cache while the others wait; whether it could."""
    dropped = drop_page_cache() if me.rank == 0 else True
    dist.barrier()
    return dropped


def timed(op: Callable[[], None]) -> float:
    """Seconds from all ranks starting `op` to the last one finishing it."""
    dist.barrier()
    start = time.perf_counter()
    op()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def disk_usage(directory: Path) -> tuple[int, int]:
    files = [p for p in directory.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def remove(me: Rank, directory: Path) -> None:
    dist.barrier()  # nobody still reads it
    if me.rank == 0:
        shutil.rmtree(directory)
    dist.barrier()


def measure(method: str, me: Rank, directory: Path) -> Run:
    """Save, then load, with `method`."""
    cold = settle(me)
    save_s = timed(saver(method, me, directory))
    disk_bytes, files = disk_usage(directory)
    me.targets = zeroed_like(me.rects)
    cold &= settle(me)
    load_s = timed(loader(method, me, directory))
    check_loaded(method, me)
    me.targets = []
    remove(me, directory)
    return Run(save_s, load_s, disk_bytes, files, cold)


# The next training step's forward/backward, which an async save's staging
# copy overlaps with. Emulated by a sleep: on a GPU that compute runs on the
# device while the host copies; on these 2 cores real compute would only
# measure CPU contention. The last save has none: its next optimizer step
# comes at once, so the loop waits for the whole staging copy.
NEXT_STEP_S = 0.3
# One checkpointer's saves in turn, as a trainer's: the first stages into new
# memory, the others into the memory the first kept.
ASYNC_NEXT_STEPS_S = (NEXT_STEP_S, NEXT_STEP_S, 0.0)


def measure_async(me: Rank, shape: ModelShape, root: Path) -> tuple[AsyncRow, bool]:
    ckpt = checkpointer(me, ASYNC_BACKEND, root, asynchronous=True)

    def save_and_wait(step: int, next_step_s: float) -> None:
        ckpt.save(me.rects, manifest_state(me, step), rank_state={})
        time.sleep(next_step_s)  # forward/backward of the next step
        ckpt.before_update()  # its optimizer step: the loop's only wait
        ckpt.wait()

    cold, walls = True, []
    for step, next_step_s in enumerate(ASYNC_NEXT_STEPS_S, start=STEP):
        cold &= settle(me)
        walls.append(timed(functools.partial(save_and_wait, step, next_step_s)))
    ckpt.close()
    # Rank 0 emits the events before each save's last barrier, so every rank sees them.
    saved = [e for e in read_events(root) if e["event"] == "checkpoint_saved"]
    first, later, now = (e["blocking_seconds"] for e in saved)
    row = AsyncRow(ASYNC_BACKEND, shape.nbytes / GB, first, later, now, saved[1]["seconds"],
                   walls[1], [saved[1]["seconds"]])
    remove(me, root)
    return row, cold


def measure_size(me: Rank, shape: ModelShape, directory: Path, repeats: int,
                 methods: tuple[str, ...]) -> tuple[list[Row], AsyncRow, bool]:
    """Every method `repeats` times, round-robin so that drift in the load of
    a shared box hits all methods alike. Other processes can only add time,
    so the fastest repeat is the best estimate of each method's own (as in
    timeit). Also whether the cache was cold throughout."""
    runs: dict[str, list[Run]] = {method: [] for method in methods}
    async_runs: list[AsyncRow] = []
    cold = True
    for _ in range(repeats):
        for method in methods:
            runs[method].append(measure(method, me, directory / method))
            cold &= runs[method][-1].cold
        async_row, async_cold = measure_async(me, shape, directory / "async")
        async_runs.append(async_row)
        cold &= async_cold
    rows = [Row(method, shape.nbytes / GB, shape.hidden, shape.layers,
                min(r.save_s for r in mine), min(r.load_s for r in mine),
                [r.save_s for r in mine], [r.load_s for r in mine], mine[0].disk_bytes,
                mine[0].files) for method, mine in runs.items()]
    for ckpt in me.savers.values():
        ckpt.close()
    fastest = min(async_runs, key=lambda a: a.full_s)
    fastest.full_runs_s = [a.full_s for a in async_runs]
    return rows, fastest, cold


def warm_up(rank: int, world: int, ckpt_group: dist.ProcessGroup, directory: Path) -> None:
    """Save and load a tiny state with every method, untimed: the first use
    imports modules (the backend registry imports zarr) and builds DCP's
    machinery, a one-off cost the first timed method would otherwise pay."""
    tiny = ModelShape(hidden=64, layers=1)
    rects = build_rects(tiny, rank % TP)
    measure_size(Rank(rank, world, ckpt_group, rects), tiny, directory, 1,
                 METHODS)


def _worker(rank: int, world: int, port: int, sizes: list[float], repeats: int,
            methods: tuple[str, ...], scratch: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share the CPUs, as tests/harness/dist.py does
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # As the trainer does: checkpoint collectives on a group of their own.
        ckpt_group = dist.new_group(backend="gloo")
        warm_up(rank, world, ckpt_group, Path(scratch) / "warm-up")
        rows, async_rows, cold = [], [], True
        for size in sizes:
            shape = shape_for(size)
            rects = build_rects(shape, rank % TP)
            me = Rank(rank, world, ckpt_group, rects)
            size_rows, async_row, size_cold = measure_size(me, shape, Path(scratch) / str(size),
                                                           repeats, methods)
            rows += size_rows
            async_rows.append(async_row)
            cold &= size_cold
        if rank == 0:
            (Path(scratch) / "result.json").write_text(json.dumps(
                {"rows": [asdict(r) for r in rows], "async": [asdict(r) for r in async_rows],
                 "cold_cache": cold}))
    finally:
        dist.destroy_process_group()


def run(ranks: int, sizes: list[float], repeats: int, methods: tuple[str, ...],
        parent: Path | None) -> tuple[list[Row], list[AsyncRow], bool]:
    """All sizes and methods in one spawned group (starting processes and
    importing torch costs more than a small checkpoint)."""
    scratch = Path(tempfile.mkdtemp(prefix="checkpoint_io-", dir=parent))
    try:
        mp.start_processes(_worker, args=(ranks, free_port(), sizes, repeats, methods, str(scratch)), nprocs=ranks,
                           join=True, start_method="spawn")
        result = json.loads((scratch / "result.json").read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ([Row(**r) for r in result["rows"]], [AsyncRow(**r) for r in result["async"]],
            result["cold_cache"])


# --- reporting -------------------------------------------------------------------


def raw_row(rows: list[Row], row: Row) -> Row:
    return next(r for r in rows if r.method == "raw" and r.size_gb == row.size_gb)


def markdown_table(rows: list[Row]) -> str:
    lines = ["| method | size GB | save s | save GB/s | save vs raw | load s | load GB/s "
             "| load vs raw | files |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        raw = raw_row(rows, r)
        lines.append(f"| {r.method} | {r.size_gb:.3f} | {r.save_s:.2f} | {r.size_gb / r.save_s:.2f} "
                     f"| {raw.save_s / r.save_s:.2f} | {r.load_s:.2f} "
                     f"| {r.size_gb / r.load_s:.2f} | {raw.load_s / r.load_s:.2f} | {r.files} |")
    return "\n".join(lines)


def async_lines(async_rows: list[AsyncRow]) -> str:
    return "\n".join(f"async save ({a.backend}, {a.size_gb:.3f} GB): blocking {a.blocking_s:.3f} s "
                     f"(first save {a.blocking_first_s:.3f} s; next step at once "
                     f"{a.blocking_now_s:.3f} s), full save {a.full_s:.2f} s, "
                     f"blocking/full {a.blocking_s / a.full_s:.3f}" for a in async_rows)


def header(args: argparse.Namespace, cold: bool, load: tuple[float, float]) -> str:
    runs = f"fastest of {args.repeats} runs" if args.repeats > 1 else "one run"
    cache = ("page cache dropped before every operation" if cold else
             "warm cache: could not drop the page cache (needs root), loads may read memory")
    return (f"Checkpoint I/O: {args.ranks} gloo ranks (tp={TP} x dp={args.ranks // TP}), fp32 "
            f"weights + 2 AdamW moments, {runs}, {cache}; "
            f"{os.cpu_count()} CPU cores, torch {torch.__version__}; 1-minute load average "
            f"{load[0]:.1f} before and {load[1]:.1f} after (above the core count: other work "
            "shared the machine).")


def plot(rows: list[Row], path: Path) -> None:
    """GB/s per method and size, saves and loads side by side."""
    import matplotlib  # a dependency of megaresil (its reports draw with it)

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    sizes = sorted({r.size_gb for r in rows})
    methods = list(dict.fromkeys(r.method for r in rows))
    width = 0.8 / len(methods)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, op in zip(axes, ("save", "load")):
        for i, method in enumerate(methods):
            mine = {r.size_gb: r for r in rows if r.method == method}
            ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in range(len(sizes))],
                   [s / getattr(mine[s], f"{op}_s") for s in sizes], width, label=method)
        ax.set_xticks(range(len(sizes)), labels=[f"{s:.2f} GB" for s in sizes])
        ax.set_title(op)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s (unique state bytes / time)")
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(rows: list[Row], async_rows: list[AsyncRow], cold: bool,
                  args: argparse.Namespace, elapsed_s: float, load: tuple[float, float]) -> None:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    setup = {"ranks": args.ranks, "tp": TP, "dp": args.ranks // TP, "sizes_gb": args.sizes,
             "repeats": args.repeats, "methods": list(args.methods),
             "dtype": "float32", "cold_cache": cold, "async_backend": ASYNC_BACKEND,
             "cpu_count": os.cpu_count(), "platform": platform.platform(),
             "torch": torch.__version__, "wall_s": round(elapsed_s, 1),
             "load_average_1min": list(load)}
    (out / "checkpoint_io.json").write_text(json.dumps(
        {"setup": setup, "rows": [asdict(r) for r in rows],
         "async": [asdict(a) for a in async_rows]}, indent=2) + "\n")
    (out / "checkpoint_io.md").write_text(
        f"{header(args, cold, load)}\n\n{markdown_table(rows)}\n\n{async_lines(async_rows)}\n")
    plot(rows, out / "checkpoint_io.png")
    print(f"wrote {out}/checkpoint_io.{{json,md,png}}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4,
                        help=f"processes, laid out as tp={TP} x dp=ranks/{TP} (even)")
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.55, 2.0],
                        help="unique state sizes in GB (1e9 bytes)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every method per size; the fastest is reported")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="methods to measure (raw is always included: the ratios need it)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for the results (default bench/results/, "
                             "bench/results/quick/ with --quick)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the checkpoints are written, in a temporary subdirectory "
                             "removed at the end (default: the system's temp directory)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one 0.05 GB size, one repeat")
    args = parser.parse_args()
    if args.ranks < TP or args.ranks % TP:
        parser.error(f"--ranks must be a multiple of tp={TP}")
    args.methods = tuple(m for m in METHODS if m == "raw" or m in args.methods)
    if args.quick:
        args.sizes, args.repeats = [0.05], 1
    if args.out is None:  # a smoke run must not overwrite the real numbers
        args.out = DEFAULT_OUT / "quick" if args.quick else DEFAULT_OUT
    return args


def check_space(args: argparse.Namespace) -> None:
    """One checkpoint is on disk at a time; refuse to start without room for it."""
    need = shape_for(max(args.sizes)).nbytes * 1.1
    free = shutil.disk_usage(args.dir or tempfile.gettempdir()).free
    if free < need:
        raise SystemExit(f"{free / GB:.1f} GB free under {args.dir or tempfile.gettempdir()}, "
                         f"need {need / GB:.1f} GB: pass --dir elsewhere or smaller --sizes")


def main() -> None:
    args = parse_args()
    check_space(args)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    rows, async_rows, cold = run(args.ranks, args.sizes, args.repeats, args.methods, args.dir)
    elapsed, load = time.perf_counter() - start, (load_before, os.getloadavg()[0])
    print(header(args, cold, load))
    print()
    print(markdown_table(rows))
    print()
    print(async_lines(async_rows))
    print(f"{len(args.sizes)} size(s) x {args.repeats} run(s) in {elapsed:.1f} s, "
          "process start-up included")
    write_results(rows, async_rows, cold, args, elapsed, load)


if __name__ == "__main__":
    main()
