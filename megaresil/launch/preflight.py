"""The launcher's pre-flight: every check that can refuse a launch, run
before a worker starts (a bad input costs one line, not a job's start-up),
and what the launch then needs to know. The order is the user's: the
machine, the recipe against the run directory, the data (timed, reported
as the data-preparation phase), then the node's admission."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from megaresil.checkpoint.local.runs import other_runs_line
from megaresil.checkpoint.paths import RunPaths
from megaresil.checkpoint.recipe_check import check_resume_recipe, newest_manifest
from megaresil.config import ConfigError, RecipeConfig
from megaresil.events import EventLog
from megaresil.launch.checks import (
    check_backend,
    check_data,
    check_links,
    check_local_gpus,
    check_run_records,
    replacement_warning,
)
from megaresil.launch.device_memory import DeviceMemoryReader, read_device_memory
from megaresil.launch.health import admission_refusal
from megaresil.launch.membership import Membership
from megaresil.observe.startup import StartupPhases
from megaresil.parallel.layout import visible_gpus
from megaresil.resilience.faults import check_device_faults, check_fault_ranks
from megaresil.train.lr_schedule import moved_by_steps_line
from megaresil.train.save_schedule import never_saving_warning


@dataclass(frozen=True)
class Preflight:
    nproc: int  # workers on this node
    gpus: int  # visible on this node
    gpus_needed: int  # by this node's workers (0 on the CPU)
    run_dir: Path
    paths: RunPaths
    local_root: Optional[Path]  # the local tier's root, None when it is off
    # Why this node's health checks refuse it (the launch ends with exit 1).
    refusal: Optional[str] = None


def preflight(cfg: RecipeConfig, membership: Membership, *,
              device_memory: DeviceMemoryReader = read_device_memory) -> Preflight:
    """Run the checks (each raises its one-line error), create the run
    directory, admit the node and print the launch's warnings.
    `device_memory`: what reads this node's GPU memory."""
    nproc = membership.nproc_per_node or cfg.parallel.world_size
    gpus = visible_gpus()
    check_local_gpus(nproc, gpus)
    check_device_memory(cfg, gpus, device_memory)
    check_backend(cfg)
    check_links(cfg)
    check_run_records(Path(cfg.run.dir))
    paths = RunPaths.of(cfg)
    local_root = paths.local_tier_root()  # the tier's rule, before any worker starts
    check_device_faults(cfg.faults, gpus)
    check_resume_recipe(cfg)
    check_fault_ranks(cfg.faults, cfg.parallel.world_size)
    data_started = time.monotonic()
    check_data(cfg)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    gpus_needed = nproc if gpus else 0
    flight = Preflight(nproc, gpus, gpus_needed, run_dir, paths, local_root)
    refusal = admission_refusal(cfg.resilience.health, run_dir, gpus, gpus_needed,
                                EventLog(run_dir))
    if refusal:
        return replace(flight, refusal=refusal)
    StartupPhases(EventLog(run_dir), 0, say=lambda line: print(line, file=sys.stderr)).finished(
        "data preparation", time.monotonic() - data_started)
    for warning in filter(None, (never_saving_warning(cfg), replacement_warning(cfg),
                                 other_runs_line(cfg), resumed_lr_line(cfg))):
        print(warning, file=sys.stderr)
    return flight


def resumed_lr_line(cfg: RecipeConfig) -> Optional[str]:
    """Whether resuming from the newest checkpoint under a changed
    train.steps moves the LR (lr_schedule.moved_by_steps_line); the other
    schedule keys cannot change unnoticed (the recipe check refuses them)."""
    found = newest_manifest(cfg)
    if found is None:
        return None
    _, manifest = found
    saved_steps = manifest["recipe"].get("train", {}).get("steps", cfg.train.steps)
    return moved_by_steps_line(cfg.optimizer, manifest["step"], saved_steps, cfg.train.steps)


def check_device_memory(cfg: RecipeConfig, gpus: int, device_memory: DeviceMemoryReader) -> None:
    """On a GPU node, a layout whose estimated peak does not fit the node's
    smallest GPU is refused (ConfigError, one line with the changes that
    fit); skipped on the CPU and where the memory cannot be read."""
    if not gpus:
        return
    device_bytes = device_memory()
    if device_bytes is None:
        return
    from megaresil.train.memory_fit import memory_refusal  # builds meta models: only on GPUs

    refusal = memory_refusal(cfg, device_bytes)
    if refusal:
        raise ConfigError("parallel", refusal)
