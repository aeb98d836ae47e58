"""Hugging Face model directories (config.json + safetensors weights) out of
and into megaresil checkpoints: `megaresil convert SRC --to-hf DIR`,
`megaresil convert --from-hf DIR DST`, and the weights a run starts from
with `checkpoint.init_from=DIR` (`megaresil train --from-hf DIR`).

Export streams: it reads the checkpoint a piece at a time (embeddings, then
each layer), writes safetensors shards of at most `max_shard_bytes` (with
model.safetensors.index.json when there are several) and the tokenizer
files. Import reads each tensor from its shard file when it is needed
(`HFTensorSource`), never the whole model, and refuses weights the config
does not account for.
"""
from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.hf import mapping as hf
from megaresil.checkpoint.hf.tokenizer import (
    check_hf_tokenizer,
    export_token_ids,
    load_export_tokenizer,
    write_tokenizer,
)
from megaresil.checkpoint.manager import move_into_place
from megaresil.checkpoint.offline.convert import (
    Target,
    imported_state,
    open_source,
    target_recipe,
)
from megaresil.checkpoint.offline.writer import (
    partial_dir,
    refuse_existing,
    replacing,
    write_checkpoint,
)
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.sources import CheckpointSource, fill_from_full, full_tensors
from megaresil.config import ModelConfig, RecipeConfig, from_dict, load_recipe, to_dict

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default shard size
FILE_MODE, DIR_MODE = 0o644, 0o755  # an export is for others to read


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise fmt.CheckpointError("Hugging Face conversion needs the safetensors package. Fix: "
                                  "pip install safetensors") from None
    return safetensors


def is_hf_directory(path: Path) -> bool:
    """A transformers model directory (not a megaresil checkpoint)."""
    return (path / CONFIG).is_file() and not (path / fmt.MANIFEST).exists()


def parse_size(text: str) -> int:
    """Bytes from '5GB', '200MB', '10KB' (powers of 1000, as transformers) or a number."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not found:
        raise ValueError(f"{text!r} is not a size. Fix: write e.g. 5GB, 200MB or 1000000.")
    scale = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
             "GB": 10**9}[found[2]]
    return int(float(found[1]) * scale)


# --- export -------------------------------------------------------------------------


def _hf_tensors(source: CheckpointSource, cfg: ModelConfig,
                dtype: Optional[torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    """The transformers tensors, a piece of the model at a time."""
    for keys, to_hf in hf.to_hf_parts(cfg):
        ours = {key.removeprefix("model/"): t
                for key, t in full_tensors(source, [f"model/{k}" for k in keys])}
        for name, tensor in to_hf(ours).items():
            yield name, tensor.to(dtype or tensor.dtype).contiguous()


def _shards(tensors: Iterator[tuple[str, torch.Tensor]],
            max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive tensors in groups of at most max_bytes (or one tensor)."""
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    if shard:
        yield shard


