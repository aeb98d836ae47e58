"""On resume, the new resolved recipe against the one stored with the state
it resumes from, a global checkpoint or the run's local shards: only the keys
of RESUMABLE (and checkpoint.allow_recipe_change) may differ; any other
difference would silently train a different run from the saved tensors, so
the launcher refuses it before workers start."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.local.runs import newest_local_shard
from megaresil.checkpoint.validation import read_manifest
from megaresil.checkpoint.location import checkpoint_root
from megaresil.config import ConfigError, RecipeConfig, to_dict

# Keys (or key prefixes ending in '.') that may change on resume: the layout
# (checkpoints reshard, ZeRO-1's row shards of the moments included), how long to train, when and where to save, what to
# log, how to detect and recover, and injected faults.
RESUMABLE = ("parallel.", "train.steps", "train.exit_at_step", "train.micro_batch_size",
             "optimizer.distributed", "train.eval_interval", "train.eval_batches", "checkpoint.",
             "logging.", "profile.", "resilience.", "faults", "run.")


def flat(values: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def may_change(key: str, allowed: list[str]) -> bool:
    return any(key == a or (a.endswith(".") and key.startswith(a)) or key.startswith(a + ".")
               for a in (*RESUMABLE, *allowed))


def recipe_changes(saved: dict, new: dict, allowed: list[str]) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) for each refused difference."""
    old, now = flat(saved), flat(new)
    return [(key, old.get(key), now.get(key)) for key in sorted(set(old) | set(now))
            if old.get(key) != now.get(key) and not may_change(key, allowed)]


def newest_manifest(cfg: RecipeConfig) -> Optional[tuple[Path, dict]]:
    """The checkpoint a resume would start from, by its manifest (shards are
    verified by the workers): checkpoint.load's, or the newest whose manifest
    reads under the root."""
    load = cfg.checkpoint.load
    if load == "none":
        return None
    paths = [Path(load)] if load != "auto" else fmt.committed_checkpoints(checkpoint_root(cfg))
    for path in paths:
        try:
            return path, read_manifest(path)
        except fmt.CheckpointError:
            continue  # the workers skip it too, and say so
    return None


def check_resume_recipe(cfg: RecipeConfig) -> None:
    """Refuse (ConfigError, before workers start) a resume whose recipe
    differs in a key that may not change from the newest global
    checkpoint's or from the newest local shard's of this run: a restart
    takes whichever tier is newer, or the other when it proves invalid."""
    found = newest_manifest(cfg)
    if found is not None:
        path, manifest = found
        refuse_changes(cfg, manifest["recipe"], str(path), "start from these weights with "
                       f"checkpoint.init_from={path}, or ")
    local = newest_local_shard(cfg)
    if local is not None:
        path, meta = local
        refuse_changes(cfg, meta["run"]["recipe"], f"local step {meta['step']} ({path})")


def refuse_changes(cfg: RecipeConfig, saved: dict, source: str, instead: str = "") -> None:
    """ConfigError naming each refused difference between `saved`, the
    recipe of the state at `source`, and this one; `instead`: another way
    out to offer, before allowing the change."""
    changes = recipe_changes(saved, to_dict(cfg), cfg.checkpoint.allow_recipe_change)
    if changes:
        lines = "".join(f"\n  {key}: the checkpoint has {old!r}, this recipe {new!r}"
                        for key, old, new in changes)
        keys = ",".join(key for key, _, _ in changes)
        raise ConfigError("checkpoint.allow_recipe_change",
                          f"resuming from {source} would train a different run:{lines}\n",
                          f"use a new run.dir, or {instead}allow it: "
                          f"checkpoint.allow_recipe_change=[{keys}]")
