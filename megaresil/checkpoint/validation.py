"""What makes a checkpoint usable, checked in one place: a manifest's fields
(before anything is allocated or opened), a local shard's meta fields, the
keys and shapes a model loads, and every shard's checksum.

The file I/O stays with the format (format.read_covered_json checks a file's
bytes against the completion marker's digest); `read_manifest` is that read
followed by the manifest's checks.
`ckpt inspect` reads manifests through this module, so it never imports torch
(verify_shards imports it where it makes tensors).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

from megaresil.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    MARKER,
    CheckpointError,
    check_dtype,
    checksum,
    read_covered_json,
    region_bytes,
    torch_dtype,
)
from megaresil.checkpoint.sharded import Rect

if TYPE_CHECKING:
    from megaresil.checkpoint.backends.base import Backend
    from megaresil.checkpoint.local.shard import Shard


# --- a global checkpoint's manifest ---------------------------------------------------

def nonfinite_keys(rects: Iterable[Rect]) -> list[str]:
    """The keys of the rects that hold a NaN or an infinity: such a state is
    never saved (docs/numerics.md). One pass over the data, at a save."""
    return [r.key for r in rects if r.tensor.is_floating_point() and not all_finite(r.tensor)]


def all_finite(tensor) -> bool:
    """Whether every element is finite, from the tensor's sum: an inf or a
    NaN anywhere makes the sum inf or NaN, so a finite sum proves it. Only
    a sum that is not finite (a NaN or inf, or a sum that overflowed) is
    checked element by element. A sum reads the data once and allocates
    nothing; `isfinite(t).all()` takes 10x its CPU (it makes a bool tensor
    the size of `t`), the largest part of a local save's CPU when it ran on
    every save."""
    import torch  # here: `ckpt inspect` and `verify` read manifests without torch
    wide = tensor.dtype if tensor.element_size() >= 4 else torch.float32  # fp16 sums overflow
    return bool(torch.isfinite(tensor.sum(dtype=wide))) or bool(torch.isfinite(tensor).all())


def nonfinite_refusal(keys: list[str]) -> str:
    return (f"non-finite values (NaN or inf) in {_named(sorted(set(keys)))}: not saved, the "
            "previous checkpoint stays")


def read_manifest(directory: Path) -> dict:
    """The manifest of a committed checkpoint, or CheckpointError saying why not."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory} does not exist or is not a directory")
    if not (directory / MARKER).exists():
        raise CheckpointError(f"{directory.name} has no completion marker ({MARKER}): the save "
                              "did not finish")
    manifest = read_covered_json(directory, MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{directory.name} is not a {FORMAT_NAME} (format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("version", 0)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{directory.name} has format version {version!r}, newer "
                              f"than this megaresil reads ({FORMAT_VERSION}); upgrade megaresil")
    try:
        check_manifest(manifest)
    except CheckpointError as err:
        raise CheckpointError(f"{directory.name}/{MANIFEST}: {err}") from None
    return manifest


# The largest tensor dimension a manifest may name: far above any real model,
# far below what would overflow a size computation.
MAX_DIM = 2**36
BACKENDS = ("torch_dist", "zarr")


def check_run_fields(run: dict) -> None:
    """The non-tensor state a resume reads (checkpoint/state.py's RunRecord),
    present and of the right kinds, so reading it cannot fail later."""
    need_field(run, "step", int, lambda v: v >= 0)
    need_field(run, "layout", dict)
    need_field(run, "recipe", dict)
    need_field(need_field(run, "data", dict), "consumed_samples", int, lambda v: v >= 0)
    need_field(need_field(run, "optimizer", dict), "adam_step", int, lambda v: v >= 0)
    if not isinstance(run.get("rank_states") or [], list):
        raise CheckpointError("rank_states is not a list")


def check_manifest(manifest: dict) -> None:
    """Everything a load reads from a manifest, checked before anything is
    allocated or opened: CheckpointError naming the first bad field."""
    check_run_fields(manifest)
    if manifest.get("backend") not in BACKENDS:
        raise CheckpointError(f"unknown backend {manifest.get('backend')!r} (known: "
                              f"{', '.join(BACKENDS)})")
    for key, entry in need_field(manifest, "tensors", dict).items():
        check_tensor_entry(key, entry)


def check_tensor_entry(key: str, entry: Any) -> None:
    """A tensor's entry: a known dtype, a sane global shape, and shards that
    lie inside it and cover it exactly (each region is written once)."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"tensor {key!r} is not an object")
    check_dtype(entry.get("dtype"))
    shape = checked_shape(entry.get("global_shape"), f"{key}: global_shape")
    covered = 0
    for shard in need_field(entry, "shards", list):
        if not isinstance(shard, dict):
            raise CheckpointError(f"{key}: a shard is not an object")
        offset = checked_shape(shard.get("offset"), f"{key}: shard offset", len(shape))
        extent = checked_shape(shard.get("shape"), f"{key}: shard shape", len(shape))
        if any(o + n > g for o, n, g in zip(offset, extent, shape)):
            raise CheckpointError(f"{key}: shard at {tuple(offset)} of shape {tuple(extent)} "
                                  f"lies outside the tensor's shape {tuple(shape)}")
        need_field(shard, "checksum", str)
        need_field(shard, "rank", int)
        covered += math.prod(extent)
    if covered != math.prod(shape):
        raise CheckpointError(f"{key}: its shards hold {covered} elements, its shape "
                              f"{tuple(shape)} has {math.prod(shape)}")


def checked_shape(value: Any, what: str, ndim: Optional[int] = None) -> list[int]:
    if (not isinstance(value, list) or (ndim is not None and len(value) != ndim)
            or not all(type(v) is int and 0 <= v <= MAX_DIM for v in value)):
        raise CheckpointError(f"{what} is {str(value)[:80]}, not a list of "
                              f"{ndim if ndim is not None else 'some'} sizes in 0..{MAX_DIM}")
    return value


def need_field(record: dict, key: str, kind: type, ok=lambda v: True) -> Any:
    """record[key], refused unless of `kind` and `ok`."""
    value = record.get(key) if isinstance(record, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int or not ok(value):
        raise CheckpointError(f"{key!r} is {str(value)[:80]}, not a valid {kind.__name__}")
    return value


# --- a local shard ---------------------------------------------------------------------

def shard_problem(shard: Shard) -> Optional[str]:
    """None when the shard's bytes match its checksums, else why not."""
    size = sum(rec["nbytes"] for rec in shard.meta["rects"])
    if shard.data.numel() != size:
        return f"holds {shard.data.numel()} bytes, its manifest says {size}"
    for rec in shard.meta["rects"]:
        if checksum(shard.data[rec["start"]: rec["start"] + rec["nbytes"]]) != rec["checksum"]:
            return f"checksum mismatch in {rec['key']} at offset {tuple(rec['offset'])}"
    return None


def check_meta(meta: dict) -> None:
    """Everything a recovery reads from a shard's meta.json, present and of
    the right kinds (its bytes are checked against the marker's digest
    first; this catches a shard written wrong, or without a digest)."""
    world = need_field(meta, "world", int, lambda v: v > 0)
    need_field(meta, "owner", int, lambda v: 0 <= v < world)
    need_field(meta, "layout", dict)
    need_field(meta, "rank_state", dict)
    check_run_fields(need_field(meta, "run", dict))
    start = 0
    for rec in need_field(meta, "rects", list):
        need_field(rec, "key", str)
        need_field(rec, "checksum", str)
        shape = checked_shape(rec.get("shape"), "a rect's shape")
        checked_shape(rec.get("offset"), "a rect's offset", len(shape))
        if need_field(rec, "start", int) != start or need_field(rec, "nbytes", int) != \
                region_bytes(shape, rec.get("dtype")):
            raise CheckpointError(f"rect {rec['key']!r}: its start or size does not match "
                                      "its place and shape")
        start += rec["nbytes"]


# --- against the model, and the shards' bytes -------------------------------------------

def _named(keys: list[str], shown: int = 8) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"{len(keys)} tensor(s) ({', '.join(keys[:shown])}{more})"


def check_keys(held: Iterable[str], consumed: set[str]) -> None:
    """Refuse a checkpoint whose tensor keys (`held`) are not exactly those
    the model consumes: a key left over would be silently ignored (a 4-layer
    checkpoint loading into a 2-layer model), a missing one left unset."""
    held = set(held)
    missing, unused = sorted(consumed - held), sorted(held - consumed)
    problems = []
    if missing:
        problems.append(f"lacks {_named(missing)} that the model needs")
    if unused:
        problems.append(f"holds {_named(unused)} that the model does not use")
    if problems:
        raise CheckpointError(f"the checkpoint {' and '.join(problems)}: it was saved from "
                                  "a different model. Fix: check model.* against the "
                                  "checkpoint's recipe (megaresil ckpt inspect)")


def check_shapes(tensors: dict[str, dict], targets: list[Rect], consumed: set[str]) -> None:
    """Refuse a checkpoint (its tensor table `tensors`) unless its keys are
    exactly `consumed` (what every rank of the layout loads, together) and
    each of `targets` (the rects loaded here) has its global shape."""
    check_keys(tensors, consumed)
    for target in sorted(targets, key=lambda t: t.key):
        saved = tensors[target.key]
        if tuple(saved["global_shape"]) != tuple(target.global_shape):
            raise CheckpointError(
                f"{target.key}: the checkpoint holds shape {tuple(saved['global_shape'])}, the "
                f"model expects {tuple(target.global_shape)}; check model.* against the "
                "checkpoint's recipe (megaresil ckpt inspect)")


def verify_shards(backend: Backend, directory: Path, manifest: dict,
                  shards: list[tuple[str, dict, dict]]) -> Optional[str]:
    """Read each shard back and compare its checksum; None if all match."""
    import torch  # only where tensors are made: manifests are checked without it

    targets = [Rect(key, tuple(entry["global_shape"]), tuple(shard["offset"]),
                    torch.empty(shard["shape"], dtype=torch_dtype(entry["dtype"])))
               for key, entry, shard in shards]
    try:
        backend.read(directory, manifest, targets)
    except Exception as err:  # noqa: BLE001 (a missing or truncated file: a bad checkpoint)
        return f"reading shards failed: {type(err).__name__}: {err}"
    for target, (key, _, shard) in zip(targets, shards):
        if checksum(target.tensor) != shard["checksum"]:
            return (f"checksum mismatch in {key} at offset {tuple(shard['offset'])} "
                    f"(written by rank {shard['rank']})")
    return None
