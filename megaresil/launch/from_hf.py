"""`megaresil train RECIPE --from-hf DIR` (and `config show --from-hf`):
DIR's model and tokenizer as recipe overrides, and the check that a new
run's Hugging Face checkpoint.init_from describes the recipe's model. All
before any worker starts: a bad DIR is a usage error."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from megaresil.config import ConfigError, RecipeConfig, load_recipe


def _flat_keys(prefix: str, values: dict) -> dict[str, object]:
    """{'model.rope_scaling.type': ...} from nested {'rope_scaling': {'type': ...}}."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat_keys(f"{prefix}{key}.", value))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _yaml_scalar(value: object) -> str:
    """A value as an override's text (overrides are parsed as YAML)."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


@dataclass
class FromHF:
    """`megaresil train RECIPE --from-hf DIR` resolved: the overrides, and the
    lines that say what DIR changed (recipe values it replaces, settings it
    has that megaresil cannot carry)."""
    overrides: list[str]
    replaced: list[tuple[str, object, object]]  # (key, the recipe's value, DIR's)
    notes: list[str]

    def report(self) -> str:
        """One compact block for the console of a new run."""
        lines = [f"megaresil: {note}" for note in self.notes]
        if self.replaced:
            lines.append("megaresil: --from-hf replaces the recipe's values (recipe -> "
                         "config.json):")
            width = max(len(key) for key, _, _ in self.replaced)
            lines += [f"  {key:<{width}}  {ours!r} -> {theirs!r}"
                      for key, ours, theirs in self.replaced]
        return "\n".join(lines)


def resolve_from_hf(hf_dir: Path, recipe: str, overrides: list[str]) -> FromHF:
    """The model's architecture and hyper-parameters from DIR's config.json,
    its tokenizer (when DIR has one) and checkpoint.init_from=DIR as plain
    overrides; the user's own KEY=VALUE overrides still win."""
    from megaresil.checkpoint.format import CheckpointError
    from megaresil.checkpoint.hf.io import hf_model_keys
    from megaresil.checkpoint.hf.mapping import refuse_unmapped
    from megaresil.checkpoint.hf.tokenizer import check_hf_tokenizer
    from megaresil.config import parse_override, to_dict

    recipe_cfg = load_recipe(recipe, overrides)
    hf_dir = hf_dir.resolve()
    given = {parse_override(text)[0] for text in overrides}
    try:  # every file of DIR read here, before any worker: a bad one is a usage error
        model_keys, notes = hf_model_keys(hf_dir)
        tokenizer = ("data.tokenizer" not in given
                     and check_hf_tokenizer(hf_dir, model_keys["vocab_size"]))
    except CheckpointError as err:
        raise ConfigError("--from-hf", str(err)) from None
    wanted = _flat_keys("model.", model_keys)
    if tokenizer:
        wanted["data.tokenizer"] = str(hf_dir)
    wanted["checkpoint.init_from"] = str(hf_dir)
    recipe_values = _flat_keys("", to_dict(recipe_cfg))
    replaced = [(key, recipe_values[key], value) for key, value in wanted.items()
                if key not in given and key in recipe_values and recipe_values[key] != value
                and key != "checkpoint.init_from"]
    hf_overrides = [f"{key}={_yaml_scalar(value)}" for key, value in wanted.items()
                    if key not in given]
    refuse_unmapped(load_recipe(recipe, hf_overrides + overrides).model, "--from-hf")
    return FromHF(hf_overrides + overrides, replaced, notes)


def from_hf_overrides(hf_dir: Path, recipe: str, overrides: list[str]) -> list[str]:
    """`megaresil train RECIPE --from-hf DIR` as plain overrides (resolve_from_hf)."""
    return resolve_from_hf(hf_dir, recipe, overrides).overrides


def is_new_run(cfg: RecipeConfig) -> bool:
    """No checkpoint yet: the run starts from checkpoint.init_from, not resumes."""
    from megaresil.checkpoint.format import committed_checkpoints
    from megaresil.checkpoint.paths import RunPaths

    return not committed_checkpoints(RunPaths.of(cfg).checkpoint_root)


def check_hf_init(cfg: RecipeConfig, from_hf: bool) -> None:
    """Before any worker starts: a new run's Hugging Face checkpoint.init_from
    describes the recipe's model (only the settings the model uses count,
    e.g. no RoPE scaling factor without scaling)."""
    path = cfg.checkpoint.init_from
    if not path:  # before the imports: they pull in torch's checkpointing, seconds of start-up
        return
    from megaresil.checkpoint.hf.io import hf_model_keys, is_hf_directory
    from megaresil.checkpoint.hf.mapping import model_differences, refuse_unmapped
    from megaresil.config import model_from_dict

    if not is_hf_directory(Path(path)) or not is_new_run(cfg):
        return
    refuse_unmapped(cfg.model, f"checkpoint.init_from={path}")
    differences = model_differences(model_from_dict(hf_model_keys(Path(path))[0]), cfg.model)
    if not differences:
        return
    fix = ("drop the model.* overrides that differ: --from-hf takes model.* from DIR's "
           "config.json" if from_hf else
           f"use --from-hf {path} instead of checkpoint.init_from (it takes model.* from "
           "config.json), or set model.* as config.json has it")
    raise ConfigError("model", f"checkpoint.init_from={path} holds a different model: "
                      f"{'; '.join(differences)}.", fix + ".")
