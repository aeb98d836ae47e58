"""Training cases with injected faults, each through a FaultInjector, all in
one spawned group of gloo ranks (the numerical-fault tests share it): a case
stopped by a PersistentNumericalFault leaves its one line in stopped.<rank>."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from megaresil.config import load_recipe
from megaresil.events import EventLog, read_events, read_metrics
from megaresil.parallel.layout import ParallelLayout
from megaresil.ports import free_port
from megaresil.resilience.faults import FaultInjector
from megaresil.resilience.numerics import PersistentNumericalFault
from megaresil.resilience.supervision import Supervision
from megaresil.train.loop import Trainer

from tests.harness.dist import RECIPE, TINY, spawn_ranks


def run_cases(cases: dict[str, list[str]], world: int, out: Path) -> Path:
    """Train every case (TINY plus its overrides) into out/<name>, in order."""
    spawn_ranks(_worker, (world, free_port(), cases, str(out)), world)
    return out


def _worker(rank: int, world: int, port: int, cases: dict[str, list[str]], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, overrides in cases.items():
            run_case(Path(out) / name, overrides)
    finally:
        dist.destroy_process_group()


def run_case(run_dir: Path, overrides: list[str]) -> None:
    cfg = load_recipe(RECIPE, TINY + overrides + [f"run.dir={run_dir}"])
    layout = ParallelLayout.from_config(cfg.parallel, torch.device("cpu"))
    faults = FaultInjector(cfg.faults, rank=layout.rank, run_dir=run_dir,
                           checkpoint_root=run_dir / "checkpoints",
                           events=EventLog(run_dir, layout.rank))
    try:
        Trainer(cfg, layout, Supervision(faults=faults)).run()
    except PersistentNumericalFault as err:
        (run_dir / f"stopped.{layout.rank}").write_text(str(err))
    dist.barrier()


def losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad norm), the last line for a step winning."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r}


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == name]
