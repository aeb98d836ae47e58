"""Megatron-LM / Megatron-Core checkpoints (torch_dist) read as megaresil's
weights: `convert --from-megatron`, `ckpt inspect` of one, and a run's
initial weights (`checkpoint.init_from`); docs/checkpoints.md, "From Megatron".

SRC is a save directory or one `iter_NNNNNNN/` in it: the common state from
`common.pt` or DCP's `common_state` object, the model's shape from Megatron-LM's args in it (else a
recipe), the tensors from DCP's files at whatever tp x pp they were saved,
through names.py's table; the optimizer state too where Megatron saved it in
model space (optimizer_state.py). Untrusted input: `common.pt` loads
with torch.load(weights_only=True), admitting argparse.Namespace, BytesIO and, for
Megatron's own classes in it (enums, configs), an inert stand-in that runs
nothing; DCP's metadata admits, beyond megaresil's list, the planner data
classes Mcore caches in it (`all_local_plans`).
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint.planner as planner_classes
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.backends.dcp_read import SafeReader
from megaresil.checkpoint.backends.torch_dist import read_dcp
from megaresil.checkpoint.megatron import names
from megaresil.checkpoint.megatron.arguments import model_keys, tokenizer_of
from megaresil.checkpoint.megatron.directory import iteration_dir
from megaresil.checkpoint.megatron.names import Name
from megaresil.checkpoint.megatron.optimizer_state import (
    MOMENTS,
    CarriedState,
    carried_state,
    held_under,
    is_optimizer_key,
    prefix,
)
from megaresil.checkpoint.offline.convert import Target, imported_state, target_recipe
from megaresil.checkpoint.offline.writer import refuse_existing, write_checkpoint
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.sources import fill_from_full
from megaresil.config import ModelConfig, RecipeConfig, load_recipe, to_dict
from megaresil.model.gpt import layout_free_buffer_shapes, layout_free_shapes

COMMON = "common.pt"
# The DCP key of the common state in later Mcores: ShardedObject("common_state",
# data, (1,), (0,)).unique_key, the object pickled in a one-element list.
COMMON_STATE = "common_state/shard_0_1"
_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_MAX_STAND_INS = 256  # distinct Megatron classes one common state may name


class MegatronValue:
    """An object of one of Megatron's own classes in the common state (an
    enum, a config dataclass), kept inert: its pickled arguments and state."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"MegatronValue{self.args!r}"


