"""The rules of train.compile: what regional compilation of the blocks
(torch.compile of each block, train/compiling.py) composes with, and what
it does not yet. `blocks` is refused where a rule fails; `auto` asks
`composes_with_compile` and stays off there."""
from __future__ import annotations

from megaresil.config.fields import require
from megaresil.config.schema import Backend, Compile, RecipeConfig


def compile_rules(cfg: RecipeConfig) -> list[tuple[bool, str, str]]:
    """(holds, problem, fix) for each rule compiled blocks need."""
    return [
        (cfg.model.backend == Backend.local,
         "blocks compiles the local backend's blocks; Transformer Engine's fused modules "
         "are not traced here.", "set train.compile=none (or auto), or model.backend=local."),
        (cfg.parallel.dp_shard == 1,
         "blocks is not yet composed with FSDP2's per-block hooks (parallel.dp_shard > 1).",
         "set train.compile=none (or auto), or parallel.dp_shard=1."),
    ]


def composes_with_compile(cfg: RecipeConfig) -> bool:
    return all(holds for holds, _, _ in compile_rules(cfg))


def validate_compile(cfg: RecipeConfig) -> None:
    if cfg.train.compile != Compile.blocks:
        return  # auto turns itself off where the rules refuse
    for holds, problem, fix in compile_rules(cfg):
        require(holds, "train.compile", problem, fix)
