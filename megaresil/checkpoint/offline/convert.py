"""`megaresil convert`: a checkpoint to another layout and/or backend, in one
process without a process group.

The target is the source's recipe with the requested layout applied and
validated like any recipe (errors name the key); the source is verified
before anything is written; the tensors go through writer.write_checkpoint
(streamed, committed atomically). Non-tensor state is carried over
(`RunRecord`), with the target's layout and recipe.
"""
from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.offline.planning import recipe_layout
from megaresil.checkpoint.offline.writer import refuse_existing, write_checkpoint
from megaresil.checkpoint.sources import CheckpointSource
from megaresil.checkpoint.state import RunRecord
from megaresil.config import (
    KEY_ALIASES,
    ConfigError,
    RecipeConfig,
    from_dict,
    parse_override,
    to_dict,
)
from megaresil.parallel.random import capture_rng_state, restore_rng_state


@dataclass
class Target:
    """What to change; None keeps the source's value."""
    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    vpp: Optional[int] = None
    ep: Optional[int] = None
    cp: Optional[int] = None
    dp_shard: Optional[int] = None
    distributed_optimizer: Optional[bool] = None
    backend: Optional[str] = None
    weights_only: bool = False
    overrides: list[str] = field(default_factory=list)  # KEY=VALUE recipe overrides

    def recipe_changes(self) -> list[tuple[str, Any]]:
        named = [("parallel.tp", self.tp), ("parallel.pp", self.pp), ("parallel.dp", self.dp),
                 ("parallel.vpp", self.vpp), ("parallel.ep", self.ep), ("parallel.cp", self.cp),
                 ("parallel.dp_shard", self.dp_shard),
                 ("optimizer.distributed", self.distributed_optimizer),
                 ("checkpoint.backend", self.backend)]
        given = [(key, value) for key, value in named if value is not None]
        return given + [parse_override(text) for text in self.overrides]


def _set_key(recipe: dict, dotted: str, value: Any) -> None:
    """Set `dotted` (a.b.c) in a plain recipe dict, by its public name."""
    dotted = {field_key: public for public, field_key in KEY_ALIASES.items()}.get(dotted, dotted)
    *sections, leaf = dotted.split(".")
    node = recipe
    for name in sections:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            raise ConfigError(dotted, "is not a recipe key.",
                              "check the spelling (`megaresil config docs` lists every key).")
    node[leaf] = value


def target_recipe(recipe: dict, target: Target) -> RecipeConfig:
    """The recipe with the target's changes, validated (ConfigError naming the key)."""
    changed = copy.deepcopy(recipe)
    for key, value in target.recipe_changes():
        _set_key(changed, key, value)
    return from_dict(changed)


def fresh_rank_states(cfg: RecipeConfig) -> list[dict]:
    """Per target rank, the global RNG state a fresh run starts from (each
    rank seeds with train.seed). The source's per-rank streams mean nothing
    on other ranks; a trainer that restores rank_states at this layout starts
    them afresh (dropout and data order never draw from them)."""
    saved = capture_rng_state()
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    fresh = capture_rng_state()
    restore_rng_state(saved)
    return [fresh] * cfg.parallel.world_size


def imported_state(cfg: RecipeConfig, origin: dict, step: int = 0, *,
                   adam_step: Optional[int] = None, consumed_samples: int = 0) -> RunRecord:
    """The non-tensor state of a checkpoint that megaresil's training did not
    write: `step` (the source's count); weights only unless the source's
    optimizer came too (`adam_step`, with its data position)."""
    return RunRecord(step=step, layout=recipe_layout(cfg), recipe=to_dict(cfg),
                     consumed_samples=consumed_samples if adam_step is not None else 0,
                     optimizer_steps=adam_step or 0, rank_states=fresh_rank_states(cfg),
                     weights_only=adam_step is None, extra={"origin": origin})


def converted_state(manifest: dict, cfg: RecipeConfig, weights_only: bool) -> RunRecord:
    """The source's non-tensor state, with layout and recipe of the target."""
    source, layout = RunRecord.from_manifest(manifest), recipe_layout(cfg)
    same_ranks = layout == source.layout and source.rank_states
    return dataclasses.replace(
        source, layout=layout, recipe=to_dict(cfg),
        rank_states=source.rank_states if same_ranks else fresh_rank_states(cfg),
        weights_only=source.weights_only or weights_only)


def open_source(src: Path) -> CheckpointSource:
    try:
        return CheckpointSource(src)
    except fmt.CheckpointError as err:
        raise fmt.CheckpointError(f"cannot convert {src}: {err}. Fix: give a committed checkpoint "
                                  "directory (one holding metadata.json and COMMITTED), e.g. "
                                  "RUN/checkpoints/step_0000100") from None


def _require_optimizer_state(source: CheckpointSource, weights_only: bool) -> None:
    has_moments = any(key.startswith("optim/") for key in source.tensors)
    if not weights_only and not has_moments:
        raise fmt.CheckpointError(f"{source.path} holds weights only (no optimizer state). Fix: "
                                  "convert it with --weights-only.")


def convert(src: Path, dst: Path, target: Target, *, overwrite: bool = False) -> Path:
    """Convert checkpoint `src` into `dst` at the target layout and backend."""
    refuse_existing(dst, overwrite)
    source = open_source(src)
    backend = target.backend or source.manifest["backend"]
    cfg = target_recipe(source.manifest["recipe"], dataclasses.replace(target, backend=backend))
    _require_optimizer_state(source, target.weights_only)
    source.verify()
    return write_checkpoint(source, cfg, dst, backend=cfg.checkpoint.backend.value,
                            weights_only=target.weights_only,
                            state=converted_state(source.manifest, cfg, target.weights_only),
                            overwrite=overwrite)
