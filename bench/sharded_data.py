"""Measure sharded data parallelism (parallel.dp_shard, FSDP2) against plain
data parallelism and ZeRO-1, side by side in one run: the bytes one rank holds
of parameters, gradients and optimizer state, the most it has allocated at
once in a step, and the step time relative to ZeRO-1's.

Modes, at each dp of `--dp` (default 2 and 4):

- plain: dp_shard=1, optimizer.distributed=false (every rank holds it all);
- zero1: dp_shard=1, optimizer.distributed=true (optimizer state in row shards);
- hsdp: dp_shard=2 of dp=4 (FSDP2 shards over 2 ranks, replicates over 2);
- full: dp_shard=dp (FSDP2 shards everything over all dp ranks, ZeRO-3).

Each rank builds a real `Trainer` (megaresil.train.loop, so build_parts's
FSDP2 wrapping, grad groups and optimizers) of a GPT-2 flavour on gpt-tiny's
recipe with synthetic data, fp32, one micro-batch a rank a step. One spawn
per dp (world = dp, gloo, one thread a rank); inside it every mode's trainer
is built on the same process group and they step in turn, round after round,
so a busy spell of the shared machine hits all of them.

- params: the storages of the parameters a rank holds between steps: whole
  tensors for plain DP and ZeRO-1, FSDP2's local shards (`.to_local()`) for
  hsdp and full (their storage, FSDP2's padding included).
- grads: the gradient storages alive when the optimizer steps: the flat
  grad buckets of parts.grads for plain DP and ZeRO-1 (they persist between
  steps), and under ZeRO-1 also the reduce-scattered rows its shards step
  on; FSDP2's reduced local shards (freed after the step).
- optimizer: the tensors of the optimizer's state (AdamW moments and step):
  whole for plain DP, ZeRO-1's row shards, FSDP2's local shards.
- step peak: the bytes held when a step starts (the above that persist)
  plus the most allocated and alive at once during one whole train_step
  (`ActivationMeter`, counting a DTensor's local shard: activations,
  FSDP2's gathered parameters, grads, the optimizer's temporaries), rank
  0's; and what of that is still alive after the step (kept_after_step).
- step: the trainer's train_step, the slowest rank's wall and CPU seconds,
  medians of `--steps` rounds after `--warmup`. Beyond 2 ranks the
  processes share the 2 cores of this machine: read the CPU seconds, and
  every time as a ratio to ZeRO-1's.
- loss and grad norm: every step's, each mode's largest difference from
  plain DP's (they train the same model on the same batches).

    python bench/sharded_data.py [--dp 2 4] [--layers 4] [--hidden 512]
        [--heads 8] [--seq 64] [--steps 5] [--warmup 2] [--out bench/results] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

# The same load record as the context-parallel bench's.
from context_parallel import spawned_rows, uptime

from megaresil import compat
from megaresil.config import load_recipe
from megaresil.model.activation_meter import ActivationMeter
from megaresil.parallel.fsdp import local_part
from megaresil.parallel.grad_groups import GroupedGrads
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.loop import Trainer

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "gpt-tiny.yaml"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
MB = 2**20
CPU = torch.device("cpu")


def modes(dp: int) -> dict[str, list[str]]:
    """Each mode's overrides at this dp."""
    out = {"plain": ["parallel.dp_shard=1", "optimizer.distributed=false"],
           "zero1": ["parallel.dp_shard=1", "optimizer.distributed=true"]}
    if dp >= 4 and dp % 2 == 0:
        out["hsdp"] = ["parallel.dp_shard=2", "optimizer.distributed=false"]
    out["full"] = [f"parallel.dp_shard={dp}", "optimizer.distributed=false"]
    return out


