"""Measure context parallelism (parallel.cp) at one sequence length: the
activation memory a rank keeps for backward, its step time, and the bytes
its attention receives, at cp = 1, 2, 4, allgather against p2p, side by side
in one run; the memory against 1/cp of cp=1's and the bytes against theory.

The layers of a llama-flavoured model (grouped-query attention, rotary,
no dropout: cp refuses attention dropout) run as a middle pipeline chunk fed
this rank's (B, T/cp, C) hidden states, so embedding and output head stay
out of the count, as in bench/activation_memory.py. One spawn per cp (world
= cp, gloo, one thread a rank); inside it both comm types are built on the
same process group and timed in turn, round after round.

- held: what the layers' forward keeps for backward (ActivationMeter, the
  bytes of every storage allocated and still alive once the forward is
  done); peak: the most alive at once in forward + backward, the gathered
  or passed keys and values included. Rank 0's (the zig-zag gives every
  rank the same shapes).
- step: forward + backward of the layers, the slowest rank's wall time and
  its CPU time, the fastest of `--steps` rounds. Beyond 2 ranks the
  processes share the 2 cores of this machine, so wall time at cp=4
  measures the oversubscription too: read the CPU seconds per rank.
- bytes: torch.distributed's all_gather, reduce_scatter and
  batch_isend_irecv wrapped, counting what rank 0 receives per layer and
  step. Theory, with kv = the bytes of one rank's k and v (2 B G T/cp D e):
  allgather (cp-1)kv forward, (cp-1)kv again in backward plus (cp-1)kv of
  key and value grads by reduce-scatter, 3(cp-1)kv; p2p (cp-1)kv forward,
  (cp-1) blocks with their grads in backward (2(cp-1)kv) and the grads' last
  hop home (kv), (3cp-2)kv.

    python bench/context_parallel.py [--seq 4096] [--layers 2] [--hidden 256]
        [--heads 8] [--kv-heads 4] [--steps 3] [--cp 1 2 4] [--out bench/results] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# One step of the layers, the bytes held after forward: the activation bench's.
from activation_memory import one_step

from megaresil.config import ContextComm, Flavour, ModelConfig
from megaresil.model.activation_meter import ActivationMeter
from megaresil.model.gpt import GPT
from megaresil.model.init import initialize
from megaresil.parallel.context_parallel import CPGroup
from megaresil.ports import free_port

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
MB = 2**20
E = 4  # fp32


class Received:
    """Bytes this rank receives through the wrapped collectives."""

    def __init__(self) -> None:
        self.total = 0
        self.counting = False
        self._saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> "Received":
        gather, scatter, batch = dist.all_gather, dist.reduce_scatter, dist.batch_isend_irecv
        self._saved = {"all_gather": gather, "reduce_scatter": scatter,
                       "batch_isend_irecv": batch}

        def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            if self.counting:
                self.total += sum(t.nbytes for t in outputs) - tensor.nbytes
            return gather(outputs, tensor, *a, **k)

        def reduce_scatter(output: torch.Tensor, inputs: list[torch.Tensor], *a: Any,
                           **k: Any) -> Any:
            if self.counting:
                self.total += output.nbytes * (len(inputs) - 1)
            return scatter(output, inputs, *a, **k)

        def batch_isend_irecv(ops: list[dist.P2POp]) -> Any:
            if self.counting:
                self.total += sum(op.tensor.nbytes for op in ops if op.op is dist.irecv)
            return batch(ops)

        dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter  # type: ignore[assignment]
        dist.batch_isend_irecv = batch_isend_irecv  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(flavour=Flavour.llama, num_layers=args.layers, hidden_size=args.hidden,
                       num_heads=args.heads, num_kv_heads=args.kv_heads, vocab_size=1024,
                       max_seq_len=args.seq)


def timed(model: GPT, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """(wall, CPU) seconds of one step, the slowest rank's."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    one_step(model, *inputs, None, None)
    both = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu],
                        dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both[0].item(), both[1].item()


