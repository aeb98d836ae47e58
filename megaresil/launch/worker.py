"""One rank: inside torchrun (or our own launch), or as one Slurm task per
rank. Builds the process group, trains with restarts, reports how it ended."""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from megaresil.checkpoint.paths import RunPaths
from megaresil.checkpoint.recipe_check import check_resume_recipe
from megaresil.config import ConfigError, RecipeConfig, load_recipe, validate, validate_world_size
from megaresil.launch.checks import check_links, check_run_records
from megaresil.resilience.preemption import PREEMPTED_EXIT
from megaresil.resilience.supervision import end_with_agent
from megaresil.run_lock import held_by_worker
from megaresil.slurm import SlurmStep
from megaresil.train.save_schedule import plural
from megaresil.train.story import THREADS_SPLIT_ENV
from megaresil.worker_env import WorkerEnv

ERRORED = "errored"  # an outcome: this rank failed, and the launcher restarts the workers


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ
                                                    and "WORLD_SIZE" in os.environ)


def choose_threads(local_world: int) -> int:
    """OMP_NUM_THREADS for this node's workers, unless the user set it: the
    cores split among them, so 8 ranks on 2 cores don't thrash. The split is
    left for the banner to name (an OMP_NUM_THREADS beside it is ours, from
    an earlier launch in this process). Returns the threads per worker."""
    if "OMP_NUM_THREADS" not in os.environ or THREADS_SPLIT_ENV in os.environ:
        cores = available_cores()
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // local_world))
        os.environ[THREADS_SPLIT_ENV] = (f"{plural(cores, 'core')} over "
                                         f"{plural(local_world, 'rank')} on this node")
    return int(os.environ["OMP_NUM_THREADS"])


def available_cores(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may run on: its CPU affinity (taskset, a Slurm
    cpuset), capped by a cgroup v2 CPU quota (a container's --cpus, a pod's
    limit), rounded up. os.cpu_count() counts the whole machine, so 8 ranks
    in a 2-core container would each get the machine's share."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    try:
        quota, period = cgroup.read_text().split()
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1, min(cores, math.ceil(int(quota) / int(period))))


def name_process(rank: int) -> None:
    """Name this worker by its rank where `ps`, `top` and `pgrep` look
    (/proc/PID/comm, 15 bytes: `megaresil-r12`), so finding rank 3's process
    needs no reading of /proc/PID/environ. Writing one's own comm is what
    prctl(PR_SET_NAME) does, without a C call; where there is no /proc (not
    Linux) the process keeps its name."""
    try:
        Path("/proc/self/comm").write_text(f"megaresil-r{rank}"[:15])
    except OSError:
        pass


def adapt_to_world(cfg: RecipeConfig, world: int) -> RecipeConfig:
    """Elastic membership: keep tp and pp, derive dp from the world size that
    actually formed; refuse clearly when that is impossible. Under sharded
    data parallelism full sharding stays full, and a shard group keeps its
    size where it still divides dp (a node lost from dp_shard-wide nodes),
    else shrinks to the largest size that does: checkpoints load in any."""
    p = cfg.parallel
    if world == p.world_size or world % p.model_parallel_size:
        validate_world_size(cfg, world)
        return cfg
    dp = world // p.model_parallel_size
    dp_shard = dp if p.dp_shard == p.dp else math.gcd(dp, p.dp_shard)
    resized = dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=dp, dp_shard=dp_shard))
    try:
        validate(resized)
    except ConfigError as err:
        raise ConfigError("parallel.dp", f"the job re-formed with {world} ranks, so dp becomes "
                          f"{resized.parallel.dp}, which this recipe cannot use: {err}",
                          "choose a train.global_batch_size (and a train.rampup_batch_size "
                          "START and INCREMENT) divisible at every world size the job may "
                          "shrink to.") from None
    return resized


def trainer_job(cfg: RecipeConfig, device: torch.device):
    """The job a worker restarts: one Trainer per generation, on a layout
    built from that generation's process groups."""
    from megaresil.parallel.layout import ParallelLayout
    from megaresil.train.loop import Trainer

    def make(supervision):
        return Trainer(cfg, ParallelLayout.from_config(cfg.parallel, device), supervision)

    return make


def slurm_task(recipe: str, overrides: list[str], cfg: RecipeConfig, step: SlurmStep) -> int:
    """One Slurm task per rank: this task is the worker; returns the exit
    code the batch script acts on (75 after a preemption save: requeue)."""
    world = cfg.parallel.world_size
    os.environ.update(step.worker_env(world))
    # torch is imported already, so the variable alone would not reach its pool.
    torch.set_num_threads(choose_threads(step.tasks_on_node))
    return PREEMPTED_EXIT if worker(recipe, overrides) == "preempted" else 0


@record
def worker(recipe: str, overrides: list[str]) -> str:
    """One rank: build the process group, train with restarts, report how it ended."""
    from megaresil.parallel.layout import pick_device
    from megaresil.resilience.watchdog.abort import NCCL_WORKER_ENV
    from megaresil.train.precision import env_before_cuda

    env = WorkerEnv.parse()  # the only read of the launcher's variables: handed down from here
    end_with_agent(env)
    name_process(env.rank)
    cfg = adapt_to_world(load_recipe(recipe, overrides), env.world)
    for key, value in env_before_cuda(cfg.train.deterministic).items():  # CUDA has not started
        os.environ.setdefault(key, value)
    device = pick_device(env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if cfg.resilience.in_process:  # TorchElastic's 1 would kill the process on an NCCL error
            os.environ.update(NCCL_WORKER_ENV)
    if not env.under_launcher:  # a torchrun of the user's own: no launcher checked them
        check_links(cfg)
        check_run_records(Path(cfg.run.dir))
        check_resume_recipe(cfg)
    paths = RunPaths.of(cfg)
    with held_by_worker(paths.run_dir, env.rank, paths.checkpoint_root,
                        paths.local_tier_root()):  # refused: the error goes to the console
        outcome = _train_as_worker(cfg, env, device)
    if outcome == ERRORED:
        exit_abandoning_saves(1)
    return outcome


def exit_abandoning_saves(code: int) -> None:
    """Exit now. A failure abandons this rank's save threads, blocked in
    collectives its peers never join; the interpreter's exit would join
    them, up to the checkpoint timeout, and hold up the relaunch. What they
    left half-written is removed when the job next starts."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _train_as_worker(cfg: RecipeConfig, env: WorkerEnv, device: torch.device) -> str:
    from megaresil.fencing import Fenced
    from megaresil.resilience.restart import JobFailed, run_worker
    from megaresil.resilience.watchdog.abort import HangAbort

    try:
        return run_worker(cfg, env, device, trainer_job(cfg, device))
    except JobFailed:
        if not env.under_launcher:
            raise  # not under megaresil's launcher: the exit status must say it
        return "failed"  # exit 0: no relaunch; the launcher reports run_failed
    except (Exception, HangAbort, Fenced) as err:  # noqa: BLE001 (recorded, not lost)
        # Already in events.jsonl (and on the launcher's console, one line):
        # record it for TorchElastic, but spare the console the traceback.
        get_error_handler().record_exception(err)
        return ERRORED
