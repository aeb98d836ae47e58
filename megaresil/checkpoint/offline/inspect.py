"""`megaresil ckpt inspect` and `megaresil ckpt verify`: single-process looks
at a checkpoint directory. Inspecting reads the manifest alone and never
imports torch (it answers in a fraction of a second); verifying reads the
shards, so it does."""
from __future__ import annotations

import math
from pathlib import Path

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.backends import get_backend
from megaresil.checkpoint.validation import read_manifest, verify_shards


def summary(path: Path) -> dict:
    manifest = read_manifest(path)
    per_rank: dict[int, int] = {}
    tensors = {}
    for key, entry in manifest["tensors"].items():
        total = 0
        for shard in entry["shards"]:
            nbytes = fmt.region_bytes(shard["shape"], entry["dtype"])
            per_rank[shard["rank"]] = per_rank.get(shard["rank"], 0) + nbytes
            total += nbytes
        tensors[key] = {"shape": entry["global_shape"], "dtype": entry["dtype"],
                        "shards": len(entry["shards"]), "bytes": total}
    parameters = sum(math.prod(t["shape"]) for key, t in tensors.items()
                     if key.startswith("model/"))
    return {"path": str(path), "step": manifest["step"], "backend": manifest["backend"],
            "format_version": manifest["version"], "layout": manifest["layout"],
            "consumed_samples": manifest["data"]["consumed_samples"],
            "total_bytes": sum(per_rank.values()),
            "bytes_per_rank": [per_rank[r] for r in sorted(per_rank)], "parameters": parameters,
            "model": manifest.get("recipe", {}).get("model", {}),
            "weights_only": bool(manifest.get("weights_only", False)), "tensors": tensors}


def format_model(model: dict) -> str:
    """The model config's shape-defining fields, on one line."""
    shown = ("flavour", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size",
             "max_seq_len")
    line = " ".join(f"{k}={model[k]}" for k in shown if model.get(k) is not None)
    moe = model.get("moe", {})
    if moe.get("num_experts"):
        line += f" experts={moe['num_experts']} top_k={moe['top_k']}"
    return line


def format_summary(info: dict, tensors: bool = False) -> str:
    """The summary; with `tensors`, every tensor's shape, dtype and shards after it."""
    layout = info["layout"]
    lines = [f"checkpoint  {info['path']}",
             f"step        {info['step']}  (samples consumed {info['consumed_samples']})",
             f"backend     {info['backend']}  (format v{info['format_version']})",
             f"layout      tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} "
             + "".join(f"{axis}={layout[axis]} " for axis in ("dp_shard", "ep", "cp") if axis in layout)
             + f"vpp={layout['vpp']} sp={layout['sequence_parallel']} "
             f"distributed_optimizer={layout['distributed_optimizer']}",
             f"parameters  {info['parameters']:,}"
             + ("  (weights only: no optimizer state, not a point to resume training from; "
                "start a run from it with checkpoint.init_from)" if info["weights_only"] else ""),
             f"model       {format_model(info['model'])}",
             f"tensors     {len(info['tensors'])}, {info['total_bytes'] / 2**20:.2f} MiB"
             + ("" if tensors else "  (list them with --tensors)"),
             "bytes/rank  " + " ".join(f"{b / 2**20:.2f}" for b in info["bytes_per_rank"]) + " MiB"]
    if not tensors:
        return "\n".join(lines)
    width = max(len(k) for k in info["tensors"])
    lines.append("")
    for key, t in info["tensors"].items():
        lines.append(f"  {key:<{width}}  {str(tuple(t['shape'])):<16} {t['dtype']:<9} "
                     f"{t['shards']} shard(s)")
    return "\n".join(lines)


def verify(path: Path) -> str | None:
    """None when every shard is present and matches its checksum, else why not."""
    try:
        manifest = read_manifest(path)
    except fmt.CheckpointError as err:
        return str(err)
    return verify_shards(get_backend(manifest["backend"]), path, manifest,
                         list(fmt.iter_shards(manifest)))
