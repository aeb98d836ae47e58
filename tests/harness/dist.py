"""Run several training cases inside one group of spawned gloo processes.

Starting processes and importing torch is most of the cost of a multi-rank
test on 2 cores, so all cases with the same world size share one process
group; each case builds its own ParallelLayout (a fresh DeviceMesh) over it.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from megaresil.config import RecipeConfig, load_recipe
from megaresil.parallel.fsdp import local_part
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.sharding import spec_of
from megaresil.ports import free_port
from megaresil.train import step as step_compute
from megaresil.train.loop import Trainer
from tests.harness.cli import ROOT

RECIPE = ROOT / "recipes" / "gpt-tiny.yaml"

# A model small enough that a 10-step run takes well under a second, with a
# vocabulary that needs padding at every tp (300 -> 384/512), 4 layers for
# pp=4 or pp=2 x vpp=2, and 4 micro-batches per step at dp=1.
TINY = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "data.source=synthetic", "data.seq_len=16", "model.max_seq_len=16",
        "model.num_layers=4", "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=300",
        "train.micro_batch_size=2", "train.global_batch_size=8", "train.steps=10",
        "train.eval_batches=0", "optimizer.warmup_steps=2", "optimizer.lr=3e-3",
        "logging.progress=false", "logging.tensorboard=false",
        "checkpoint.interval=0"]  # saves only where a case asks (exit_at_step, an interval)
LLAMA = ["model.flavour=llama", "model.num_kv_heads=4", "model.ffn_hidden_size=96"]
# A mixture of experts: a dense first layer, then 4 experts (top-2, 48 wide
# per tp=2 rank) with a shared expert, the routing losses and the expert bias on.
MOE = LLAMA + ["model.moe.num_experts=4", "model.moe.first_dense_layers=1",
               "model.moe.shared_expert_hidden_size=32", "model.moe.aux_loss_coeff=0.01",
               "model.moe.z_loss_coeff=0.001", "model.moe.bias_update_rate=0.01"]


@dataclass
class Case:
    name: str
    overrides: list[str] = field(default_factory=list)
    dump_grads: bool = False  # save full (gathered) grads after one step's backward
    resume: bool = False  # after stopping at train.exit_at_step, run again without it
    kill_rank_in_save: Optional[tuple[int, int]] = None  # (rank, step): SIGKILL mid-write


def recipe_for(case: Case, run_dir: Path, *, without_exit: bool = False):
    overrides = [o for o in case.overrides if not (without_exit and o.startswith("train.exit_at"))]
    return load_recipe(RECIPE, TINY + overrides + [f"run.dir={run_dir}"])


def kill_during_save(trainer: Trainer, rank: int, step: int) -> None:
    """Make `rank` die by SIGKILL while writing checkpoint `step`'s data."""
    if dist.get_rank() != rank:
        return
    write = trainer.checkpointing.global_tier.backend.write

    def dying_write(directory, rects, rank):
        if directory.name.startswith(f"step_{step:07d}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return write(directory, rects, rank)

    trainer.checkpointing.global_tier.backend.write = dying_write


def train_case(case: Case, run_dir: Path, layout: ParallelLayout,
               trainer: Optional[Trainer] = None) -> Trainer:
    """Train a case to the end (or to its exit step, then on again if it
    resumes), from `trainer` where given (built for the case, untrained)."""
    trainer = trainer or Trainer(recipe_for(case, run_dir), layout)
    if case.kill_rank_in_save:
        kill_during_save(trainer, *case.kill_rank_in_save)
    outcome = trainer.run()
    if case.resume and outcome == "exited":
        trainer = Trainer(recipe_for(case, run_dir, without_exit=True), layout)
        trainer.run()
    return trainer


def gather_full_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter's grad as the global tensor (TP and EP shards joined,
    vocab padding cut), after the step's grad reductions."""
    trainer.sync_grads()
    layout = trainer.layout
    joined = {}  # the parameters' .grad stay as they are: the trainer trains on
    if trainer.sharded_optimizer:  # put the DP (experts: EDP) row shards back together
        for shard in trainer.optimizer.shards:
            rows = torch.zeros(shard.rows_per_rank, *shard.param.shape[1:])
            rows[: shard.stop - shard.start] = shard.view.grad
            replicas = spec_of(shard.param).replicated_over
            gathered = [torch.empty_like(rows) for _ in range(layout.size(*replicas))]
            dist.all_gather(gathered, rows, group=layout.group(*replicas))
            joined[shard.param] = torch.cat(gathered)[: shard.param.shape[0]].reshape(shard.param.shape)
    grads = {}
    for key, param in trainer.named_parameters():
        spec = spec_of(param)
        if spec.pipeline_copy:
            continue
        grad = joined.get(param, param.grad)
        if isinstance(grad, DTensor):  # FSDP2's shard over dp_shard: gathered
            grad = grad.full_tensor()
        for shard in spec.shards:
            if shard.axis in ("tp", "ep") and layout.size(shard.axis) > 1:
                parts = [torch.empty_like(grad) for _ in range(layout.size(shard.axis))]
                dist.all_gather(parts, grad.contiguous(), group=layout.group(shard.axis))
                grad = torch.cat(parts, dim=shard.dim)
        if key in ("embed.tokens.weight", "head.weight"):
            grad = grad[: trainer.cfg.model.vocab_size]
        grads[key] = grad
    return grads


