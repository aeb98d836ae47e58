"""`megaresil ckpt inspect` and `ckpt verify` of a Megatron checkpoint: what
it holds and what an import carries; every tensor read whole.

Megatron saves no checksums, so a changed byte inside a tensor cannot be told
from a trained one. What can be checked is checked: the common state
unpickles under the untrusted-input rules, each tensor the metadata names is
read from its file in full (a truncated or missing file fails the read), and
its values are finite (a NaN or an infinity in a weight or a moment is a
broken run or a damaged file either way).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.backends.torch_dist import read_dcp
from megaresil.checkpoint.megatron.arguments import model_keys
from megaresil.checkpoint.megatron.reading import MegatronCheckpoint, open_megatron, skipped_note
from megaresil.checkpoint.sharded import Rect

BLOCK_BYTES = 256 * 2**20  # a large tensor is read in row blocks of about this size


def _blocks(shape: tuple[int, ...], itemsize: int) -> list[tuple[int, int]]:
    """(first row, rows) covering dim 0, each block at most about BLOCK_BYTES."""
    if not shape:
        return [(0, 1)]
    row = math.prod(shape[1:]) * itemsize
    step = max(1, BLOCK_BYTES // max(row, 1))
    return [(first, min(step, shape[0] - first)) for first in range(0, shape[0], step)]


def _nonfinite(ckpt: MegatronCheckpoint, key: str) -> int:
    """How many of the tensor's values are not finite, read block by block."""
    shape, dtype = ckpt.stored[key], ckpt.dtypes[key]
    bad = 0
    for first, rows in _blocks(shape, dtype.itemsize):
        block = torch.empty((rows, *shape[1:]) if shape else (), dtype=dtype)
        read_dcp(ckpt.reader, [Rect(key, shape, (first, *[0] * (len(shape) - 1)) if shape
                                    else (), block)])
        if block.is_floating_point():
            bad += int((~torch.isfinite(block)).sum())
    return bad


def verify(path: Path) -> tuple[bool, str]:
    """(valid, what was checked or what is wrong) for a Megatron checkpoint."""
    try:
        ckpt = open_megatron(path)
        nonfinite = {key: count for key in ckpt.stored if (count := _nonfinite(ckpt, key))}
    except fmt.CheckpointError as err:
        return False, str(err)
    if nonfinite:
        named = ", ".join(f"{key} ({count})" for key, count in list(nonfinite.items())[:4])
        return False, (f"non-finite values in {len(nonfinite)} tensors: {named}. Fix: start "
                       "from an earlier iteration")
    total = sum(math.prod(shape) * ckpt.dtypes[key].itemsize for key, shape in ckpt.stored.items())
    return True, (f"Megatron torch_dist, iteration {ckpt.iteration}: {len(ckpt.stored)} tensors "
                  f"({total / 2**20:.2f} MiB) read whole, every value finite; Megatron saves no "
                  "checksums, so a changed byte inside a tensor cannot be found")


def summary(path: Path) -> dict:
    """What `ckpt inspect` says of a Megatron checkpoint."""
    ckpt = open_megatron(path)
    notes: list[str] = []
    try:
        model = model_keys(ckpt.args, notes) if ckpt.args is not None else {}
    except fmt.CheckpointError as err:
        model, notes = {}, [str(err)]
    tensors = {key: {"shape": list(shape), "dtype": str(ckpt.dtypes[key]).removeprefix("torch."),
                     "bytes": math.prod(shape) * ckpt.dtypes[key].itemsize}
               for key, shape in ckpt.shapes.items()}
    args = ckpt.args
    return {"path": str(ckpt.directory), "format": "megatron torch_dist",
            "iteration": ckpt.iteration,
            "tp": getattr(args, "tensor_model_parallel_size", None),
            "pp": getattr(args, "pipeline_model_parallel_size", None),
            "model": model, "notes": [*notes, ckpt.carried().note,
                                      skipped_note(ckpt, ckpt.carried())],
            "tensors": tensors,
            "import": f"megaresil convert --from-megatron {path} DST"
                      + ("" if args is not None else " --recipe RECIPE")}


def format_summary(info: dict, tensors: bool = False) -> str:
    from megaresil.checkpoint.offline.inspect import format_model

    saved_at = (f"tp={info['tp']} pp={info['pp']}" if info["tp"] else
                "unknown (no Megatron-LM args)")
    total = sum(t["bytes"] for t in info["tensors"].values())
    lines = [f"megatron    {info['path']}  ({info['format']}, weights read by megaresil)",
             f"iteration   {info['iteration']}",
             f"saved at    {saved_at}",
             f"model       {format_model(info['model']) or 'not in args: give --recipe'}",
             f"tensors     {len(info['tensors'])}, {total / 2**20:.2f} MiB"
             + ("" if tensors else "  (list them with --tensors)"),
             *(f"note        {note}" for note in info["notes"]),
             f"import      {info['import']}"]
    if tensors:
        width = max(len(k) for k in info["tensors"])
        lines += [""] + [f"  {key:<{width}}  {str(tuple(t['shape'])):<16} {t['dtype']}"
                         for key, t in info["tensors"].items()]
    return "\n".join(lines)