def _write_weights(directory: Path, tensors: Iterator[tuple[str, torch.Tensor]],
                   max_bytes: int) -> str:
    """Write the shards; one is model.safetensors, several are
    model-0000i-of-0000n.safetensors with their index. Returns the dtype."""
    save = _safetensors().torch.save_file
    weight_map, total, dtype = {}, 0, ""
    for i, shard in enumerate(_shards(tensors, max_bytes)):
        save(shard, directory / f"shard-{i}", metadata={"format": "pt"})
        weight_map.update({name: i for name in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        dtype = str(next(iter(shard.values())).dtype).removeprefix("torch.")
    count = max(weight_map.values()) + 1
    names = ([WEIGHTS] if count == 1 else
             [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
    for i, name in enumerate(names):
        (directory / f"shard-{i}").rename(directory / name)
    if count > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {key: names[i] for key, i in sorted(weight_map.items())}}
        (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return dtype


def export_to_hf(src: Path, out: Path, *, overwrite: bool = False, tokenizer: Optional[str] = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES, dtype: Optional[str] = None) -> Path:
    """Write checkpoint `src`'s weights as a transformers model directory
    with its tokenizer (`tokenizer`, default the recipe's data.tokenizer)."""
    refuse_existing(out, overwrite)
    source = open_source(src)
    source.verify()
    recipe = from_dict(source.manifest["recipe"])
    cfg = recipe.model
    refusals = hf.hf_refusals(cfg)
    if refusals:
        raise fmt.CheckpointError(f"{src} is a mixture of experts, which Hugging Face export "
                                  f"does not convert yet for flavour {cfg.flavour.value}: "
                                  f"transformers' model does not hold {'; '.join(refusals)}. "
                                  "Fix: convert it to another layout with `megaresil convert "
                                  "SRC DST` instead.")
    tok = load_export_tokenizer(tokenizer, recipe.data, cfg.vocab_size)
    if tok is None:
        print("megaresil: no tokenizer exported: the run trained on synthetic data; pass "
              "--tokenizer PATH to add one", file=sys.stderr)
    bos, eos = export_token_ids(cfg, tok)
    torch_dtype = fmt.torch_dtype(dtype) if dtype else None
    with partial_dir(out) as partial:
        stored = _write_weights(partial, _hf_tensors(source, cfg, torch_dtype), max_shard_bytes)
        if tok is not None:
            write_tokenizer(partial, tok, cfg, bos, eos)
        config = hf.config_to_hf(cfg, stored, bos=bos, eos=eos)
        (partial / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for path in partial.iterdir():
            path.chmod(FILE_MODE)
        partial.chmod(DIR_MODE)
        fmt.fsync_tree(partial)
        with replacing(out, overwrite) as make_room:
            move_into_place(partial, out, make_room)
    return out


# --- import -------------------------------------------------------------------------


def _read_json_object(path: Path) -> dict:
    """A JSON object from a file of a model directory; anything else (a
    truncated or hand-broken file) one line naming it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise fmt.CheckpointError(f"{path} is not valid JSON ({err}). Fix: re-save the model "
                                  "with transformers' save_pretrained.") from None
    if not isinstance(value, dict):
        raise fmt.CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object. "
                                  "Fix: re-save the model with transformers' save_pretrained.")
    return value


def read_hf_config(directory: Path) -> dict:
    try:
        return _read_json_object(directory / CONFIG)
    except (FileNotFoundError, NotADirectoryError):
        raise fmt.CheckpointError(f"{directory} has no {CONFIG}. Fix: give a directory written by "
                                  "transformers' save_pretrained.") from None


@contextlib.contextmanager
def _safetensors_file(path: Path) -> Iterator:
    """safe_open(path), its header errors (a crafted length, offsets past the
    end or overlapping, a shape that overflows, a truncated file) one line
    naming the file."""
    safetensors = _safetensors()
    try:
        with safetensors.safe_open(path, "pt") as f:
            yield f
    except safetensors.SafetensorError as err:
        raise fmt.CheckpointError(f"{path} is not a valid safetensors file ({err}). Fix: "
                                  "re-save the model with save_pretrained("
                                  "safe_serialization=True).") from None


class HFWeights:
    """The safetensors weights of a transformers model directory (one file or
    sharded with an index), read one tensor at a time from its file (a
    memory map): shapes come from the headers, data only when asked for."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files = self._files()
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in self.files:
            with _safetensors_file(path) as f:
                for key in f.keys():
                    self.file_of[key] = path
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())

    def _files(self) -> list[Path]:
        d = self.directory
        if (d / WEIGHTS).is_file():
            return [d / WEIGHTS]
        if (d / WEIGHTS_INDEX).is_file():
            weight_map = _read_json_object(d / WEIGHTS_INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise fmt.CheckpointError(f"{d / WEIGHTS_INDEX} has no weight_map object. Fix: "
                                          "re-save the model with transformers' save_pretrained.")
            return [fmt.inside(d, str(name)) for name in sorted(set(weight_map.values()))]
        raise fmt.CheckpointError(f"{d} has no {WEIGHTS} (nor {WEIGHTS_INDEX}). Fix: save "
                                  "the model with save_pretrained(..., safe_serialization=True).")

    def get(self, key: str) -> torch.Tensor:
        with _safetensors_file(self.file_of[key]) as f:
            return f.get_tensor(key)


def _named(keys: list[str]) -> str:
    shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
    return f"{len(keys)} tensor(s) ({shown})"


class HFTensorSource:
    """A transformers model's weights as megaresil's `model/*` global tensors
    (fp32 master weights), made on demand from the files: a TensorSource for
    the offline writer and for a run's initial weights. Refuses weights the
    model would not use and weights it lacks."""

    def __init__(self, weights: HFWeights, cfg: ModelConfig):
        self.weights = weights
        self.mapping = {f"model/{key}": m
                        for key, m in hf.hf_mapping(cfg, weights.shapes).items()}
        self._check_keys(cfg)
        self.tensors = {key: {"global_shape": list(self._meta(m).shape), "dtype": "float32"}
                        for key, m in self.mapping.items()}

    def _check_keys(self, cfg: ModelConfig) -> None:
        where = self.weights.directory
        needed = {source for m in self.mapping.values() for source in m.sources}
        missing = sorted(needed - set(self.weights.shapes))
        if missing:
            raise fmt.CheckpointError(f"{where} lacks {_named(missing)} that its config.json "
                                      "implies. Fix: re-save the model with save_pretrained.")
        unused = hf.unused_hf_keys(self.weights.shapes, cfg)
        if unused:
            raise fmt.CheckpointError(f"{where} holds {_named(unused)} that a {cfg.flavour.value} "
                                      "model as its config.json describes does not use. Fix: "
                                      "export the model without them, or correct config.json.")
        tied_head_stored = (hf.TIED_HEAD in self.weights.shapes
                            and "model/head.weight" not in self.mapping)
        embedding = self.mapping["model/embed.tokens.weight"].sources[0]
        if tied_head_stored and not torch.equal(self.weights.get(hf.TIED_HEAD),
                                                self.weights.get(embedding)):
            raise fmt.CheckpointError(f"{where}: config.json ties the embeddings but "
                                      f"{hf.TIED_HEAD} differs from the input embedding. Fix: set "
                                      "tie_word_embeddings to false in config.json.")

    def _meta(self, m: hf.Mapped) -> torch.Tensor:
        return m.combine(*(torch.empty(self.weights.shapes[s], device="meta") for s in m.sources))

    def full(self, key: str) -> torch.Tensor:
        m = self.mapping[key]
        return m.combine(*(self.weights.get(source) for source in m.sources)).float()

    def read(self, targets: list[Rect]) -> None:
        fill_from_full(targets, self.full)


def hf_model_keys(directory: Path) -> tuple[dict, list[str]]:
    """`model.*` keys of a transformers model directory, and the lines that
    say what could not be carried over (hf.config_from_hf). The sizes its
    config.json declares are checked against the weights' headers first:
    nothing is built from a size the weights do not have (a declared million
    layers made a name map of a million layers, 4.4 GB)."""
    model_keys, notes = hf.config_from_hf(read_hf_config(directory))
    weights = HFWeights(directory)
    errors = hf.declared_size_errors(model_keys, weights.shapes)
    if errors:
        files = ", ".join(path.name for path in weights.files)
        raise fmt.CheckpointError(f"{directory / CONFIG} does not describe the weights in "
                                  f"{files}: {'; '.join(errors)}. Fix: use the config.json saved "
                                  "with these weights (save_pretrained writes both).")
    return model_keys, notes


def hf_source(directory: Path, cfg: ModelConfig) -> HFTensorSource:
    return HFTensorSource(HFWeights(directory), cfg)


def import_from_hf(hf_dir: Path, dst: Path, target: Target, *, recipe: Optional[Path] = None,
                   overwrite: bool = False) -> Path:
    """Write a transformers model directory as a weights-only checkpoint at
    the target layout; the recipe is `recipe` (or the defaults) with the
    model's architecture and hyper-parameters from its config.json."""
    refuse_existing(dst, overwrite)
    model_keys, notes = hf_model_keys(hf_dir)
    for note in notes:
        print(f"megaresil: {note}", file=sys.stderr)
    base = to_dict(load_recipe(recipe) if recipe else RecipeConfig())
    base["model"].update(model_keys)
    if check_hf_tokenizer(hf_dir, model_keys["vocab_size"]):  # what --to-hf exports again
        base["data"]["tokenizer"] = str(hf_dir.resolve())
    cfg = target_recipe(base, target)
    hf.refuse_unmapped(cfg.model, "--from-hf")
    origin = {"hugging_face": str(hf_dir),
              "architecture": read_hf_config(hf_dir)["architectures"][0]}
    return write_checkpoint(hf_source(hf_dir, cfg.model), cfg, dst,
                            backend=cfg.checkpoint.backend.value, weights_only=True,
                            state=imported_state(cfg, origin), overwrite=overwrite)