def forget_step(trainer: Trainer) -> None:
    """Zero the grads of a step computed for its grads alone, as an attempt
    that is not applied leaves them (train/step.zero_grads); the trainer
    then trains from step 0 as a fresh one: dropout draws no global RNG
    (parallel/random.py), and the routing counters restart each attempt."""
    step_compute.zero_grads(trainer.parts)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state tensors held by this rank."""
    inner = getattr(optimizer, "inner", optimizer)
    return sum(local_part(t).numel() * t.element_size() for state in inner.state.values()
               for t in state.values() if torch.is_tensor(t) and t.ndim > 0)


def run_case(case: Case, out: Path, cfg: Optional[RecipeConfig] = None) -> None:
    """One rank's part of a case; `cfg`: its recipe, where the parent loaded it."""
    run_dir = out / case.name
    cfg = cfg or recipe_for(case, run_dir)
    layout = ParallelLayout.from_config(cfg.parallel, torch.device("cpu"))
    trainer = Trainer(cfg, layout)
    if case.dump_grads:
        trainer.forward_backward(trainer.batches(trainer.train_data, 0))
        grads = gather_full_grads(trainer)
        if layout.tp_rank == 0 and layout.dp_rank == 0 and layout.coordinate("cp") == 0:
            # one file per pipeline stage
            torch.save(grads, run_dir / f"grads.{layout.pp_rank}.pt")
        forget_step(trainer)
    trainer = train_case(case, run_dir, layout, trainer)
    (run_dir / f"opt_state_bytes.{dist.get_rank()}").write_text(
        str(optimizer_state_bytes(trainer.optimizer)))
    dist.barrier()


# What every rank imports, loaded once into a fork server that the ranks of
# every multi-rank test fork from: a spawned rank imported torch and the
# trainer again, ~3.4 s of CPU each (an 8-rank group: ~14 s of a 2-core machine).
PRELOAD = ["torch.distributed", "megaresil.train.loop", "megaresil.checkpoint.manager"]


def _in_parent_environment(rank: int, fn, environ: dict, *args) -> None:
    # A forked rank inherits the fork server's environment, taken when the
    # server started; a spawned one had its parent's, as of the spawn.
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.start_processes(fn, args, nprocs), each rank forked
    from a server that has imported PRELOAD; raises as it does on a failed rank."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # once the server runs: no effect
    mp.start_processes(_in_parent_environment, args=(fn, dict(os.environ), *args),
                       nprocs=nprocs, join=True, start_method="forkserver")


def join_group(rank: int, world: int, port: int) -> None:
    """A spawned rank joins the `world`-rank gloo group on `port`, one thread each."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _worker(rank: int, world: int, port: int, cases: list[Case], out: str,
            cfgs: list[RecipeConfig]) -> None:
    join_group(rank, world, port)
    try:
        for case, cfg in zip(cases, cfgs, strict=True):
            run_case(case, Path(out), cfg)
    finally:
        dist.destroy_process_group()


def run_cases(world: int, cases: list[Case], out: Path) -> None:
    """Run `cases` (each a layout of `world` ranks) in one spawned group."""
    if world == 1:
        for case in cases:
            run_reference(case, out)
        return
    # Loaded once here, not on each rank (~0.1 s of CPU a recipe).
    cfgs = [recipe_for(case, out / case.name) for case in cases]
    spawn_ranks(_worker, (world, free_port(), cases, str(out), cfgs), world)


def run_reference(case: Case, out: Path) -> None:
    """The single-process run of a case, in this process."""
    cfg = recipe_for(case, out / case.name)
    layout = ParallelLayout(device=torch.device("cpu"))
    trainer = Trainer(cfg, layout)
    if case.dump_grads:
        trainer.forward_backward(trainer.batches(trainer.train_data, 0))
        torch.save({k: p.grad[: cfg.model.vocab_size] if k in ("embed.tokens.weight", "head.weight")
                    else p.grad for k, p in trainer.named_parameters()},
                   out / case.name / "grads.0.pt")
        forget_step(trainer)
    train_case(case, out / case.name, layout, trainer)


def load_grads(run_dir: Path) -> dict[str, torch.Tensor]:
    """All stages' gathered grads of a case, merged."""
    grads = {}
    for path in sorted(run_dir.glob("grads.*.pt")):
        grads.update(torch.load(path))
    return grads
