"""Measure the pipeline bubble of each pipeline schedule and compare it with theory.

For p pipeline ranks and m micro-batches, GPipe and 1F1B leave each rank idle
for a fraction (p-1)/(m+p-1) of a step; interleaved schedules with v virtual
chunks per rank shrink the warm-up/cool-down to (p-1)/(v*m+p-1). This script
runs every schedule of `megaresil.parallel.pipeline.schedule_class` over p
gloo processes at a few micro-batch counts and reports the measured bubble
(1 - ideal busy time / step time) next to that theory. Zero-bubble schedules
are held to the interleaved formula too: they can beat it, since the deferred
weight-grad work fills part of the warm-up/cool-down idle time.

Why sleep-emulated compute: each stage chunk is a tiny Linear wrapped in
autograd Functions whose forward sleeps t_f/v and whose backward sleeps
2*t_f/v (half for the input grad, half for the weight grad, so that zero-bubble
schedules, which split the two, see the same work). time.sleep releases the
GIL and uses no CPU, so the step time reflects only the schedule's structure --
the thing the theory predicts -- and not how many cores the machine has. With
real matmuls, p processes on a 2-core box would measure CPU contention instead.
What remains on top of the theory is the real cost of the schedule's runtime:
gloo send/recv of the (micro_batch, 64) activations and Python bookkeeping.

    python bench/pipeline_bubble.py [--pp 4] [--microbatches 4 8 16]
        [--t-forward 0.01] [--steps 3] [--out bench/results] [--quick]

The step time is the slowest rank's, and the fastest of the timed steps: other
processes on a shared machine can only make a step slower.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from megaresil.config import PipelineSchedule
from megaresil.ports import free_port
from megaresil.parallel.pipeline import MULTI_STAGE, schedule_class

MICRO_BATCH = 2
WIDTH = 64  # activations are (MICRO_BATCH, WIDTH): small, so p2p costs little
WARMUP_STEPS = 2  # the first steps set up p2p buffers and the schedule's plan
INTERLEAVED_CHUNKS = 2
SCHEDULES = [PipelineSchedule.gpipe, PipelineSchedule.one_f_one_b,
             PipelineSchedule.interleaved_1f1b, PipelineSchedule.interleaved_zero_bubble]
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Case:
    schedule: PipelineSchedule
    v: int  # virtual chunks per rank
    m: int  # micro-batches per step


@dataclass
class Row:
    schedule: str
    p: int
    v: int
    m: int
    step_s: float  # fastest of the timed steps
    step_times_s: list[float]
    ideal_s: float
    measured_bubble: float
    theoretical_bubble: float
    ratio: float  # measured / theoretical


class _ForwardAndInputGrad(torch.autograd.Function):
    """Identity that sleeps `fwd_s` in forward and `bwd_s` in backward: the
    chunk's forward compute and its input-grad (B) compute."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class _WeightGrad(torch.autograd.Function):
    """Identity on a weight that sleeps `bwd_s` in backward: the weight-grad
    (W) compute. It is a separate autograd node so that zero-bubble schedules
    can defer it without re-running the input-grad sleep."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        return weight.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.bwd_s)
        return grad, None


class EmulatedChunk(nn.Module):
    """A stage chunk with real parameters and grads whose compute time is
    `fwd_s` forward and 2*`fwd_s` backward, whatever the CPU."""

    def __init__(self, fwd_s: float):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.fwd_s = fwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _WeightGrad.apply(self.linear.weight, self.fwd_s)
        hidden = F.linear(x, weight, self.linear.bias)
        return _ForwardAndInputGrad.apply(hidden, self.fwd_s, self.fwd_s)


def theoretical_bubble(p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m + p - 1)


def unsupported(case: Case, p: int) -> str | None:
    """Why `case` cannot run on p ranks, or None if it can."""
    if case.schedule == PipelineSchedule.one_f_one_b and case.m < p:
        return "1F1B needs m >= p"
    if case.schedule in MULTI_STAGE and case.m % p:
        return "interleaved schedules need m % p == 0"
    return None


def plan_cases(p: int, microbatches: list[int]) -> list[Case]:
    """All (schedule, m) cases that can run, printing a note for the others."""
    cases = []
    for schedule in SCHEDULES:
        v = INTERLEAVED_CHUNKS if schedule in MULTI_STAGE else 1
        for m in microbatches:
            case = Case(schedule, v, m)
            reason = unsupported(case, p)
            if reason:
                print(f"note: skipping {schedule.value} at p={p}, m={m}: {reason}")
            else:
                cases.append(case)
    return cases


def build_schedule(case: Case, rank: int, p: int,
                   t_forward: float) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """This rank's stages (virtual stages rank, rank+p, ... as in
    megaresil.parallel.pipeline) driven by the case's schedule."""
    num_stages = p * case.v
    stages = []
    for chunk in range(case.v):
        index = chunk * p + rank
        # Example tensors give the stage its I/O metadata up front, so no shape
        # inference runs; requires_grad marks activations that receive grads.
        example_in = torch.empty(MICRO_BATCH, WIDTH, requires_grad=index > 0)
        example_out = torch.empty(MICRO_BATCH, WIDTH, requires_grad=True)
        stages.append(PipelineStage(EmulatedChunk(t_forward / case.v), index, num_stages,
                                    torch.device("cpu"), input_args=example_in,
                                    output_args=example_out))
    target = stages if case.schedule in MULTI_STAGE else stages[0]
    return schedule_class(case.schedule)(target, n_microbatches=case.m,
                                           loss_fn=lambda output, _target: output.mean())


