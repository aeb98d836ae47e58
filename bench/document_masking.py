"""Measure what document masking (data.reset_position_ids,
data.reset_attention_mask, data.eod_mask_loss) costs against unmasked
training, side by side in one run.

Each setting packs documents of a mean length (drawn from a geometric
distribution, so lengths vary as a real corpus's do) into windows of T
tokens, and times, alternating in rounds so a busy spell of the shared
machine hits every variant:

- step: forward + backward of the whole model (one process, fp32, a llama
  flavour with grouped-query attention), unmasked against all three switches
  on (model/masks.py's block-diagonal attention, reset positions, eod
  targets left out);
- attention: one layer's attention core alone, causal SDPA against the
  block-diagonal path and against SDPA under a dense (B, 1, T, T) mask
  shared by the heads (the alternative the block-diagonal path replaces);
- layout: finding the documents on the host (document_layout), per micro-batch.

    python bench/document_masking.py [--seq 512 2048] [--mean-docs 32 256 1024]
        [--rounds 3] [--out bench/results] [--quick]

The ratios are the figures to read (masked / unmasked: below 1 is faster);
each time is the fastest of its rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from megaresil.config import Flavour, ModelConfig
from megaresil.model.gpt import GPT
from megaresil.model.init import materialize
from megaresil.model.masks import DocumentMasking, document_layout

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
EOD = 0


def windows(batch: int, seq: int, mean: int, seed: int) -> torch.Tensor:
    """(batch, seq + 1) tokens: documents of geometric lengths (mean `mean`),
    each closed by EOD, packed end to end."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 1000, (batch, seq + 1), generator=generator)
    p = torch.full((batch, seq + 1), 1.0 / mean)
    tokens[torch.bernoulli(p, generator=generator).bool()] = EOD
    return tokens


def setting(args: argparse.Namespace, seq: int, mean: int) -> dict:
    cfg = ModelConfig(flavour=Flavour.llama, num_layers=args.layers, hidden_size=args.hidden,
                      num_heads=args.heads, num_kv_heads=args.heads // 2, vocab_size=1024,
                      max_seq_len=seq)
    with torch.device("meta"):
        model = GPT(cfg)
    model = materialize(model, cfg, 0, torch.device("cpu"))
    window = windows(args.micro_batch, seq, mean, seed=seq + mean)
    inputs, targets = window[:, :-1], window[:, 1:]
    masking = DocumentMasking(EOD, reset_position_ids=True, reset_attention_mask=True,
                              eod_mask_loss=True)
    masked_targets, documents = masking.apply(inputs, targets)
    assert documents is not None
    attention = model.layers["0"].attn
    generator = torch.Generator().manual_seed(1)
    head_dim = args.hidden // args.heads
    q = torch.randn(args.micro_batch, args.heads, seq, head_dim, generator=generator,
                    requires_grad=True)
    k, v = (torch.randn(args.micro_batch, args.heads // 2, seq, head_dim, generator=generator,
                        requires_grad=True) for _ in range(2))
    dense = documents.dense_mask(None)

    def step(masked: bool) -> None:
        model.zero_grad(set_to_none=True)
        if masked:
            model(inputs, masked_targets, None, documents).backward()
        else:
            model(inputs, targets).backward()

    variants: dict[str, Callable[[], object]] = {
        "step unmasked": lambda: step(False),
        "step masked": lambda: step(True),
        "attention causal": lambda: attention.attend(q, k, v, None).sum().backward(),
        "attention block-diagonal": lambda: attention.core(q, k, v, None,
                                                           documents).sum().backward(),
        "attention dense mask": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, enable_gqa=True).sum().backward(),
        "layout": lambda: masking.apply(inputs, targets),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():
        run()  # warm-up: first-call allocations and dispatch
    for _ in range(args.rounds):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    best = {name: min(ts) for name, ts in times.items()}
    # No block plan: no row holds a boundary, and one causal call serves.
    calls = len(documents.blocks) if documents.blocks is not None else 1
    return {"seq": seq, "mean_document": mean, "micro_batch": args.micro_batch,
            "documents": int(documents.ids[:, -1].sum() + documents.ids.shape[0]),
            "attention_calls": calls,
            "seconds": {name: round(s, 5) for name, s in best.items()},
            "step_ratio": round(best["step masked"] / best["step unmasked"], 3),
            "attention_ratio": round(best["attention block-diagonal"]
                                     / best["attention causal"], 3),
            "dense_attention_ratio": round(best["attention dense mask"]
                                           / best["attention causal"], 3),
            "layout_share_of_step": round(best["layout"] / best["step unmasked"], 4)}


def write(rows: list[dict], args: argparse.Namespace, load: tuple[float, float]) -> None:
    out = Path(args.out) / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "load_average_1min": {"before": round(load[0], 2), "after": round(load[1], 2)},
            "model": {"flavour": "llama", "layers": args.layers, "hidden": args.hidden,
                      "heads": args.heads, "kv_heads": args.heads // 2},
            "rounds": args.rounds}
    (out / "document_masking.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                          indent=1))
    lines = ["# Document masking against unmasked training\n",
             f"`python bench/document_masking.py {' '.join(args.argv)}`: llama flavour, "
             f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads "
             f"({args.heads // 2} kv), fp32, {meta['threads']} thread(s), torch "
             f"{torch.__version__}, {os.cpu_count()} CPU cores, 1-minute load average "
             f"{load[0]:.1f} before and {load[1]:.1f} after. Fastest of {args.rounds} rounds.\n",
             "| T | mean document | documents | attention calls | step masked / unmasked "
             "| attention block-diagonal / causal | attention dense mask / causal "
             "| layout / step |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['seq']} | {r['mean_document']} | {r['documents']} | "
                     f"{r['attention_calls']} | {r['step_ratio']:.3f} | "
                     f"{r['attention_ratio']:.3f} | {r['dense_attention_ratio']:.3f} | "
                     f"{r['layout_share_of_step']:.4f} |")
    (out / "document_masking.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--mean-docs", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--quick", action="store_true", help="T=256, two settings, 1 round")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    if args.quick:
        args.seq, args.mean_docs, args.rounds = [256], [32, 1024], 1
    load_before = os.getloadavg()[0]
    rows = [setting(args, seq, mean) for seq in args.seq for mean in args.mean_docs]
    write(rows, args, (load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
