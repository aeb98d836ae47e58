"""Loading a recipe: compose its `defaults:` pieces from configs/ (never
from above it), apply KEY=VALUE overrides (each value parsed as YAML), and
turn the result into a validated `RecipeConfig`; and back to a plain dict.

YAML is read safely and without aliases. OmegaConf merges the pieces onto the
structured schema, so an unknown key or a wrong type is refused with its full
key name; `config.validation` then checks the rules that span fields.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import re
import types
import typing
from pathlib import Path
from typing import Any, Sequence, Union, cast

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megaresil.config.faults import parse_faults
from megaresil.config.fields import KEY_ALIASES, KEY_SPELLINGS, ConfigError, public_key
from megaresil.config.schema import ModelConfig, RecipeConfig, field_docs
from megaresil.config.validation import validate

# The packaged recipes and their pieces (the repository's recipes/ and configs/
# are links to them), so a recipe name works from any directory.
PACKAGE_DIR = Path(__file__).resolve().parent.parent
REPO_CONFIGS = PACKAGE_DIR / "configs"
PACKAGED_RECIPES = PACKAGE_DIR / "recipes"


def _rename_aliased(data: dict, to_fields: bool) -> dict:
    """Rename KEY_ALIASES' keys in a nested recipe dict: to their dataclass
    fields (`to_fields`), or back to the recipe's spelling."""
    for public, private in KEY_ALIASES.items():
        old, new = (public, private) if to_fields else (private, public)
        sec, key = old.split(".")
        if isinstance(data.get(sec), dict) and key in data[sec]:
            data[sec][new.split(".")[1]] = data[sec].pop(key)
    return data


def _respelled(data: dict) -> dict:
    """KEY_SPELLINGS' keys of a nested recipe dict under the schema's spelling."""
    for other, key in KEY_SPELLINGS.items():
        sec, name = other.split(".")
        section = data.get(sec)
        if not isinstance(section, dict) or name not in section:
            continue
        if key.split(".")[1] in section:
            raise ConfigError(key, f"is given twice, also as {other}.", "keep one of them.")
        section[key.split(".")[1]] = section.pop(name)
    return data


def _typed(piece: dict) -> dict:
    """A recipe mapping in the schema's terms: other spellings and keys that
    are Python keywords renamed to their fields, faults typed."""
    piece = _rename_aliased(_respelled(piece), to_fields=True)
    if "faults" in piece:
        piece["faults"] = _typed_value("faults", piece["faults"])
    return piece


def _typed_value(key: str, value: Any) -> Any:
    """Faults become `FaultSpec`s here, checked with their own messages
    (config/faults.py) before OmegaConf would check them against the schema."""
    return parse_faults(value) if key == "faults" and isinstance(value, list) else value


class _RecipeLoader(yaml.SafeLoader):
    """safe_load without aliases: a few lines of nested aliases (billion
    laughs) expand to billions of nodes when the recipe is merged."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "uses a YAML alias (*name); recipes refuse aliases, write the values "
                "out", self.peek_event().start_mark)
        return super().compose_node(parent, index)


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.load(path.read_text(), Loader=_RecipeLoader) or {}
    except FileNotFoundError:
        raise ConfigError(str(path), "file not found.", "check the recipe path.") from None
    except IsADirectoryError:
        raise ConfigError(str(path), "is a directory, not a recipe file.",
                          "give a recipe's .yaml file, e.g. recipes/gpt-tiny.yaml.") from None
    except yaml.YAMLError as err:
        raise ConfigError(str(path), f"is not valid YAML ({err}).", "fix the YAML syntax.") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "must hold a mapping of sections.", "start with e.g. 'model:'.")
    return data


def _resolve_piece(name: str, recipe_path: Path) -> Path:
    """A `defaults:` entry names a file under configs/ (without .yaml), or
    beside the recipe; never above either (no `..`, no absolute path)."""
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise ConfigError("defaults", f"'{name}' leaves configs/ (absolute or '..').",
                          "name a piece under configs/ or beside the recipe, e.g. model/gpt-tiny.")
    recipe_dir = recipe_path.resolve().parent  # `cd recipes && ... wide.yaml` finds ../configs too
    for base in (recipe_dir.parent / "configs", REPO_CONFIGS, recipe_dir):
        candidate = base / (name if name.endswith(".yaml") else f"{name}.yaml")
        if candidate.is_file():
            return candidate
    raise ConfigError("defaults", f"config piece '{name}' not found under configs/.",
                      "use a name like 'model/gpt-tiny' that exists in configs/.")


def _compose(recipe_path: Path) -> list[dict]:
    """The recipe's `defaults:` pieces in order, then the recipe body."""
    body = _read_yaml(recipe_path)
    pieces = body.pop("defaults", []) or []
    if not isinstance(pieces, list):
        raise ConfigError("defaults", "must be a list of config names.",
                          "write defaults: [model/gpt-tiny, ...].")
    pieces = [_read_yaml(_resolve_piece(str(p), recipe_path)) for p in pieces] + [body]
    return [_typed(piece) for piece in pieces]


def parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(text, "is not a KEY=VALUE override.", "write e.g. train.steps=20.")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as err:
        raise ConfigError(key, f"value {raw!r} is not valid YAML ({err}).", "quote it.") from None
    key = KEY_SPELLINGS.get(key.strip(), key.strip())
    return KEY_ALIASES.get(key, key), value


def unknown_key(key: str) -> ConfigError:
    """A key the schema does not have, with the keys it may have meant (the
    suggestion OmegaConf makes for a typo in a recipe file, for a typo on the
    command line)."""
    key = public_key(key)
    keys = [row[0] for row in field_docs()]
    section, _, name = key.rpartition(".")
    # In a section that exists, its own keys (as OmegaConf compares them).
    siblings = [known.rpartition(".")[2] for known in keys if known.rpartition(".")[0] == section]
    close = ([f"{section}.{match}" for match in difflib.get_close_matches(name, siblings, n=3)]
             if siblings else difflib.get_close_matches(key, keys, n=3))
    meant = (f" Did you mean {close[0]}?" if len(close) == 1 else
             f" Did you mean one of {', '.join(close)}?" if close else "")
    return ConfigError(key, f"is not a recipe key.{meant}",
                       "check the spelling (`megaresil config docs` lists every key).")


def _explain_omegaconf(err: OmegaConfBaseException) -> ConfigError:
    key = getattr(err, "full_key", None) or "recipe"
    key = public_key(key)
    first_line = str(err).splitlines()[0].rstrip(".") + "."
    if "not in" in first_line:
        fix = "remove it or correct the spelling (`megaresil config docs` lists every key)."
    elif "expected one of" in first_line and re.search(r"value '(True|False)'", first_line):
        # YAML 1.1 reads on/off/yes/no as booleans: `on_spike=off` arrives as False.
        off = " (none turns it off)" if re.search(r"\bnone\b", first_line) else ""
        fix = f"YAML reads on/off/yes/no as true/false: write one of the listed names{off}."
    elif re.search(r"Cannot convert '(dict|list)' to string", first_line):
        # `command=grep -q "Mode: On"`: YAML reads `KEY: VALUE` as a mapping.
        fix = (f"YAML read the value as a {'mapping' if 'dict' in first_line else 'list'} "
               "(`: ` or brackets in it): quote the whole value, e.g. "
               f"{key}=\"'...'\" on a shell command line, or set it in the recipe file.")
    else:
        fix = "give a value of the documented type (`megaresil config docs`)."
    return ConfigError(key, first_line, fix)


def find_recipe(recipe: str) -> Path:
    """RECIPE as given: an existing path, else a packaged recipe's name
    (`gpt-tiny` or `gpt-tiny.yaml`), so `megaresil train gpt-tiny` works anywhere."""
    if Path(recipe).exists():
        return Path(recipe)
    packaged = PACKAGED_RECIPES / (recipe if recipe.endswith(".yaml") else f"{recipe}.yaml")
    if "/" not in recipe and packaged.is_file():
        return packaged
    names = ", ".join(name for name, _ in packaged_recipes())
    raise ConfigError("recipe", f"'{recipe}' is neither a file nor a packaged recipe "
                      f"({names}).", "give a recipe YAML path or one of those names.")