def _worker(rank: int, cp: int, port: int, args: argparse.Namespace, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    try:
        cfg = model_config(args)
        comms = [ContextComm.allgather, ContextComm.p2p] if cp > 1 else [ContextComm.allgather]
        gen = torch.Generator().manual_seed(0)
        shape = (args.micro_batch, args.seq, args.hidden)
        whole = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
        models, inputs = {}, {}
        for comm in comms:
            group = CPGroup(dist.group.WORLD if cp > 1 else None, cp, rank, comm)
            model = GPT(cfg, cp=group, seed=1, first=False, last=False)
            initialize(model, cfg, seed=1)
            models[comm] = model
            x0, weights = (group.slice_sequence(t) for t in whole)
            inputs[comm] = (x0.clone().requires_grad_(True), weights)
        rows: dict[str, dict] = {}
        with Received() as received:
            for comm in comms:
                one_step(models[comm], *inputs[comm], None, None)  # warm-up
                meter = ActivationMeter(torch.device("cpu"))
                received.total, received.counting = 0, True
                held = one_step(models[comm], *inputs[comm], None, meter)
                received.counting = False
                rows[comm.value] = {"held_bytes": held,
                                    "peak_bytes": meter.reading().peak_device_bytes,
                                    "received_bytes_per_layer": received.total // args.layers,
                                    "wall_s": [], "cpu_s": []}
        for _ in range(args.steps):
            for comm in comms:
                wall, cpu = timed(models[comm], inputs[comm])
                rows[comm.value]["wall_s"].append(round(wall, 4))
                rows[comm.value]["cpu_s"].append(round(cpu, 4))
        if rank == 0:
            Path(result).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def spawned_rows(worker, world: int, args: argparse.Namespace) -> dict[str, dict]:
    """Run `worker(rank, world, port, args, result_path)` on `world` spawned
    ranks; the rows rank 0 wrote to the result path."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rows.json"
        mp.start_processes(worker, args=(world, free_port(), args, str(result)), nprocs=world,
                           join=True, start_method="spawn")
        return json.loads(result.read_text())


def run_cp(cp: int, args: argparse.Namespace) -> dict[str, dict]:
    return spawned_rows(_worker, cp, args)


def theory_bytes(args: argparse.Namespace, cp: int, comm: str) -> int:
    kv = 2 * args.micro_batch * args.kv_heads * (args.seq // cp) * (args.hidden // args.heads) * E
    if cp == 1:
        return 0
    return (3 * (cp - 1) if comm == "allgather" else 3 * cp - 2) * kv


def rows_of(results: dict[int, dict[str, dict]], args: argparse.Namespace) -> list[dict]:
    base = results[1]["allgather"]
    base_held, base_wall, base_cpu = base["held_bytes"], min(base["wall_s"]), min(base["cpu_s"])
    rows = []
    for cp, by_comm in results.items():
        for comm, r in by_comm.items():
            theory = theory_bytes(args, cp, comm)
            rows.append({"cp": cp, "comm": comm if cp > 1 else "—", **r,
                         "step_wall_s": min(r["wall_s"]), "step_cpu_s": min(r["cpu_s"]),
                         "held_vs_cp1": round(r["held_bytes"] / base_held, 3),
                         "held_vs_cp1_over_cp": round(r["held_bytes"] * cp / base_held, 3),
                         "wall_vs_cp1": round(min(r["wall_s"]) / base_wall, 3),
                         "cpu_vs_cp1": round(min(r["cpu_s"]) / base_cpu, 3),
                         "theory_bytes_per_layer": theory,
                         "measured_vs_theory": (round(r["received_bytes_per_layer"] / theory, 4)
                                                if theory else None)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| cp | comm | held MB/rank | held / cp=1 | held × cp / cp=1 | peak MB/rank "
             "| step wall s | wall / cp=1 | step CPU s/rank | CPU / cp=1 "
             "| received MB/layer | theory MB/layer |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['cp']} | {r['comm']} | {r['held_bytes'] / MB:.1f} "
                     f"| {r['held_vs_cp1']:.3f} | {r['held_vs_cp1_over_cp']:.3f} "
                     f"| {r['peak_bytes'] / MB:.1f} | {r['step_wall_s']:.3f} "
                     f"| {r['wall_vs_cp1']:.2f} | {r['step_cpu_s']:.3f} | {r['cpu_vs_cp1']:.2f} "
                     f"| {r['received_bytes_per_layer'] / MB:.3f} "
                     f"| {r['theory_bytes_per_layer'] / MB:.3f} |")
    return "\n".join(lines)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed rounds")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="seq 256, 1 timed round")
    args = parser.parse_args()
    argv = sys.argv[1:]
    if args.quick:
        args.seq, args.steps = 256, 1
    if 1 not in args.cp:
        args.cp = [1, *args.cp]
    args.out = args.out or (DEFAULT_OUT / "quick" if args.quick else DEFAULT_OUT)
    started, before, load_before = time.perf_counter(), uptime(), os.getloadavg()[0]
    results = {cp: run_cp(cp, args) for cp in args.cp}
    after, load_after = uptime(), os.getloadavg()[0]
    rows = rows_of(results, args)
    setup = {"seq": args.seq, "layers": args.layers, "hidden": args.hidden,
             "heads": args.heads, "kv_heads": args.kv_heads, "micro_batch": args.micro_batch,
             "flavour": "llama", "dtype": "float32", "timed_steps": args.steps,
             "backend": "gloo", "threads_per_rank": 1, "cpu_count": os.cpu_count(),
             "platform": platform.platform(), "torch": torch.__version__,
             "wall_s": round(time.perf_counter() - started, 1),
             "uptime": {"before": before, "after": after},
             "load_average_1min": {"before": round(load_before, 2), "after": round(load_after, 2)}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "context_parallel.json").write_text(
        json.dumps({"setup": setup, "rows": rows}, indent=1) + "\n")
    header = (f"# Context parallelism at one sequence length\n\n"
              f"`python bench/context_parallel.py {' '.join(argv)}`: the layers of a llama "
              f"flavour ({args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
              f"{args.kv_heads} kv heads), seq {args.seq}, micro-batch {args.micro_batch}, fp32, "
              f"gloo, one thread a rank, {os.cpu_count()} CPU cores (cp=4's 4 ranks share them); "
              f"step = forward + backward, fastest of {args.steps}; torch {torch.__version__}. "
              f"Load: `{before}` before, `{after}` after.\n\n")
    (args.out / "context_parallel.md").write_text(header + markdown(rows) + "\n")
    print(header + markdown(rows))
    print(f"wrote {args.out}/context_parallel.{{json,md}}")


if __name__ == "__main__":
    main()
