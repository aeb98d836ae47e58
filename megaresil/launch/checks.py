"""What the launcher refuses before any worker starts, so a recipe error
is one clear line (exit 2) instead of the same failure in every worker; and
what it says before then: a run with nothing left to train, a live
replacement that can only fall back to the checkpoints."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megaresil.checkpoint.local.runs import link_checked
from megaresil.checkpoint.offline.inspect import verify
from megaresil.checkpoint.paths import RunPaths
from megaresil.checkpoint.recipe_check import newest_manifest
from megaresil.config import ConfigError, RecipeConfig, no_live_copy
from megaresil.events import read_events, read_metrics
from megaresil.fencing import FenceDamaged, read_fence
from megaresil.resilience.records import restarts_recorded
from megaresil.safe_files import refuse_links


def check_local_gpus(nproc: int, gpus: int) -> None:
    """On a CUDA machine each local worker owns one GPU (cuda:LOCAL_RANK): say
    so before starting them, not with "invalid device ordinal" from each."""
    if 0 < gpus < nproc:
        raise ConfigError("parallel", f"tp*pp*dp needs {nproc} local workers but this node "
                          f"sees {gpus} GPU(s) (one worker per GPU).",
                          f"lower parallel.dp/tp/pp to fit {gpus} GPU(s), or run on more nodes "
                          "with --nnodes and --rdzv-endpoint.")


def check_links(cfg: RecipeConfig) -> None:
    """A file the run writes that is a link planted in its place (metrics.jsonl
    -> /etc/passwd) would be written through, as root too: refused here,
    naming every such link, before any worker starts (safe_files). The local
    tier's default root lies in world-writable /dev/shm: it, the directory
    above it and the run's directory in it are checked too."""
    paths = RunPaths.of(cfg)
    local = link_checked(paths) if paths.local_enabled else []
    refuse_links(paths.run_dir, paths.checkpoint_root, local)


def check_run_records(run_dir: Path) -> None:
    """The run directory's records, read here as every worker reads them
    (events.jsonl, metrics.jsonl, the fence): a damaged line or fence is
    one line naming the file, the line and the fix (exit 2), not the same
    failure in every worker through every relaunch. A torn last line (a
    kill inside a write) is no damage: it is skipped, and resumes."""
    read_events(run_dir)
    read_metrics(run_dir)
    try:
        read_fence(run_dir)
    except FenceDamaged as err:
        # Written back, the fence keeps fencing out a rank left behind by the
        # last job; removed, it fences nobody until the next formation.
        away = "move that directory away, then " if err.path.is_dir() else ""
        raise FenceDamaged(err.path, err.problem, f"with no job running on this run directory, "
                           f"{away}write back the generation events.jsonl records: echo "
                           f"'{restarts_recorded(run_dir)} restored' > {err.path}") from None


def check_data(cfg: RecipeConfig) -> None:
    """Build the recipe's datasets once here, before any worker starts: data
    too small for one sample, or a model.vocab_size below the tokenizer's, is
    a recipe error (exit 2) instead of the same failure in every worker; so
    is document masking over data whose documents end with no
    end-of-document token. It only moves the cost: the workers find the
    prepared data cached."""
    from megaresil.data import build_datasets, end_of_document_id

    build_datasets(cfg.data, cfg.model.vocab_size, cfg.train.seed,
                   need_valid=cfg.train.eval_batches > 0)
    if cfg.data.masks_documents:
        end_of_document_id(cfg.data, cfg.model.vocab_size)


def check_backend(cfg: RecipeConfig) -> None:
    """model.backend=te on a machine without Transformer Engine: said once
    here, not raised by every worker through every restart."""
    if cfg.model.backend == "te":
        from megaresil.model import te

        te.require()



def finished_line(cfg: RecipeConfig) -> Optional[str]:
    """The line for a run whose checkpoint a resume would start from is at
    train.steps or past it: its workers would only load it and stop (and
    rewrite the run's goodput). None when there is training to do, or when
    that checkpoint fails its checksums (the workers walk back from it)."""
    found = newest_manifest(cfg)
    steps = cfg.train.steps
    if found is None or found[1]["step"] < steps or verify(found[0]) is not None:
        return None
    path, step = found[0], found[1]["step"]
    return (f"{cfg.run.dir} is finished: the checkpoint a resume would load, {path}, is at "
            f"step {step} (train.steps={steps}); nothing to train. Raise train.steps to "
            "train on, or give a new run.dir for a new run.")


def replacement_warning(cfg: RecipeConfig) -> Optional[str]:
    """Live replacement where no live rank holds a copy of another's state:
    a lost process is started again, but its state can only come from the
    checkpoint tiers (docs/fault-tolerance.md, Live replacement)."""
    gap = no_live_copy(cfg)
    if not cfg.resilience.replacement.enabled or gap is None:
        return None
    copies = ("parallel.dp_shard below parallel.dp (HSDP: the dp_replicate peers hold each "
              "shard)" if cfg.parallel.dp_shard > 1 else
              "parallel.dp=2 or more (with optimizer.distributed=false)")
    return (f"megaresil: warning: resilience.replacement.enabled: {gap.why}, so a lost process is "
            "replaced but resumes from the newest checkpoint (the local tier, then the global) "
            f"and loses the steps since. Fix: {copies} for state from memory, or a local tier "
            "saving every step (checkpoint.local.enabled=true checkpoint.local.interval=1).")