def overrides(args: argparse.Namespace, dp: int) -> list[str]:
    return ["parallel.tp=1", "parallel.pp=1", f"parallel.dp={dp}", "data.source=synthetic",
            f"data.seq_len={args.seq}", f"model.max_seq_len={args.seq}",
            f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.num_heads={args.heads}", f"model.vocab_size={args.vocab}",
            "train.precision=fp32", "train.micro_batch_size=1", f"train.global_batch_size={dp}",
            "train.steps=1000", "train.eval_batches=0", "optimizer.warmup_steps=2",
            "logging.progress=false", "logging.tensorboard=false", "checkpoint.interval=0"]


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages under `tensors` (views count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = local_part(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state(optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state, through ChainedOptimizer parts
    and the distributed optimizer's inner one (its row shards')."""
    parts = getattr(optimizer, "parts", [optimizer])
    tensors = []
    for part in parts:
        inner = getattr(part, "inner", part)
        for state in inner.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    return tensors


def grad_buffers(trainer: Trainer) -> list[torch.Tensor]:
    """The flat grad buckets of plain DP and ZeRO-1 (none under FSDP2)."""
    if not isinstance(trainer.grads, GroupedGrads):
        return []
    return [bucket.buffer for buffers in trainer.grads.buffers for bucket in buffers.buckets]


class LocalMeter(ActivationMeter):
    """The activation meter, counting a DTensor's local shard: its own
    count takes a DTensor's storage at the whole tensor's size (a wrapper's
    storage is sized by its global shape), dp_shard times what the rank
    allocates, which would inflate FSDP2's optimizer step."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        existing = set()
        compat.tree_map_only(torch.Tensor, lambda t: existing.add(
            compat.storage_identity(local_part(t).untyped_storage())), (args, kwargs))
        compat.tree_map_only(torch.Tensor, lambda t: self._allocated(local_part(t), existing),
                             out)
        return out


class Mode:
    """One mode's trainer on this rank, and what it holds."""

    def __init__(self, name: str, cfg_overrides: list[str], run_dir: Path):
        cfg = load_recipe(RECIPE, [*cfg_overrides, f"run.dir={run_dir}"])
        self.name = name
        self.trainer = Trainer(cfg, ParallelLayout.from_config(cfg.parallel, CPU))
        self.grad_bytes = 0
        sync = self.trainer.sync_grads

        def recording_sync():  # the grads the optimizer is about to step on
            held = sync()
            # Their bytes only: a reference would keep them past the step.
            self.grad_bytes = storage_bytes([*grad_buffers(self.trainer),
                                             *(g for group in held for _, g in group)])
            return held

        self.trainer.sync_grads = recording_sync
        self.wall_s: list[float] = []
        self.cpu_s: list[float] = []
        # Every step's, to check that the modes train alike.
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def record(self, step: dict) -> None:
        self.losses.append(step["loss"])
        self.grad_norms.append(step["grad_norm"])

    def held(self) -> dict[str, int]:
        """Bytes this rank holds of parameters, grads (at the optimizer step)
        and optimizer state, and what of them persists between steps."""
        trainer = self.trainer
        params = storage_bytes(trainer.params)
        buffers = storage_bytes(grad_buffers(trainer))
        state = storage_bytes(optimizer_state(trainer.optimizer))
        return {"param_bytes": params, "grad_bytes": self.grad_bytes, "optimizer_bytes": state,
                "between_steps_bytes": params + buffers + state}

    def timed_step(self) -> None:
        """One train_step: the slowest rank's wall and CPU seconds."""
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        record = self.trainer.train_step()
        both = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu],
                            dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # a step ends with its slowest rank
        self.record(record)
        self.wall_s.append(round(both[0].item(), 4))
        self.cpu_s.append(round(both[1].item(), 4))

    def metered_step(self) -> tuple[int, int]:
        """The most allocated and alive at once during one train_step, and
        what of it is still alive after the step (0 unless a step keeps
        memory beyond what it found: FSDP2's gathered parameters, say)."""
        dist.barrier()
        meter = LocalMeter(CPU)
        with meter:
            self.record(self.trainer.train_step())
        reading = meter.reading()
        return reading.peak_device_bytes, reading.device_bytes


def _worker(rank: int, dp: int, port: int, args: argparse.Namespace, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(dp), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(dp))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=dp)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = overrides(args, dp)
            built = [Mode(name, base + extra, Path(tmp) / name)
                     for name, extra in modes(dp).items()]
            for _ in range(args.warmup):
                for mode in built:
                    mode.timed_step()
            for mode in built:
                mode.wall_s.clear()
                mode.cpu_s.clear()
            peaks, kept = {}, {}
            for mode in built:
                held_before = mode.held()["between_steps_bytes"]
                peak, kept[mode.name] = mode.metered_step()
                peaks[mode.name] = held_before + peak
            for _ in range(args.steps):
                for mode in built:
                    mode.timed_step()
            rows = {}
            for mode in built:
                held = mode.held()
                # Every rank's, to show they agree (FSDP2's last shards may be short).
                per_rank = torch.tensor([held["param_bytes"], held["grad_bytes"],
                                         held["optimizer_bytes"]], dtype=torch.float64)
                gathered = [torch.zeros_like(per_rank) for _ in range(dp)]
                dist.all_gather(gathered, per_rank)
                rows[mode.name] = {**held, "step_peak_bytes": peaks[mode.name],
                                   "kept_after_step_bytes": kept[mode.name],
                                   "ranks_param_grad_optimizer_bytes":
                                       [[int(x) for x in g.tolist()] for g in gathered],
                                   "wall_s": mode.wall_s, "cpu_s": mode.cpu_s, "losses": mode.losses,
                                   "grad_norms": mode.grad_norms,
                                   # DTensor.numel() is the whole tensor's.
                                   "parameters": sum(p.numel() for p in mode.trainer.params)}
                mode.trainer.close()
            if rank == 0:
                Path(result).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def run_dp(dp: int, args: argparse.Namespace) -> dict[str, dict]:
    return spawned_rows(_worker, dp, args)


def dp_shard_of(mode: str, dp: int) -> int:
    return {"plain": 1, "zero1": 1, "hsdp": 2, "full": dp}[mode]


