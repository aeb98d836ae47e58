"""What the launcher refuses before any worker starts, so a recipe error
is one clear line (exit 2) instead of the same failure in every worker."""
from __future__ import annotations

from pathlib import Path

from megaresil.checkpoint.local.runs import link_checked
from megaresil.checkpoint.location import checkpoint_root
from megaresil.config import ConfigError, RecipeConfig
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
    local = link_checked(cfg) if cfg.checkpoint.local.enabled else []
    refuse_links(Path(cfg.run.dir), checkpoint_root(cfg), local)


def check_data(cfg: RecipeConfig) -> None:
    """Build the recipe's datasets once here, before any worker starts: data
    too small for one sample, or a model.vocab_size below the tokenizer's, is
    a recipe error (exit 2) instead of the same failure in every worker. It
    only moves the cost: the workers find the prepared data cached."""
    from megaresil.data import build_datasets

    build_datasets(cfg.data, cfg.model.vocab_size, cfg.train.seed,
                   need_valid=cfg.train.eval_batches > 0)


def check_backend(cfg: RecipeConfig) -> None:
    """model.backend=te on a machine without Transformer Engine: said once
    here, not raised by every worker through every restart."""
    if cfg.model.backend == "te":
        from megaresil.model import te

        te.require()

