"""The console's story of a run, told by the rank that writes metrics: a
start banner and an end summary. Both ride in events (generation_started,
run_finished), so the launcher prints them in order with each checkpoint and
incident between; without a megaresil launcher the rank prints them itself."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import torch

from megaresil.checkpoint import format as fmt
from megaresil.config import BatchRamp, RecipeConfig
from megaresil.model.gpt import GPT
from megaresil.run_lock import HELD_ENV
from megaresil.train.save_schedule import longest_interval, plural

# Set by megaresil's launcher where it chose OMP_NUM_THREADS (the user did
# not): how it split the cores, for the banner's word on threads.
THREADS_SPLIT_ENV = "MEGARESIL_THREADS_SPLIT"


def parameters(cfg: RecipeConfig) -> int:
    """The whole model's parameters, counted on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg.model).parameters())


def batch_words(cfg: RecipeConfig) -> str:
    """The tokens a step trains: the global batch's, or a ramp's from START up."""
    t, tokens = cfg.train, cfg.train.global_batch_size * cfg.data.seq_len
    ramp = BatchRamp.of(t)
    if ramp is None:
        return f"{tokens:,} tokens per step"
    return (f"{ramp.start * cfg.data.seq_len:,} tokens per step ramping up to {tokens:,} "
            f"(train.rampup_batch_size: batch {ramp.start} to {t.global_batch_size} by "
            f"{ramp.increment} over {ramp.samples:,} samples)")


def banner(cfg: RecipeConfig, start_step: int, compiled: str = "") -> str:
    """`compiled`: what train.compile compiled (train/compiling.py), if anything."""
    p = cfg.parallel
    interval = cfg.checkpoint.interval
    longest = plural(longest_interval(cfg.train.steps), "step")
    policy = {"auto": f"auto (Young/Daly, at most {cfg.checkpoint.max_minutes_at_risk:g} min or "
                      f"{longest} apart)",
              0: "never (checkpoint.interval=0)"}.get(interval, f"every {interval} steps")
    start = f"resumes from step {start_step}" if start_step else "starts at step 0"
    context = f" cp={p.cp} ({p.cp_comm_type.value})" if p.cp > 1 else ""
    sharded = (f" (FSDP2: {sharding(p.dp, p.dp_shard, p.cp, p.ep)})" if p.dp_shard > 1 else "")
    return (f"training tp={p.tp} pp={p.pp} dp={p.dp}{sharded}{context}, {parameters(cfg) / 1e6:.1f}M "
            f"parameters, {batch_words(cfg)}, {cfg.train.steps} steps; run dir "
            f"{cfg.run.dir}; checkpoints {policy}; {threads()}; {compiled and compiled + '; '}"
            f"{start}")


def sharding(dp: int, dp_shard: int, cp: int, ep: int) -> str:
    """How the data-parallel ranks hold the model under parallel.dp_shard:
    sharded over the cp ranks too, and the experts, cut along ep, over
    dp_shard / ep and cp (parallel/fsdp.py)."""
    over = f"{dp_shard * cp} (dp_shard {dp_shard} x cp {cp})" if cp > 1 else f"{dp_shard}"
    expert_rows = dp_shard // ep * cp
    rows = f"their rows over {expert_rows}" if expert_rows > 1 else "not sharded further"
    experts = f"; experts cut along ep={ep}, {rows}" if ep > 1 else ""
    if dp_shard == dp:
        return f"parameters, grads and optimizer state sharded over all {over}{experts}"
    return f"HSDP, {dp // dp_shard} replicas each sharded over {over}{experts}"


def threads() -> str:
    """How many CPU threads each rank computes with, and who chose that:
    on a shared CPU it sets the speed more than anything else."""
    said = f"{plural(torch.get_num_threads(), 'thread')} per rank"
    if split := os.environ.get(THREADS_SPLIT_ENV):
        return f"{said} ({split}; OMP_NUM_THREADS chooses)"
    if "OMP_NUM_THREADS" in os.environ:
        return f"{said} (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
    return f"{said} (torch's default; OMP_NUM_THREADS chooses)"


def summary(cfg: RecipeConfig, root: Path, steps: int, consumed_samples: int,
            last: Optional[dict], goodput: dict) -> str:
    """`consumed_samples`: the data position (the batches trained, a ramp's
    smaller ones too, and any passed over)."""
    newest = fmt.committed_checkpoints(root)
    loss = f"{last['loss']:.4f}" if last else "-"
    return (f"done: {steps} steps, {consumed_samples * cfg.data.seq_len:,} tokens, "
            f"{goodput.get('wall_s', 0.0) / 60:.1f} min wall, goodput "
            f"{100 * goodput.get('goodput', 0.0):.1f}%, final loss {loss}; last checkpoint "
            f"{newest[0] if newest else 'none'}")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def tell(line: str) -> None:
    """A line of the story, printed here when no megaresil launcher prints
    it from the events (under the user's own torchrun)."""
    if HELD_ENV not in os.environ:
        say(f"megaresil: {line}")
