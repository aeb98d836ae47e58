"""Measure the activation memory and step time of each recomputation variant
at tp=2, and compare the memory with the textbook figures.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022), count per layer sbh(34 + 5as/h) bytes without recomputation
(2-byte activations, 1-byte dropout masks), sbh(10 + 24/t + 5as/(ht)) with
tensor parallelism t, sbh(10 + 24/t) with selective recomputation, and 2sbh
(the layer's input) with full recomputation. This model keeps activations
in fp32 (CPU) and its dropout masks in the activation dtype, so the figures
here are the same counts with 4-byte activations (e) and 4-byte masks (m):
sbh(4e + 2m) replicated + 12e·sbh/t sharded + as²b(2e + m)/t per layer, and
e·sbh for a full-recomputation input (÷ t when partitioned, 0 on the device
when offloaded).

Measured, not estimated: `ActivationMeter` counts the bytes of every tensor
storage allocated while it is on, until torch frees it (an allocator's
statistics, for CPU tensors). "Held" is what the layers keep for backward
once their forward is done, "peak" the most alive at once during forward and
backward (recomputation and the parameter grads included). The layers are
run as a middle pipeline chunk fed (B, T, C) hidden states, so embedding and
output head stay out of the count; each rank reports its own, and the table
shows rank 0 (the ranks agree to the byte).

    python bench/activation_memory.py [--layers 8] [--hidden 512] [--seq 512]
        [--heads 8] [--micro-batch 1] [--steps 2] [--out bench/results] [--quick]

Step time is forward + backward of the layers (the optimizer step does not
depend on the variant), the slowest rank's, the fastest of `--steps` rounds
timed without the meter after one metered step; each round times every
variant in turn, so a busy spell of the shared machine hits all of them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megaresil.config import ActivationOffload, Flavour, ModelConfig, Recompute, RecomputePolicy
from megaresil.model.activation_meter import ActivationMeter
from megaresil.model.gpt import GPT
from megaresil.model.init import initialize
from megaresil.parallel.tensor_parallel import TPGroup
from megaresil.ports import free_port

TP = 2
E = M = 4  # bytes per activation and per dropout-mask element (fp32, masks in fp32)
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
MB = 2**20


def variants(layers: int) -> dict[str, dict]:
    full = dict(recompute=Recompute.full)
    return {
        "none": {},
        "selective": dict(recompute=Recompute.selective),
        "full": full,
        "full+partition": dict(full, activation_partition=True),
        "full+offload": dict(full, activation_offload=ActivationOffload.cpu),
        f"block {layers // 2}/{layers}": dict(full, recompute_policy=RecomputePolicy.block,
                                              recompute_layers=layers // 2),
    }


@dataclass
class Row:
    variant: str
    held_bytes: int  # kept for backward after the layers' forward, per rank
    peak_bytes: int  # most alive during forward + backward, per rank
    grad_bytes: int  # this rank's parameter grads (part of the peak)
    host_pool_bytes: int  # offloaded activations in the host pool (peak)
    textbook_bytes: float  # Korthikanti et al.'s count, at this dtype, per rank
    step_s: float  # forward + backward, fastest timed step, slowest rank
    step_times_s: list[float]

    @property
    def ratio(self) -> float:
        return self.held_bytes / self.textbook_bytes if self.textbook_bytes else float("nan")


def textbook_per_layer(cfg: ModelConfig, s: int, b: int, t: int) -> float:
    """Bytes one layer keeps per TP rank, by Korthikanti et al.'s count."""
    h, a = cfg.hidden_size, cfg.num_heads
    sbh, as2b = s * b * h, a * s * s * b
    plain = sbh * (4 * E + 2 * M) + 12 * E * sbh / t
    if cfg.recompute == Recompute.selective:
        return plain
    if cfg.recompute == Recompute.none:
        return plain + as2b * (2 * E + M) / t
    if cfg.activation_offload == ActivationOffload.cpu:
        return 0.0
    return E * sbh / (t if cfg.activation_partition else 1)