def time_steps(case: Case, rank: int, p: int, t_forward: float, steps: int) -> list[float]:
    """Seconds of each of `steps` training steps of `case`, as long as its
    slowest rank took."""
    schedule = build_schedule(case, rank, p, t_forward)
    batch = torch.randn(case.m * MICRO_BATCH, WIDTH)
    # Stage 0 (virtual stage 0) lives on rank 0; the last stage on rank p-1.
    args = (batch,) if rank == 0 else ()
    target = batch if rank == p - 1 else None
    for _ in range(WARMUP_STEPS):
        schedule.step(*args, target=target)
    times = []
    for _ in range(steps):
        dist.barrier()  # start every step's clock on all ranks together
        start = time.perf_counter()
        schedule.step(*args, target=target)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends with its last rank
        times.append(elapsed.item())
    return times


def measure(case: Case, p: int, t_forward: float, step_times: list[float]) -> Row:
    # Every rank runs 3*t_forward per micro-batch whatever v: its v chunks
    # each take 1/v of the forward and backward.
    ideal_s = case.m * 3 * t_forward
    # Other processes on a shared box can only add time to a step, so the
    # fastest step is the best estimate of the schedule's own (as in timeit).
    step_s = min(step_times)
    measured = 1 - ideal_s / step_s
    theory = theoretical_bubble(p, case.v, case.m)
    return Row(case.schedule.value, p, case.v, case.m, step_s, step_times, ideal_s, measured,
               theory, measured / theory)


def _worker(rank: int, p: int, port: int, cases: list[Case], t_forward: float, steps: int,
            result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    try:
        rows = [measure(case, p, t_forward, time_steps(case, rank, p, t_forward, steps))
                for case in cases]
        if rank == 0:
            Path(result).write_text(json.dumps([asdict(row) for row in rows]))
    finally:
        dist.destroy_process_group()


def run_cases(p: int, cases: list[Case], t_forward: float, steps: int) -> list[Row]:
    """Run all cases in one group of p spawned gloo processes (starting
    processes and importing torch costs more than the measurements)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rows.json"
        mp.start_processes(_worker, args=(p, free_port(), cases, t_forward, steps, str(result)),
                           nprocs=p, join=True, start_method="spawn")
        return [Row(**row) for row in json.loads(result.read_text())]


def markdown_table(rows: list[Row]) -> str:
    lines = ["| schedule | p | v | m | step_s | measured bubble | theoretical bubble | measured/theory |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.schedule} | {r.p} | {r.v} | {r.m} | {r.step_s:.3f} "
              f"| {r.measured_bubble:.3f} | {r.theoretical_bubble:.3f} | {r.ratio:.2f} |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Measured bubble against m per schedule (solid), with the theory (black)."""
    import matplotlib  # a dependency of megaresil (its reports draw with it)

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for schedule in dict.fromkeys(r.schedule for r in rows):
        mine = [r for r in rows if r.schedule == schedule]
        ax.plot([r.m for r in mine], [r.measured_bubble for r in mine], "o-",
                label=f"{schedule} (v={mine[0].v})")
    # Schedules with the same v share a theory curve: draw it once per v.
    for v, style in zip(sorted({r.v for r in rows}), ("--", ":", "-.")):
        ms = sorted({r.m for r in rows if r.v == v})
        ax.plot(ms, [theoretical_bubble(rows[0].p, v, m) for m in ms], style, color="black",
                label=f"theory (p-1)/(vm+p-1), v={v}")
    ms = sorted({r.m for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, labels=[str(m) for m in ms])
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("bubble fraction")
    ax.set_title(f"Pipeline bubble, p={rows[0].p}: measured (solid) vs theory (black)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(rows: list[Row], args: argparse.Namespace, elapsed_s: float) -> None:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    setup = {"pp": args.pp, "microbatches": args.microbatches, "t_forward_s": args.t_forward,
             "timed_steps": args.steps, "warmup_steps": WARMUP_STEPS, "micro_batch": MICRO_BATCH,
             "width": WIDTH, "backend": "gloo", "compute": "sleep-emulated",
             "cpu_count": os.cpu_count(), "platform": platform.platform(),
             "torch": torch.__version__, "wall_s": round(elapsed_s, 1)}
    (out / "pipeline_bubble.json").write_text(
        json.dumps({"setup": setup, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    header = (f"Pipeline bubble: p={args.pp}, t_forward={args.t_forward}s (backward 2x), "
              f"{args.steps} timed steps, gloo, sleep-emulated compute, "
              f"{os.cpu_count()} CPU cores, torch {torch.__version__}.\n\n")
    (out / "pipeline_bubble.md").write_text(header + markdown_table(rows) + "\n")
    plot(rows, out / "pipeline_bubble.png")
    print(f"wrote {out}/pipeline_bubble.{{json,md,png}}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (processes)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16],
                        help="micro-batch counts m to measure")
    parser.add_argument("--t-forward", type=float, default=0.01,
                        help="emulated forward seconds per micro-batch per rank")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for the results (default bench/results/, "
                             "bench/results/quick/ with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: p=2, m 2 4, 1 timed step")
    args = parser.parse_args()
    if args.quick:
        args.pp, args.microbatches, args.steps = 2, [2, 4], 1
    if args.out is None:  # a smoke run must not overwrite the real numbers
        args.out = DEFAULT_OUT / "quick" if args.quick else DEFAULT_OUT
    return args


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    cases = plan_cases(args.pp, args.microbatches)
    rows = run_cases(args.pp, cases, args.t_forward, args.steps)
    elapsed = time.perf_counter() - start
    print(markdown_table(rows))
    print(f"{len(rows)} cases in {elapsed:.1f} s, process start-up included")
    write_results(rows, args, elapsed)


if __name__ == "__main__":
    main()
