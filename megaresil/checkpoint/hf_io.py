"""Hugging Face model directories (config.json + safetensors weights) out of
and into megaresil checkpoints: `megaresil convert SRC --to-hf DIR` and
`megaresil convert --from-hf DIR DST`.

Export reads the checkpoint's weights as full tensors and writes one
model.safetensors; import maps the HF config to `model.*` keys (training keys
come from the defaults or a recipe), maps the weights (hf.py) and writes a
weights-only checkpoint at any layout through the offline writer. Both hold
the model's weights (not its optimizer state) in memory.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint import hf
from megaresil.checkpoint.convert import Target, fresh_rank_states, open_source, target_recipe
from megaresil.checkpoint.manager import move_into_place
from megaresil.checkpoint.offline import partial_dir, refuse_existing, replacing, write_checkpoint
from megaresil.checkpoint.planning import recipe_layout
from megaresil.checkpoint.sources import FullTensorSource, full_tensors
from megaresil.checkpoint.state import RunState
from megaresil.config import ModelConfig, RecipeConfig, from_dict, load_recipe, to_dict

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise fmt.CheckpointError("Hugging Face conversion needs the safetensors package. Fix: "
                                  "pip install safetensors") from None
    return safetensors.torch


def export_to_hf(src: Path, out: Path, *, overwrite: bool = False) -> Path:
    """Write checkpoint `src`'s weights as a transformers model directory."""
    refuse_existing(out, overwrite)
    source = open_source(src)
    source.verify()
    cfg = from_dict(source.manifest["recipe"]).model
    keys = sorted(key for key in source.tensors if key.startswith("model/"))
    ours = {key.removeprefix("model/"): tensor for key, tensor in full_tensors(source, keys)}
    weights = hf.to_hf(ours, cfg)
    dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    with partial_dir(out) as partial:
        _safetensors().save_file(weights, partial / WEIGHTS, metadata={"format": "pt"})
        (partial / CONFIG).write_text(json.dumps(hf.config_to_hf(cfg, dtype), indent=2) + "\n")
        fmt.fsync_tree(partial)
        with replacing(out, overwrite) as make_room:
            move_into_place(partial, out, make_room)
    return out


def read_hf_config(directory: Path) -> dict:
    try:
        return json.loads((directory / CONFIG).read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise fmt.CheckpointError(f"{directory} has no {CONFIG}. Fix: give a directory written by "
                                  "transformers' save_pretrained.") from None


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every weight of a transformers model directory (one or sharded safetensors files)."""
    if (directory / WEIGHTS).is_file():
        files = [WEIGHTS]
    elif (directory / WEIGHTS_INDEX).is_file():
        index = json.loads((directory / WEIGHTS_INDEX).read_text())
        files = sorted(set(index["weight_map"].values()))
    else:
        raise fmt.CheckpointError(f"{directory} has no {WEIGHTS} (nor {WEIGHTS_INDEX}). Fix: save "
                                  "the model with save_pretrained(..., safe_serialization=True).")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(_safetensors().load_file(fmt.inside(directory, name)))
    return weights


def _mapped_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megaresil's `model/*` tensors from the HF weights, as fp32 master weights."""
    try:
        ours = hf.from_hf(weights, cfg)
    except KeyError as err:
        raise fmt.CheckpointError(f"the Hugging Face weights have no tensor {err.args[0]!r} that "
                                  "its config.json implies. Fix: re-save the model with "
                                  "save_pretrained.") from None
    return {f"model/{key}": tensor.float() for key, tensor in ours.items()}


def _fresh_state(cfg: RecipeConfig, origin: dict) -> RunState:
    """The non-tensor state of a checkpoint that no training wrote: step 0."""
    return RunState(step=0, layout=recipe_layout(cfg), recipe=to_dict(cfg), consumed_samples=0,
                    optimizer_steps=0, rank_states=fresh_rank_states(cfg), weights_only=True,
                    extra={"origin": origin})


def import_from_hf(hf_dir: Path, dst: Path, target: Target, *, recipe: Optional[Path] = None,
                   overwrite: bool = False) -> Path:
    """Write a transformers model directory as a weights-only checkpoint at
    the target layout; the recipe is `recipe` (or the defaults) with the
    model's architecture from its config.json."""
    refuse_existing(dst, overwrite)
    config = read_hf_config(hf_dir)
    base = to_dict(load_recipe(recipe) if recipe else RecipeConfig())
    base["model"].update(hf.config_from_hf(config))
    cfg = target_recipe(base, target)
    source = FullTensorSource(_mapped_weights(read_hf_weights(hf_dir), cfg.model))
    origin = {"hugging_face": str(hf_dir), "architecture": config["architectures"][0]}
    return write_checkpoint(source, cfg, dst, backend=cfg.checkpoint.backend.value,
                            weights_only=True, state=_fresh_state(cfg, origin), overwrite=overwrite)
