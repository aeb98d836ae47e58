"""The rules of context parallelism (parallel.cp): what a sequence split over
cp ranks needs of the recipe, and what does not compose with it yet."""
from __future__ import annotations

from megaresil.config.fields import require
from megaresil.config.schema import Backend, RecipeConfig


def validate_context_parallel(cfg: RecipeConfig) -> None:
    p, m, data = cfg.parallel, cfg.model, cfg.data
    if p.cp == 1:
        return
    chunks = 2 * p.cp
    require(data.seq_len % chunks == 0, "data.seq_len",
            f"{data.seq_len} does not split into 2*cp = {chunks} equal chunks (each cp rank "
            "holds a head and a tail chunk, for causal attention's balance).",
            f"choose data.seq_len a multiple of {chunks}.")
    local = data.seq_len // p.cp
    require(not p.sequence_parallel or local % p.tp == 0, "data.seq_len",
            f"each cp rank's {local} tokens do not split over tp={p.tp} under sequence "
            "parallelism.", f"choose data.seq_len a multiple of {p.cp * p.tp}.")
    require(m.backend == Backend.local, "parallel.cp", "Transformer Engine's attention is not "
            "given the context-parallel slice yet.", "set model.backend=local, or parallel.cp=1.")
    require(m.moe.num_experts == 0 or m.moe.capacity_factor is None, "model.moe.capacity_factor",
            "a capacity drops the choices past it in each rank's token order, and a "
            "context-parallel rank holds only its chunks of the sequence, so other choices "
            "would drop than at cp=1.", "set model.moe.capacity_factor=null (dropless), or "
            "parallel.cp=1.")
    require(m.attention_dropout == 0.0, "model.attention_dropout", "context-parallel attention "
            "never holds a row's whole attention probabilities, which this dropout masks.",
            "set model.attention_dropout=0, or parallel.cp=1.")
