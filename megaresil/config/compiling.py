"""The rules of train.compile: what regional compilation of the blocks
(torch.compile of each block, train/compiling.py) composes with, and what
it does not yet."""
from __future__ import annotations

from megaresil.config.fields import require
from megaresil.config.schema import Backend, Compile, RecipeConfig


def validate_compile(cfg: RecipeConfig) -> None:
    if cfg.train.compile != Compile.blocks:
        return  # auto turns itself off where the rules below would refuse
    require(cfg.model.backend == Backend.local, "train.compile",
            "blocks compiles the local backend's blocks; Transformer Engine's fused modules "
            "are not traced here.", "set train.compile=none (or auto), or model.backend=local.")
    require(cfg.parallel.dp_shard == 1, "train.compile",
            "blocks is not yet composed with FSDP2's per-block hooks (parallel.dp_shard > 1).",
            "set train.compile=none (or auto), or parallel.dp_shard=1.")