def textbook(cfg: ModelConfig, s: int, b: int, t: int) -> float:
    """Bytes all layers keep per TP rank (block: N recomputed, the rest plain)."""
    if cfg.recompute == Recompute.full and cfg.recompute_policy == RecomputePolicy.block:
        n = cfg.recompute_layers
        plain = textbook_per_layer(replace(cfg, recompute=Recompute.none), s, b, t)
        return n * textbook_per_layer(cfg, s, b, t) + (cfg.num_layers - n) * plain
    return cfg.num_layers * textbook_per_layer(cfg, s, b, t)


def one_step(model: GPT, x0: torch.Tensor, weights: torch.Tensor, samples: torch.Tensor,
             meter: ActivationMeter | None) -> int:
    """Forward and backward of the layers; the bytes held after forward."""
    model.zero_grad(set_to_none=True)
    with meter or contextlib.nullcontext():
        x = x0 * 1.0  # the input is an activation too
        y = model.stage_forward(x, samples)
        del x
        loss = (y * weights).sum()
        del y
        held = meter.reading().device_bytes if meter else 0
        loss.backward()
    return held


@dataclass
class Setup:
    """One variant's layers and inputs on this rank."""
    name: str
    cfg: ModelConfig
    model: GPT
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x0, weights, samples


def build(name: str, cfg: ModelConfig, tp: TPGroup, args: argparse.Namespace) -> Setup:
    model = GPT(cfg, tp=tp, seed=1, first=False, last=False)
    initialize(model, cfg, seed=1)
    gen = torch.Generator().manual_seed(0)
    shape = (args.micro_batch, args.seq, args.hidden)
    x0 = torch.randn(*shape, generator=gen, requires_grad=True)
    return Setup(name, cfg, model, (x0, torch.randn(*shape, generator=gen),
                                    torch.arange(args.micro_batch)))


def measure_memory(setup: Setup) -> tuple[int, int]:
    """(held, peak) device bytes of one metered step."""
    if setup.cfg.activation_offload == ActivationOffload.cpu:
        one_step(setup.model, *setup.inputs, None)  # fills the host pool, as any first step
    meter = ActivationMeter(torch.device("cpu"))
    held = one_step(setup.model, *setup.inputs, meter)
    return held, meter.reading().peak_device_bytes


def timed_step(setup: Setup) -> float:
    dist.barrier()
    start = time.perf_counter()
    one_step(setup.model, *setup.inputs, None)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends with its slowest rank
    return elapsed.item()


def measure_all(setups: list[Setup], tp: TPGroup, args: argparse.Namespace) -> list[Row]:
    """Memory from one metered step each; then `args.steps` rounds timing every
    variant in turn, so a busy spell of the shared machine hits all of them."""
    memory = [measure_memory(s) for s in setups]
    times: list[list[float]] = [[] for _ in setups]
    for _ in range(args.steps):
        for setup, mine in zip(setups, times):
            mine.append(timed_step(setup))
    rows = []
    for setup, (held, peak), mine in zip(setups, memory, times):
        pool = setup.model.checkpoints.pool
        grads = sum(p.grad.nbytes for p in setup.model.parameters() if p.grad is not None)
        rows.append(Row(setup.name, held, peak, grads, pool.peak_bytes if pool else 0,
                        textbook(setup.cfg, args.seq, args.micro_batch, tp.size),
                        min(mine), mine))
    return rows


def model_config(args: argparse.Namespace, **variant) -> ModelConfig:
    return ModelConfig(flavour=Flavour.gpt2, num_layers=args.layers, hidden_size=args.hidden,
                       num_heads=args.heads, vocab_size=4096, max_seq_len=args.seq,
                       dropout=0.1, attention_dropout=0.1, **variant)


