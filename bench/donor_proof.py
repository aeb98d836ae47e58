"""What a live-replacement donor's proof costs (issue 46), side by side with a step.

With live replacement on, every replica check also sums what a rank would
hand over (weights, fp32 main weights, AdamW moments), and a rank handing
over sums what it carries. This trains a few steps of each workload in one
process (tp = pp = dp = 1: the whole state on one rank) and times, after
each step: the replica check's own sum of the weights (what it read before),
the added sum of the hand-over's tensors, and carried_state (the hand-over,
its sum included). CPU seconds of this process (torch on one thread), not
wall time: a loaded machine stretches wall time, not the work. Per-rank
figures of a sharded job scale with its per-rank state.

    python bench/donor_proof.py [--workloads demo 1gb] [--steps 6] [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megaresil.config import load_recipe
from megaresil.parallel.layout import ParallelLayout
from megaresil.ports import free_port
from megaresil.train.handover import carried_state, donated_tensors
from megaresil.train.loop import Trainer
from megaresil.train.replicas import quick_checksum

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "gpt-tiny.yaml"
ONE_RANK = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "logging.progress=false",
            "logging.tensorboard=false", "train.eval_batches=0", "checkpoint.interval=0"]
WORKLOADS = {
    "demo": [],  # gpt-tiny's 2.6M parameters, its global batch
    # bench/replacement.py's 1 GB model (67.3M parameters), one sample of 32 tokens a step.
    "1gb": ["model.num_layers=5", "model.hidden_size=1024", "model.num_heads=16",
            "data.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=1",
            "optimizer.warmup_steps=2"],
}
CPU = torch.device("cpu")


def cpu_seconds(fn) -> float:
    started = time.process_time()
    fn()
    return time.process_time() - started


def measure(workload: str, steps: int, run_dir: Path) -> dict:
    cfg = load_recipe(RECIPE, [*ONE_RANK, f"train.steps={steps}", f"run.dir={run_dir}",
                               *WORKLOADS[workload]])
    trainer = Trainer(cfg, ParallelLayout.from_config(cfg.parallel, CPU))
    times: dict[str, list[float]] = {"step": [], "weights": [], "donated": [], "hand_over": []}
    for _ in range(steps):
        times["step"].append(cpu_seconds(trainer.train_step))
        weights = [p for _, p in trainer.replicated_state(False)]
        times["weights"].append(cpu_seconds(lambda: quick_checksum(weights, CPU).item()))
        donated = donated_tensors(trainer.checkpoint_state)
        times["donated"].append(cpu_seconds(lambda: quick_checksum(donated, CPU).item()))
        times["hand_over"].append(cpu_seconds(
            lambda: carried_state(trainer.checkpoint_state, 0, 1)))
    trainer.close()
    median = {k: statistics.median(v[2:]) for k, v in times.items()}  # warm steps only
    nbytes = sum(t.numel() * t.element_size() for t in donated_tensors(trainer.checkpoint_state))
    return {"workload": workload, "state_bytes": nbytes, **{f"{k}_s": v for k, v in median.items()},
            "added_share_of_step": median["donated"] / median["step"]}


def markdown(rows: list[dict], run: dict) -> str:
    lines = [f"`{run['command']}`, {run['date']}, load average {run['load_before']} -> "
             f"{run['load_after']} on {os.cpu_count()} CPUs; CPU seconds, medians of the warm steps",
             "", "| workload | state MB | step s | weights' sum ms (the check before) | added sum "
             "ms | added, share of a step | hand-over with its sum ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['workload']} | {r['state_bytes'] / 1e6:.0f} | {r['step_s']:.3f} | "
              f"{r['weights_s'] * 1e3:.1f} | {r['donated_s'] * 1e3:.1f} | "
              f"{r['added_share_of_step']:.1%} | {r['hand_over_s'] * 1e3:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS),
                        default=sorted(WORKLOADS, reverse=True))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    run = {"command": "python bench/donor_proof.py", "date": time.strftime("%Y-%m-%d %H:%M"),
           "load_before": round(os.getloadavg()[0], 1)}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rows = [measure(w, args.steps, Path(tmp) / w) for w in args.workloads]
    finally:
        dist.destroy_process_group()
    run["load_after"] = round(os.getloadavg()[0], 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "donor_proof.json").write_text(json.dumps({"run": run, "rows": rows}, indent=1))
    (args.out / "donor_proof.md").write_text(markdown(rows, run))
    print(markdown(rows, run))


if __name__ == "__main__":
    main()
