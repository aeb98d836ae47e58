"""The rules of sharded data parallelism (parallel.dp_shard, FSDP2): what
sharding parameters over data-parallel ranks needs of the recipe, and what
does not compose with it yet."""
from __future__ import annotations

from megaresil.config.fields import require
from megaresil.config.schema import FP8, Backend, RecipeConfig


def validate_sharded_data(cfg: RecipeConfig) -> None:
    p = cfg.parallel
    if p.dp_shard == 1:
        return
    require(p.dp % p.dp_shard == 0, "parallel.dp_shard",
            f"{p.dp_shard} does not divide dp={p.dp} (the dp ranks form dp/dp_shard replica "
            "groups of dp_shard ranks each).", f"choose a divisor of {p.dp}, or 1.")
    require(not cfg.optimizer.distributed, "optimizer.distributed",
            "parallel.dp_shard > 1 already shards the optimizer state (with the parameters "
            "and gradients) over the dp_shard ranks.",
            "set optimizer.distributed=false, or parallel.dp_shard=1 for ZeRO-1.")
    require(p.dp_shard % p.ep == 0, "parallel.ep",
            f"{p.ep} does not divide parallel.dp_shard={p.dp_shard} (the experts, cut along ep, "
            "are sharded over the dp_shard / ep ranks of each ep coordinate).",
            f"choose parallel.ep dividing {p.dp_shard}, or parallel.dp_shard=1.")
    require(cfg.model.backend == Backend.local and cfg.train.fp8 == FP8.none,
            "parallel.dp_shard", "Transformer Engine's modules are not wrapped by FSDP here yet.",
            "set model.backend=local and train.fp8=none, or parallel.dp_shard=1.")
