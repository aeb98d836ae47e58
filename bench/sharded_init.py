"""Model init: one rank of a tensor-parallel layout, before and after the
meta-device sharded init, side by side in one run.

Before (the init up to this change): the rank builds its chunk on the host,
and for every parameter draws the full, global tensor there, then keeps its
slice. After (model/init.py `materialize`): the chunk is built on the meta
device, only the rank's slices are allocated (on the target device), and only
the blocks of units its slices touch are drawn.

Each side runs in a fresh process (so ru_maxrss is its own peak); reported:
peak RSS above the process's RSS after `import torch`, and init seconds. The
target device here is the CPU, so "after" still holds the local model in host
memory; on a GPU that part moves to the device and host memory holds one
block (UNITS_PER_DRAW units) at a time.

    python bench/sharded_init.py [--tp 8] [--rank 0] [--out bench/results]

Other work shared the machine; both sides ran in the same invocation.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the "before" side slices global tensors as the tests do

from megaresil.config import Flavour, ModelConfig  # noqa: E402
from megaresil.model import init  # noqa: E402
from megaresil.model.gpt import GPT  # noqa: E402
from megaresil.parallel.tensor_parallel import TPGroup  # noqa: E402
from tests.harness.model import assign_full  # noqa: E402

# A Llama-style model of ~0.5B parameters: ~2 GB in fp32.
CONFIG = dict(flavour=Flavour.llama, num_layers=8, hidden_size=2048, num_heads=16,
              num_kv_heads=8, vocab_size=32000, max_seq_len=2048)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def full_tensor_init(model: GPT, cfg: ModelConfig, seed: int) -> None:
    """The init this replaces: each parameter's global tensor drawn whole on
    the host from one (seed, key) generator, then sliced."""
    for key, param in model.named_parameters():
        shape = init.global_shape(key, param, cfg)
        if key.endswith("bias"):
            full = torch.zeros(shape)
        elif "norm" in key:
            full = torch.ones(shape)
        else:
            generator = torch.Generator().manual_seed(init.key_seed(seed, key))
            full = torch.randn(shape, generator=generator) * init.init_std(key, cfg)
        assign_full(param, full)


def one_side(side: str, tp: int, rank: int) -> dict:
    cfg = ModelConfig(**CONFIG)
    tp_group = TPGroup(size=tp, rank=rank)
    base = current_rss_mb()
    started = time.perf_counter()
    if side == "before":
        model = GPT(cfg, tp=tp_group, seed=0)
        full_tensor_init(model, cfg, seed=0)
    else:
        with torch.device("meta"):
            model = GPT(cfg, tp=tp_group, seed=0)
        init.materialize(model, cfg, seed=0, device=torch.device("cpu"))
    seconds = time.perf_counter() - started
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"side": side, "seconds": round(seconds, 2),
            "peak_rss_above_import_mb": round(peak_rss_mb() - base, 1),
            "local_param_mb": round(local / 2**20, 1)}


def global_param_mb() -> float:
    with torch.device("meta"):
        model = GPT(ModelConfig(**CONFIG))
    return sum(p.numel() * 4 for p in model.parameters()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--side", choices=["before", "after"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # a child: one side, JSON on stdout
        print(json.dumps(one_side(args.side, args.tp, args.rank)))
        return
    rows = [json.loads(subprocess.run(
        [sys.executable, __file__, "--side", side, "--tp", str(args.tp), "--rank", str(args.rank)],
        check=True, capture_output=True, text=True).stdout) for side in ("before", "after")]
    before, after = rows
    model = {**CONFIG, "flavour": "llama", "global_param_mb": round(global_param_mb(), 1)}
    result = {"model": model,
              "tp": args.tp, "rank": args.rank, "sides": rows,
              "peak_rss_ratio_after_over_before": round(after["peak_rss_above_import_mb"]
                                                        / before["peak_rss_above_import_mb"], 3),
              "time_ratio_after_over_before": round(after["seconds"] / before["seconds"], 3),
              "note": "other work shared the machine (2 cores); both sides ran in this invocation"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharded_init.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
