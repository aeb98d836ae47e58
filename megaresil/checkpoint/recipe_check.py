"""On resume, the new resolved recipe against the one stored in the
checkpoint: only the keys of RESUMABLE (and checkpoint.allow_recipe_change)
may differ; any other difference would silently train a different run from
the checkpoint's tensors, so the launcher refuses it before workers start."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.hf.mapping import model_differences
from megaresil.checkpoint.keys import WEIGHTS
from megaresil.checkpoint.validation import read_manifest
from megaresil.checkpoint.location import checkpoint_root
from megaresil.config import ConfigError, DataConfig, RecipeConfig, model_from_dict, to_dict
from megaresil.data.provenance import tokenizer_spec
from megaresil.model.gpt import layout_free_shapes

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


def differences(saved: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) for each difference."""
    old, now = flat(saved), flat(new)
    return [(key, old.get(key), now.get(key)) for key in sorted(set(old) | set(now))
            if old.get(key) != now.get(key)]


def recipe_changes(saved: dict, new: dict, allowed: list[str]) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) for each refused difference."""
    return [change for change in differences(saved, new) if not may_change(change[0], allowed)]


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
    differs from the checkpoint's in a key that may not change, offering
    only the fixes that can work."""
    found = newest_manifest(cfg)
    if found is None:
        return
    path, manifest = found
    saved, new = _tokenizers_resolved(manifest["recipe"], to_dict(cfg), cfg.data)
    changes = recipe_changes(saved, new, cfg.checkpoint.allow_recipe_change)
    if not changes:
        return
    fits = _tensors_fit(manifest, cfg, differences(saved, new))
    problem = f"resuming from {path} would train a different run:{_lines(changes)}\n"
    if not fits:
        problem += ("This model's tensors have other shapes than the checkpoint's: neither a "
                    "resume nor checkpoint.init_from can load them.\n")
    raise ConfigError("checkpoint.allow_recipe_change", problem,
                      _fixes(path, manifest, cfg, ",".join(key for key, _, _ in changes), fits))


def _tensors_fit(manifest: dict, cfg: RecipeConfig,
                 changes: list[tuple[str, object, object]]) -> bool:
    """Whether the checkpoint's weights have this recipe's model's shapes
    (built only when a model.* key changed)."""
    if not any(key.startswith("model.") for key, _, _ in changes):
        return True
    return _shapes(manifest) == layout_free_shapes(cfg.model)


def _fixes(path: Path, manifest: dict, cfg: RecipeConfig, keys: str, fits: bool) -> str:
    """What can work: a new run; where the tensors fit, the weights into a
    new run (only while the architecture is the checkpoint's: init_from
    checks it) and this resume, allowed."""
    if not fits:
        return "use a new run.dir (the new model trains from its own initialisation)."
    fixes = ["use a new run.dir"]
    if not model_differences(model_from_dict(manifest["recipe"]["model"]), cfg.model):
        fixes.append(f"start from these weights with checkpoint.init_from={path}")
    fixes.append(f"allow it: checkpoint.allow_recipe_change=[{keys}]")
    return ", or ".join(fixes)


def _lines(changes: list[tuple[str, object, object]]) -> str:
    return "".join(f"\n  {key}: the checkpoint has {old!r}, this recipe {new!r}"
                   for key, old, new in changes)


def _shapes(manifest: dict) -> dict[str, tuple[int, ...]]:
    """The checkpoint's weights' shapes, by parameter name."""
    return {key.removeprefix(WEIGHTS): tuple(entry["global_shape"])
            for key, entry in manifest["tensors"].items() if key.startswith(WEIGHTS)}


def _tokenizers_resolved(saved: dict, new: dict, data: DataConfig) -> tuple[dict, dict]:
    """Both recipes with data.tokenizer as it resolves for this run's data:
    an unset one (null) is the tokenizer the data was prepared with, so a
    checkpoint that named it resumes under a recipe that leaves it unset."""
    def resolved(recipe: dict) -> dict:
        tokenizer = recipe.get("data", {}).get("tokenizer")
        spec = tokenizer_spec(dataclasses.replace(data, tokenizer=tokenizer))
        return {**recipe, "data": {**recipe.get("data", {}), "tokenizer": spec}}
    return resolved(saved), resolved(new)
