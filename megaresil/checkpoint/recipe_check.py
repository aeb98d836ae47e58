"""On resume, the new resolved recipe against the one stored with the state
it resumes from, a global checkpoint or the run's local shards: only the keys
of RESUMABLE (and checkpoint.allow_recipe_change) may differ; any other
difference would silently train a different run from the saved tensors, so
the launcher refuses it before workers start."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Callable, Optional

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.hf.mapping import model_differences
from megaresil.checkpoint.keys import WEIGHTS
from megaresil.checkpoint.local.runs import newest_local_shard
from megaresil.checkpoint.paths import RunPaths
from megaresil.checkpoint.validation import read_manifest
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
    """(key, saved value, new value) for each difference. A key the saved
    recipe predates is no difference at its default: a new key's default
    keeps what the code did before it (a cosine schedule, no z-loss)."""
    old, now = flat(saved), flat(new)
    return [(key, old.get(key), now.get(key)) for key in sorted(set(old) | set(now))
            if old.get(key) != now.get(key)
            and not (key not in old and now.get(key) == _defaults().get(key, _NOT_A_KEY))]


_NOT_A_KEY = object()


@functools.cache
def _defaults() -> dict[str, object]:
    """Every recipe key's default, flat."""
    return flat(to_dict(RecipeConfig()))


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
    paths = ([Path(load)] if load != "auto"
             else fmt.committed_checkpoints(RunPaths.of(cfg).checkpoint_root))
    for path in paths:
        try:
            return path, read_manifest(path)
        except fmt.CheckpointError:
            continue  # the workers skip it too, and say so
    return None


def check_resume_recipe(cfg: RecipeConfig) -> None:
    """Refuse (ConfigError, before workers start) a resume whose recipe
    differs in a key that may not change from the newest global
    checkpoint's or from the newest local shard's of this run (a restart
    takes whichever tier is newer, or the other when it proves invalid),
    offering only the fixes that can work."""
    found = newest_manifest(cfg)
    if found is not None:
        path, manifest = found
        refuse_changes(cfg, manifest["recipe"], str(path), lambda: _shapes(manifest),
                       init_from=path)
    local = newest_local_shard(cfg)
    if local is not None:
        path, meta = local
        saved = meta["run"]["recipe"]
        refuse_changes(cfg, saved, f"local step {meta['step']} ({path})",
                       lambda: layout_free_shapes(model_from_dict(saved["model"])))


def refuse_changes(cfg: RecipeConfig, saved_recipe: dict, source: str,
                   saved_shapes: Callable[[], dict[str, tuple[int, ...]]],
                   init_from: Optional[Path] = None) -> None:
    """ConfigError naming each refused difference between `saved_recipe`,
    the recipe of the state at `source`, and this one. `saved_shapes` (read
    only when a model.* key changed) tells whether the saved weights could
    load at all; `init_from`: a checkpoint a new run may start from."""
    saved, new = _tokenizers_resolved(saved_recipe, to_dict(cfg), cfg.data)
    changes = recipe_changes(saved, new, cfg.checkpoint.allow_recipe_change)
    if not changes:
        return
    model_changed = any(key.startswith("model.") for key, _, _ in differences(saved, new))
    fits = not model_changed or saved_shapes() == layout_free_shapes(cfg.model)
    problem = f"resuming from {source} would train a different run:{_lines(changes)}\n"
    if not fits:
        problem += ("This model's tensors have other shapes than the checkpoint's: neither a "
                    "resume nor checkpoint.init_from can load them.\n")
    keys = ",".join(key for key, _, _ in changes)
    raise ConfigError("checkpoint.allow_recipe_change", problem,
                      _fixes(saved_recipe, cfg, keys, fits, init_from))


def _fixes(saved_recipe: dict, cfg: RecipeConfig, keys: str, fits: bool,
           init_from: Optional[Path]) -> str:
    """What can work: a new run; where the tensors fit, the weights into a
    new run (only from a checkpoint, and while the architecture is the
    checkpoint's: init_from checks it) and this resume, allowed."""
    if not fits:
        return "use a new run.dir (the new model trains from its own initialisation)."
    fixes = ["use a new run.dir"]
    if init_from is not None and not model_differences(model_from_dict(saved_recipe["model"]),
                                                       cfg.model):
        fixes.append(f"start from these weights with checkpoint.init_from={init_from}")
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