class MegatronReader(SafeReader):
    """SafeReader of Mcore's files: its cached plans admitted, and the
    metadata unpickled once for every read of the checkpoint (DCP asks for
    it on each load, and a model's import is a load per tensor)."""

    extra_globals = {(planner_classes.__name__, name): getattr(planner_classes, name)
                     for name in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")}
    _metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


def _unpickled_common(data: bytes, where: str, wrapped: bool = True) -> dict:
    """A torch.save'd common state, weights only; Megatron's classes as
    MegatronValue. Inside DCP's files it is wrapped twice (`wrapped`): DCP
    saved the bytes of a BytesIO into which Mcore saved a list of one state."""
    allowed: list = [argparse.Namespace, io.BytesIO]
    for _ in range(_MAX_STAND_INS):
        try:
            with torch.serialization.safe_globals(allowed):
                state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            found = _UNSUPPORTED_GLOBAL.search(str(err))
            if not (found and found[1].startswith("megatron.")):
                raise fmt.CheckpointError(f"{where} names {found[1] if found else err}, which is "
                                          "not Megatron's: refusing to unpickle it. Fix: give "
                                          "a checkpoint that Megatron saved.") from None
            allowed.append((MegatronValue, found[1]))
            continue
        except (RuntimeError, EOFError, ValueError) as err:
            raise fmt.CheckpointError(f"{where} is unreadable ({err}). Fix: copy the "
                                      "checkpoint again.") from None
        if wrapped and isinstance(state, io.BytesIO):
            return _unpickled_common(state.getvalue(), where, wrapped=False)
        state = state[0] if isinstance(state, list) and len(state) == 1 else state
        if not isinstance(state, dict):
            raise fmt.CheckpointError(f"{where} holds a {type(state).__name__}, not a state dict")
        return state
    raise fmt.CheckpointError(f"{where} names more than {_MAX_STAND_INS} Megatron classes")


def read_common(directory: Path, metadata: Metadata) -> dict:
    """The common state: common.pt, else (Megatron-Core after Megatron-LM
    PR #5160) the `common_state` object inside DCP's files."""
    if (directory / COMMON).is_file():
        return _unpickled_common((directory / COMMON).read_bytes(), str(directory / COMMON),
                                 wrapped=False)
    stored = metadata.storage_data.get(MetadataIndex(COMMON_STATE))
    if stored is None:
        raise fmt.CheckpointError(f"{directory} has no common state ({COMMON}, or "
                                  f"{COMMON_STATE} in DCP's files). Fix: give a torch_dist "
                                  "checkpoint directory that Megatron saved whole.")
    if getattr(stored, "transform_descriptors", None):
        raise fmt.CheckpointError(f"{directory}: its {COMMON_STATE} is stored transformed "
                                  f"({stored.transform_descriptors}), which megaresil does not "
                                  "read. Fix: save without checkpoint compression.")
    with open(fmt.inside(directory, str(stored.relative_path)), "rb") as file:
        file.seek(stored.offset)
        data = file.read(stored.length)
    if len(data) != stored.length:
        raise fmt.CheckpointError(f"{directory}: {stored.relative_path} is shorter than DCP's "
                                  "metadata says (truncated file). Fix: copy it again.")
    return _unpickled_common(data, f"{directory}'s {COMMON_STATE}")


def _reader(directory: Path) -> MegatronReader:
    if (directory / fmt.MARKER).exists():
        raise fmt.CheckpointError(f"{directory} is a megaresil checkpoint, not Megatron's. Fix: "
                                  "convert it with `megaresil convert SRC DST`.")
    if not (directory / ".metadata").is_file():
        raise fmt.CheckpointError(f"{directory} has no DCP .metadata: not a torch_dist "
                                  "checkpoint (the legacy torch format, mp_rank_XX/, is not "
                                  "read). Fix: save it with --ckpt-format torch_dist.")
    reader = MegatronReader(str(directory))
    reader.read_metadata()
    return reader


@dataclass
class MegatronCheckpoint:
    """What a Megatron checkpoint holds: its iteration, Megatron-LM's args
    (None when the common state has none), each weight's global shape
    (`shapes`), every tensor's, the optimizer's included (`stored`), their
    dtypes, the common state's optimizer entry, and what is never read."""
    directory: Path
    iteration: int
    args: Optional[argparse.Namespace]
    shapes: dict[str, tuple[int, ...]]
    stored: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    optimizer: dict
    skipped: list[str]
    reader: MegatronReader

    def carried(self) -> CarriedState:
        """What of its optimizer state an import takes."""
        return carried_state(self.shapes, self.stored, self.optimizer, self.iteration)

    @property
    def consumed_samples(self) -> int:
        return int(getattr(self.args, "consumed_train_samples", 0) or 0)


def open_megatron(path: Path) -> MegatronCheckpoint:
    directory = iteration_dir(path)
    reader = _reader(directory)
    metadata = reader.read_metadata()
    common = read_common(directory, metadata)
    stored, dtypes, skipped = {}, {}, []
    for key, meta in metadata.state_dict_metadata.items():
        if key == COMMON_STATE:
            continue
        if not isinstance(meta, TensorStorageMetadata):
            skipped.append(key)  # _extra_state, RNG state, bucket-space optimizer objects
            continue
        stored[key], dtypes[key] = tuple(meta.size), meta.properties.dtype
    shapes = {key: shape for key, shape in stored.items() if not is_optimizer_key(key)}
    args = common.get("args")
    iteration = common.get("iteration", getattr(args, "iteration", 0))
    optimizer = common.get("optimizer")
    return MegatronCheckpoint(directory, int(iteration) if isinstance(iteration, int) else 0,
                              args if isinstance(args, argparse.Namespace) else None,
                              shapes, stored, dtypes,
                              optimizer if isinstance(optimizer, dict) else {}, skipped, reader)


@dataclass(frozen=True)
class Source:
    """Where one megaresil tensor lies in the Megatron checkpoint: its key,
    the layer of a stacked tensor (None: the whole tensor), the SwiGLU half."""
    key: str
    layer: Optional[int]
    half: Optional[int]
    experts: bool = False


def _spelling(name: Name, held: dict, layer: Optional[int]) -> Optional[Source]:
    for theirs in name.theirs:
        if layer is not None and names.per_layer(layer, theirs) in held:
            return Source(names.per_layer(layer, theirs), None, name.half, name.experts)
        key = names.stacked(theirs) if layer is not None else theirs
        if key in held:
            return Source(key, layer, name.half, name.experts)
        halves = [key + suffix for suffix in names.HALF_SUFFIXES]
        if name.half is not None and all(h in held for h in halves):
            return Source(halves[name.half], layer, None, name.experts)
    return None


def sources(held: dict[str, tuple[int, ...]], ours: dict[str, tuple[int, ...]],
            cfg: ModelConfig, where: Path, key_prefix: str = "") -> dict[str, Source]:
    """Each of `ours` (megaresil keys of the model's tensors: its parameters,
    and for the weights its state buffers too), where it lies among `held` (a
    checkpoint's tensors under `key_prefix`, by the rest of their key);
    CheckpointError naming what is missing or held beyond the model."""
    top, layer = names.names_of(set(ours))
    found: dict[str, Optional[Source]] = {n.ours: _spelling(n, held, None) for n in top}
    for i, n in itertools.product(range(cfg.num_layers), layer):
        if f"layers.{i}.{n.ours}" in ours:  # a dense layer among expert layers lacks some
            found[f"layers.{i}.{n.ours}"] = _spelling(n, held, i)
    missing = sorted(key for key, s in found.items() if s is None)
    if missing:
        raise fmt.CheckpointError(f"{where} lacks the tensors of {_listed(missing)} "
                                  f"{'that the model needs' if not key_prefix else key_prefix}. "
                                  "Fix: give --recipe (or args) with the model it holds.")
    used = {s.key for s in found.values() if s is not None}
    unused = sorted(set(held) - used)
    if unused:
        raise fmt.CheckpointError(f"{where} holds {_listed(unused)} that a "
                                  f"{cfg.flavour.value} model does not use. Fix: give --recipe "
                                  "with the model it holds.")
    return {key: dataclasses.replace(s, key=key_prefix + s.key)
            for key, s in found.items() if s is not None}


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _parameter(key: str) -> str:
    """The parameter of a `model/<p>` or `optim/<moment>/<p>` key."""
    return key.removeprefix("model/") if key.startswith("model/") else key.split("/", 2)[2]


class MegatronTensorSource:
    """A Megatron checkpoint's weights as megaresil's `model/*` global
    tensors (fp32: its fp32 main weights where `carried` takes them), and
    with `carried` moments AdamW's as `optim/<moment>/*`, read from DCP's
    files when asked: a TensorSource for the offline writer and for a run's
    initial weights."""

    def __init__(self, ckpt: MegatronCheckpoint, cfg: ModelConfig,
                 carried: Optional[CarriedState] = None):
        self.ckpt, self.cfg = ckpt, cfg
        # One meta build each: the parameters have moments, the buffers do not.
        self._params = layout_free_shapes(cfg)
        shapes = {**self._params, **layout_free_buffer_shapes(cfg)}
        self.sources = {f"model/{key}": s for key, s in
                        sources(ckpt.shapes, shapes, cfg, ckpt.directory).items()}
        if carried is not None and carried.main is not None:
            self.sources.update(self._under(carried.main, "model/"))
        if carried is not None and carried.moments:
            for moment in MOMENTS:
                self.sources.update(self._under(prefix(moment), f"optim/{moment}/"))
        # The last block read, by (key, layer): a SwiGLU fc1, a layer's largest
        # tensor, serves two of megaresil's (gate, up), asked one after the other.
        self._last: Optional[tuple[tuple[str, Optional[int]], torch.Tensor]] = None
        self.tensors = {key: {"global_shape": list(shapes[_parameter(key)]),
                              "dtype": "float32"} for key in self.sources}
        self._check_shapes(shapes)

    def _under(self, key_prefix: str, ours: str) -> dict[str, Source]:
        held = held_under(self.ckpt.stored, key_prefix)
        return {ours + key: s for key, s in
                sources(held, self._params, self.cfg, self.ckpt.directory, key_prefix).items()}

    def _stored_shape(self, source: Source) -> tuple[int, ...]:
        shape = self.ckpt.stored[source.key]
        shape = shape[1:] if source.layer is not None else shape
        if source.half is None:
            return shape
        rows = 1 if source.experts else 0
        return (*shape[:rows], shape[rows] // 2, *shape[rows + 1:])

    def _check_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        for key, source in self.sources.items():
            want, held = shapes[_parameter(key)], self._stored_shape(source)
            vocab = _parameter(key) in names.VOCAB_KEYS
            if held != want and not (vocab and held[1:] == want[1:] and held[0] >= want[0]):
                raise fmt.CheckpointError(
                    f"{self.ckpt.directory}: {source.key} has shape "
                    f"{list(self.ckpt.stored[source.key])}, but the model needs {list(want)} "
                    f"for {key}. Fix: give --recipe (or args) with the model it holds.")

    def _block(self, source: Source) -> torch.Tensor:
        """The stored tensor of `source` (one layer's, of a stacked one)."""
        where = (source.key, source.layer)
        if self._last is not None and self._last[0] == where:
            return self._last[1]
        self._last = None  # freed before the next read
        shape, layer = self.ckpt.stored[source.key], source.layer
        offset = (layer or 0, *[0] * (len(shape) - 1))
        block = torch.empty((1, *shape[1:]) if layer is not None else shape,
                            dtype=self.ckpt.dtypes[source.key])
        read_dcp(self.ckpt.reader, [Rect(source.key, shape, offset, block)])
        self._last = (where, block[0] if layer is not None else block)
        return self._last[1]

    def full(self, key: str) -> torch.Tensor:
        source = self.sources[key]
        tensor = self._block(source)
        if source.half is not None:
            tensor = names.swiglu_halves(tensor, source.experts)[source.half]
        if _parameter(key) in names.VOCAB_KEYS:
            tensor = names.unpadded(tensor, self.cfg.vocab_size)
        return tensor.float().contiguous()

    def read(self, targets: list[Rect]) -> None:
        fill_from_full(targets, self.full)


def import_from_megatron(src: Path, dst: Path, target: Target, *,
                         recipe: Optional[Path] = None, tokenizer: Optional[str] = None,
                         overwrite: bool = False) -> Path:
    """Write a Megatron checkpoint as a megaresil checkpoint at the target
    layout, its iteration as the step: a full one (AdamW's moments, Adam's
    step, Megatron's consumed samples as the data position) where Megatron
    saved its optimizer state in model space and the target is not weights
    only, else weights only, said in a note. The recipe is `recipe` (or the
    defaults) with the model from Megatron-LM's args (else the recipe's own
    model) and the tokenizer `tokenizer` (else args')."""
    refuse_existing(dst, overwrite)
    ckpt = open_megatron(src)
    notes: list[str] = []
    base = to_dict(load_recipe(recipe) if recipe else RecipeConfig())
    base["model"].update(megatron_model(ckpt, recipe is not None, notes))
    _fit_sequences(base, notes)
    spec = tokenizer or tokenizer_of(ckpt.args, notes)
    if spec:
        base["data"]["tokenizer"] = spec
    carried = ckpt.carried()
    if target.weights_only and carried.moments:
        carried = dataclasses.replace(carried, moments=False,
                                      note="optimizer state left out (--weights-only)")
    notes += [carried.note if carried.moments else f"weights only: {carried.note}",
              skipped_note(ckpt, carried)]
    if carried.moments:
        notes.append(f"data position: {ckpt.consumed_samples} samples consumed, as Megatron "
                     "counted them (megaresil's sample order is its own)")
    for note in notes:
        print(f"megaresil: {note}", file=sys.stderr)
    cfg = target_recipe(base, target)
    origin = {"megatron": str(src), "iteration": ckpt.iteration}
    state = (imported_state(cfg, origin, ckpt.iteration) if not carried.moments else
             imported_state(cfg, origin, ckpt.iteration, adam_step=carried.adam_step,
                            consumed_samples=ckpt.consumed_samples))
    return write_checkpoint(MegatronTensorSource(ckpt, cfg.model, carried), cfg, dst,
                            backend=cfg.checkpoint.backend.value,
                            weights_only=not carried.moments, state=state, overwrite=overwrite)


def skipped_note(ckpt: MegatronCheckpoint, carried: CarriedState) -> str:
    """What of the checkpoint is not read, counted."""
    optimizer = sum(is_optimizer_key(key) for key in ckpt.stored if not carried.moments)
    optimizer += sum(is_optimizer_key(key) for key in ckpt.skipped)
    extra = sum(names.is_extra_state(key) for key in ckpt.skipped)
    other = len(ckpt.skipped) - extra - sum(is_optimizer_key(key) for key in ckpt.skipped)
    return (f"skipped {optimizer} optimizer-state entries, {extra} _extra_state entries "
            f"(Transformer Engine's FP8 metadata, no weights) and {other} other objects "
            "(RNG state)")


def megatron_model(ckpt: MegatronCheckpoint, recipe_given: bool, notes: list[str]) -> dict:
    """The model.* keys that Megatron-LM's args say ({} to keep a given
    recipe's model when there are none); refused when neither says it."""
    if ckpt.args is not None:
        return model_keys(ckpt.args, notes)
    if recipe_given:
        return {}
    raise fmt.CheckpointError(f"{ckpt.directory}'s common state has no Megatron-LM args to say "
                              "the model's shape. Fix: give --recipe RECIPE with its model.*.")


def _fit_sequences(recipe: dict, notes: list[str]) -> None:
    """data.seq_len no longer than the model's positions."""
    longest = recipe["model"]["max_seq_len"]
    if recipe["data"]["seq_len"] > longest:
        notes.append(f"data.seq_len {recipe['data']['seq_len']} lowered to the model's "
                     f"max_seq_len {longest}")
        recipe["data"]["seq_len"] = longest
