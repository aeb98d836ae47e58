"""Start training: as the TorchElastic launcher (outside torchrun) or as one
worker (inside torchrun or our own launch)."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from megaresil.config import RecipeConfig, load_recipe, validate_world_size


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ
                                                    and "WORLD_SIZE" in os.environ)


def worker_threads(world_size: int) -> int:
    """Split the cores among local workers so 8 ranks on 2 cores don't thrash."""
    return max(1, (os.cpu_count() or 1) // world_size)


def launch(recipe: str, overrides: list[str], cfg: RecipeConfig) -> int:
    """Run `world` local workers under a TorchElastic agent; returns the exit code."""
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads(world)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world,
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=f"megaresil-{os.getpid()}",
        max_restarts=0, monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "elastic")),
    )
    worker_cmd = ["-m", "megaresil", "train", recipe, *overrides]
    try:
        elastic_launch(config, sys.executable)(*worker_cmd)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(f"megaresil: training failed: first failure on rank {rank} "
              f"(exit code {failure.exitcode}): {failure.message}", file=sys.stderr)
        return 1
    return 0


@record
def worker(recipe: str, overrides: list[str]) -> None:
    """One rank: join the process group, build the layout, train."""
    from megaresil.parallel.layout import ParallelLayout, backend_for, pick_device
    from megaresil.train.loop import train

    cfg = load_recipe(recipe, overrides)
    validate_world_size(cfg, int(os.environ["WORLD_SIZE"]))
    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device))
    try:
        train(cfg, ParallelLayout.from_config(cfg.parallel, device))
    finally:
        dist.destroy_process_group()