def _worker(rank: int, port: int, args: argparse.Namespace, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        tp = TPGroup(group=dist.group.WORLD, size=TP, rank=rank)
        setups = [build(name, model_config(args, **kw), tp, args)
                  for name, kw in variants(args.layers).items()]
        rows = measure_all(setups, tp, args)
        if rank == 0:
            Path(result).write_text(json.dumps([asdict(r) for r in rows]))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rows.json"
        mp.start_processes(_worker, args=(free_port(), args, str(result)), nprocs=TP,
                           join=True, start_method="spawn")
        return [Row(**row) for row in json.loads(result.read_text())]


def markdown_table(rows: list[Row]) -> str:
    base = next(r for r in rows if r.variant == "none")
    lines = ["| variant | held MB/rank | textbook MB/rank | measured/textbook | held vs none "
             "| peak MB/rank | host pool MB | step s | step vs none |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r.ratio:.3f}" if r.textbook_bytes else "— (0 expected)"
        lines.append(f"| {r.variant} | {r.held_bytes / MB:.1f} | {r.textbook_bytes / MB:.1f} "
                     f"| {ratio} | {r.held_bytes / base.held_bytes:.3f} | {r.peak_bytes / MB:.1f} "
                     f"| {r.host_pool_bytes / MB:.1f} | {r.step_s:.2f} "
                     f"| {r.step_s / base.step_s:.2f} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Held memory per rank, measured next to textbook, and step time."""
    import matplotlib  # a dependency of megaresil (its reports draw with it)

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    names = [r.variant for r in rows]
    xs = range(len(rows))
    fig, (mem, step) = plt.subplots(1, 2, figsize=(12, 4.5))
    mem.bar([x - 0.2 for x in xs], [r.held_bytes / MB for r in rows], 0.4, label="measured")
    mem.bar([x + 0.2 for x in xs], [r.textbook_bytes / MB for r in rows], 0.4,
            label="textbook (Korthikanti et al., fp32)", color="gray")
    mem.set_ylabel("activations held for backward, MB per rank")
    mem.set_yscale("symlog", linthresh=1)
    step.bar(xs, [r.step_s for r in rows], 0.6, color="tab:orange")
    step.set_ylabel("forward + backward, s")
    for ax in (mem, step):
        ax.set_xticks(list(xs), labels=names, rotation=25, ha="right")
        ax.grid(alpha=0.3, axis="y")
    mem.legend(fontsize="small")
    fig.suptitle("Activation memory vs step time at tp=2 (other work shared the CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(rows: list[Row], args: argparse.Namespace, elapsed_s: float,
                  load_before: float) -> None:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    setup = {"tp": TP, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
             "seq": args.seq, "micro_batch": args.micro_batch, "dtype": "float32",
             "dropout": 0.1, "attention_dropout": 0.1, "timed_steps": args.steps,
             "backend": "gloo", "cpu_count": os.cpu_count(), "platform": platform.platform(),
             "torch": torch.__version__, "wall_s": round(elapsed_s, 1),
             "load_average_1min": {"before": round(load_before, 2),
                                   "after": round(os.getloadavg()[0], 2)},
             "note": "step times depend on what else ran on the machine: compare them as "
                     "ratios, and read the load averages"}
    (out / "activation_memory.json").write_text(json.dumps(
        {"setup": setup, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]}, indent=2,
        default=str) + "\n")
    header = (f"Activation memory per rank at tp={TP}: GPT-2 flavour, {args.layers} layers, "
              f"hidden {args.hidden}, {args.heads} heads, seq {args.seq}, micro-batch "
              f"{args.micro_batch}, fp32, dropout 0.1; measured with ActivationMeter; "
              f"step = forward + backward of the layers, fastest of {args.steps}; "
              f"{os.cpu_count()} CPU cores (1-minute load average {load_before:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after), torch {torch.__version__}.\n\n")
    (out / "activation_memory.md").write_text(header + markdown_table(rows) + "\n")
    plot(rows, out / "activation_memory.png")
    print(header + markdown_table(rows))
    print(f"wrote {out}/activation_memory.{{json,md,png}}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed rounds (one step of "
                        "every variant each)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="4 layers, hidden 128, seq 128, 1 timed step (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.heads, args.seq, args.steps = 4, 128, 4, 128, 1
    args.out = args.out or (DEFAULT_OUT / "quick" if args.quick else DEFAULT_OUT)
    return args


def main() -> None:
    args = parse_args()
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    rows = run(args)
    write_results(rows, args, time.perf_counter() - started, load_before)


if __name__ == "__main__":
    main()