def packaged_recipes() -> list[tuple[str, str]]:
    """(name, first line of its header comment) for every packaged recipe."""
    return [(path.stem, _header_line(path)) for path in sorted(PACKAGED_RECIPES.glob("*.yaml"))]


def _header_line(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip().rstrip(",:")
    return ""


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Compose a recipe and its overrides into a validated `RecipeConfig`."""
    recipe_path = Path(path)
    merged = OmegaConf.structured(RecipeConfig)
    try:
        for piece in _compose(recipe_path):
            merged = OmegaConf.merge(merged, piece)
        for text in overrides:
            key, value = parse_override(text)
            if OmegaConf.select(merged, key, default="__missing__") == "__missing__":
                raise unknown_key(key)
            OmegaConf.update(merged, key, _typed_value(key, value), merge=False)
        # OmegaConf types to_object's result as any container; from a config
        # structured on a dataclass it is that dataclass (and to_container's a dict).
        cfg = cast(RecipeConfig, OmegaConf.to_object(merged))
    except OmegaConfBaseException as err:
        raise _explain_omegaconf(err) from None
    validate(cfg)
    return cfg


def from_dict(data: dict) -> RecipeConfig:
    """A `RecipeConfig` from a plain dict (e.g. the resolved recipe of a run)."""
    try:
        data = _typed(copy.deepcopy(data))
        cfg = cast(RecipeConfig, OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(RecipeConfig), data)))
    except OmegaConfBaseException as err:
        raise _explain_omegaconf(err) from None
    validate(cfg)
    return cfg


def model_from_dict(data: dict) -> ModelConfig:
    """A `ModelConfig` from plain `model.*` keys, the rest defaults (its
    rules against the rest of a recipe are not checked here)."""
    try:
        return cast(ModelConfig, OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(ModelConfig), data)))
    except OmegaConfBaseException as err:
        raise _explain_omegaconf(err) from None


def to_dict(cfg: RecipeConfig) -> dict:
    """Plain, YAML/JSON-safe dict of a resolved recipe; each fault as written."""
    try:  # OmegaConf's conversion took ~0.025 s a call here; a trainer makes three
        data = _plain(cfg, type(cfg))
    except _NotPlain:  # a value of another type than its field's: as OmegaConf converts it
        data = cast(dict, OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    data["faults"] = [fault.to_dict() for fault in parse_faults(cfg.faults)]
    return _rename_aliased(data, to_fields=False)


class _NotPlain(Exception):
    pass


_LEAVES = (bool, int, float, str)


def _plain(value: Any, hint: Any) -> Any:
    """`value` (of type `hint`) as OmegaConf.to_container(enum_to_str=True)
    returns it, where every value already has its field's type; else raises
    _NotPlain (OmegaConf would convert it: an int in a float field)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = _hints(type(value))
        return {f.name: None if f.name == "faults" else _plain(getattr(value, f.name), hints[f.name])
                for f in dataclasses.fields(value)}
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        origin = typing.get_origin(option)
        if option is Any:
            return _plain_any(value)
        if origin is list and isinstance(value, list):
            (item,) = typing.get_args(option) or (Any,)
            return [_plain(v, item) for v in value]
        if isinstance(option, type) and issubclass(option, enum.Enum) and isinstance(value, option):
            return value.name
        if option in _LEAVES and type(value) is option:
            return value
    raise _NotPlain(hint)


def _plain_any(value: Any) -> Any:
    if value is None or type(value) in _LEAVES:
        return value
    if isinstance(value, list):
        return [_plain_any(v) for v in value]
    if isinstance(value, dict) and all(type(k) is str for k in value):
        return {k: _plain_any(v) for k, v in value.items()}
    raise _NotPlain(type(value))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def to_yaml(cfg: RecipeConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