def rows_of(results: dict[int, dict[str, dict]]) -> list[dict]:
    rows = []
    for dp, by_mode in results.items():
        plain, zero1 = by_mode["plain"], by_mode["zero1"]
        zero1_wall, zero1_cpu = (statistics.median(zero1[k]) for k in ("wall_s", "cpu_s"))
        for mode, r in by_mode.items():
            wall, cpu = statistics.median(r["wall_s"]), statistics.median(r["cpu_s"])
            rows.append({"dp": dp, "mode": mode, "dp_shard": dp_shard_of(mode, dp), **r,
                         "wall_median_s": round(wall, 4), "cpu_median_s": round(cpu, 4),
                         "wall_vs_zero1": round(wall / zero1_wall, 3),
                         "cpu_vs_zero1": round(cpu / zero1_cpu, 3),
                         "loss_max_abs_diff_vs_plain": max(
                             abs(a - b) for a, b in zip(r["losses"], plain["losses"])),
                         "grad_norm_max_rel_diff_vs_plain": max(
                             abs(a - b) / b for a, b in zip(r["grad_norms"], plain["grad_norms"])),
                         **{f"{k}_vs_plain": round(r[f"{k}_bytes"] / plain[f"{k}_bytes"], 3)
                            for k in ("param", "grad", "optimizer", "step_peak")},
                         "total_vs_plain": round(
                             sum(r[f"{k}_bytes"] for k in ("param", "grad", "optimizer"))
                             / sum(plain[f"{k}_bytes"] for k in ("param", "grad", "optimizer")),
                             3)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| dp | mode | dp_shard | params MB/rank | grads MB/rank | optimizer MB/rank "
             "| params / plain | grads / plain | optimizer / plain | all three / plain "
             "| step peak MB/rank | peak / plain | step wall s | wall / zero1 | step CPU s/rank "
             "| CPU / zero1 | loss, most apart from plain | grad norm, most apart (relative) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
             "---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dp']} | {r['mode']} | {r['dp_shard']} "
                     f"| {r['param_bytes'] / MB:.1f} | {r['grad_bytes'] / MB:.1f} "
                     f"| {r['optimizer_bytes'] / MB:.1f} | {r['param_vs_plain']:.3f} "
                     f"| {r['grad_vs_plain']:.3f} | {r['optimizer_vs_plain']:.3f} "
                     f"| {r['total_vs_plain']:.3f} | {r['step_peak_bytes'] / MB:.1f} "
                     f"| {r['step_peak_vs_plain']:.3f} | {r['wall_median_s']:.3f} "
                     f"| {r['wall_vs_zero1']:.2f} | {r['cpu_median_s']:.3f} "
                     f"| {r['cpu_vs_zero1']:.2f} | {r['loss_max_abs_diff_vs_plain']:.1e} "
                     f"| {r['grad_norm_max_rel_diff_vs_plain']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="dp 4 only (every mode), 2 layers, hidden 128, 1 warm-up and 3 "
                        "timed rounds")
    args = parser.parse_args()
    argv = sys.argv[1:]
    if args.quick:
        args.layers, args.hidden, args.heads, args.warmup, args.steps = 2, 128, 4, 1, 3
        args.dp = [4]
    args.out = args.out or (DEFAULT_OUT / "quick" if args.quick else DEFAULT_OUT)
    started, before, load_before = time.perf_counter(), uptime(), os.getloadavg()[0]
    results = {dp: run_dp(dp, args) for dp in args.dp}
    after, load_after = uptime(), os.getloadavg()[0]
    rows = rows_of(results)
    setup = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
             "vocab": args.vocab, "seq": args.seq, "micro_batch": 1, "flavour": "gpt2",
             "dtype": "float32", "warmup_rounds": args.warmup, "timed_rounds": args.steps,
             "backend": "gloo", "threads_per_rank": 1, "cpu_count": os.cpu_count(),
             "platform": platform.platform(), "torch": torch.__version__,
             "wall_s": round(time.perf_counter() - started, 1),
             "uptime": {"before": before, "after": after},
             "load_average_1min": {"before": round(load_before, 2), "after": round(load_after, 2)}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharded_data.json").write_text(
        json.dumps({"setup": setup, "rows": rows}, indent=1) + "\n")
    params = rows[0]["parameters"]
    header = (f"# Sharded data parallelism: what a rank holds\n\n"
              f"`python bench/sharded_data.py {' '.join(argv)}`: a GPT-2 flavour "
              f"({args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab "
              f"{args.vocab}, {params / 1e6:.2f}M parameters), seq {args.seq}, one micro-batch "
              f"a rank, fp32 AdamW, gloo, one thread a rank, {os.cpu_count()} CPU cores shared by "
              f"all ranks; step = the trainer's train_step, the slowest rank's wall and CPU "
              f"seconds, medians of "
              f"{args.steps} rounds after {args.warmup}; torch {torch.__version__}; "
              f"{setup['wall_s']} s. Load: `{before}` before, `{after}` after.\n\n")
    (args.out / "sharded_data.md").write_text(header + markdown(rows) + "\n")
    print(header + markdown(rows))
    print(f"wrote {args.out}/sharded_data.{{json,md}}")


if __name__ == "__main__":
    main()
