"""Measure `megaresil generate`'s token loop: the old one, which reran the
whole window (the last max_seq_len tokens) for every new token, against
today's KV cache (megaresil/generation.py), side by side in one run.

The models are gpt-tiny's shapes (gpt2 flavour, 4 layers, hidden 192, 6
heads) at its own vocabulary (4096) and at GPT-2's (50257, whose output
head is most of a cached step), both with a context of 512, randomly
initialised, in one process, fp32, greedy. The old loop is kept here, a copy of the one
generate ran before (inference.continue_tokens), as the baseline. Each
variant continues the same prompt by --new-tokens tokens, alternating in
rounds so a busy spell of the shared machine hits both; a batch of
--batch prompts through the cache is timed as well (tokens/s counts every
row's tokens). The tokens of both loops are compared: they must be equal.
A third row reads the model's weights as one cached token does (every
linear layer's and the head's, in order, on one token) and nothing else:
the memory traffic no fp32 cached loop avoids, so full window / that row
bounds the speed-up any cached loop reaches here.

    python bench/generate.py [--new-tokens 300] [--rounds 2] [--batch 8] [--threads 1]
        [--checkpoint CKPT] [--out bench/results]

With --checkpoint, generate's start-up too: a fresh process that imports
megaresil.inference and loads CKPT's model at tp=1, as a whole Trainer (what
generate and eval built before) against inference_model.load_model (what
they build now), alternating, --rounds each.

One thread by default: on a shared 2-core machine a second OpenMP thread
spins against the other processes and makes every small kernel ~10x slower,
whichever loop runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from megaresil.config import Flavour, ModelConfig
from megaresil.generation import Sampling, continue_batch
from megaresil.model.gpt import GPT
from megaresil.model.init import materialize

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results"
PROMPT_TOKENS = 16
VOCABULARIES = (4096, 50257)  # gpt-tiny's own; GPT-2's


@torch.no_grad()
def full_window_loop(model: GPT, prompt: list[int], context: int, new: int) -> list[int]:
    """The baseline: generate's loop before the cache, greedy."""
    tokens = list(prompt)
    for _ in range(new):
        logits = model.logits(torch.tensor([tokens[-context:]]))[0, -1].float()
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@torch.inference_mode()
def weights_read(model: GPT, new: int) -> list:
    """The floor: per token, every linear layer and the head on one token."""
    embedding = set(model.embed.modules())
    weights = [(m.weight, getattr(m, "bias", None)) for m in model.modules()
               if m not in embedding and getattr(m, "weight", None) is not None
               and m.weight.dim() == 2]  # the blocks' linear layers, and an untied head
    if model.head is None:  # tied: the head reads the embedding
        weights.append((model.embed.tokens.weight, None))
    inputs = [torch.randn(1, 1, w.shape[1]) for w, _ in weights]
    for _ in range(new):
        for (weight, bias), x in zip(weights, inputs):
            torch.nn.functional.linear(x, weight, bias)
    return []


def timed(run) -> tuple[float, list]:
    started = time.perf_counter()
    out = run()
    return time.perf_counter() - started, out


def measure(args: argparse.Namespace, vocab: int) -> dict:
    cfg = ModelConfig(flavour=Flavour.gpt2, num_layers=4, hidden_size=192, num_heads=6,
                      vocab_size=vocab, max_seq_len=512)
    with torch.device("meta"):
        model = GPT(cfg)
    model = materialize(model, cfg, 0, torch.device("cpu")).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, PROMPT_TOKENS),
                            generator=generator).tolist()
    times: dict[str, list[float]] = {"full_window": [], "kv_cache": [], "kv_cache_batch": [],
                                     "weights_read": []}
    outputs: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, run in (
                ("full_window", lambda: [full_window_loop(model, prompts[0], cfg.max_seq_len,
                                                          args.new_tokens)]),
                ("kv_cache", lambda: continue_batch(model, prompts[:1], cfg.max_seq_len,
                                                    args.new_tokens, Sampling())),
                ("kv_cache_batch", lambda: continue_batch(model, prompts, cfg.max_seq_len,
                                                          args.new_tokens, Sampling())),
                ("weights_read", lambda: weights_read(model, args.new_tokens))):
            seconds, outputs[name] = timed(run)
            times[name].append(seconds)
    best = {name: min(values) for name, values in times.items()}
    rows = {"full_window": 1, "kv_cache": 1, "kv_cache_batch": args.batch, "weights_read": 1}
    return {
        "model": f"gpt-tiny shapes (gpt2, 4 layers, hidden 192, 6 heads), vocab {vocab}, "
                 "max_seq_len 512, fp32, random weights",
        "parameters": sum(p.numel() for p in model.parameters()),
        "prompt_tokens": PROMPT_TOKENS, "new_tokens": args.new_tokens, "batch": args.batch,
        "rounds": args.rounds, "threads": torch.get_num_threads(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "seconds": times, "best_seconds": best,
        "tokens_per_s": {name: rows[name] * args.new_tokens / best[name] for name in best},
        "speedup_kv_cache": best["full_window"] / best["kv_cache"],
        "speedup_bound": best["full_window"] / best["weights_read"],
        "tokens_equal": outputs["full_window"][0] == outputs["kv_cache"][0]
                        and outputs["kv_cache_batch"][0] == outputs["kv_cache"][0],
    }


def startup_seconds(kind: str, checkpoint: str) -> float:
    """Wall time of a fresh process loading the checkpoint's model as `kind`."""
    started = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--startup-of", kind, "--checkpoint", checkpoint],
                   check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return time.perf_counter() - started


def load_once(kind: str, checkpoint: str) -> None:
    from megaresil.inference import Use, run_on_model

    if kind == "model":
        run_on_model(Path(checkpoint), 1, Use(eval_batches=0), lambda loaded, ckpt, step: {})
        return
    # The baseline: the whole Trainer that eval and generate built before.
    import tempfile

    from megaresil.checkpoint.validation import read_manifest
    from megaresil.config import from_dict
    from megaresil.inference import inference_recipe
    from megaresil.parallel.layout import ParallelLayout, pick_device
    from megaresil.train.loop import Trainer

    recipe = from_dict(read_manifest(Path(checkpoint))["recipe"])
    with tempfile.TemporaryDirectory() as scratch:
        cfg = inference_recipe(recipe, Use(eval_batches=0), Path(scratch), Path(checkpoint), 1)
        Trainer(cfg, ParallelLayout.from_config(cfg.parallel, pick_device())).close()


def startup(args: argparse.Namespace) -> dict:
    times: dict[str, list[float]] = {"trainer": [], "model": []}
    for _ in range(args.rounds):
        for kind in times:
            times[kind].append(startup_seconds(kind, args.checkpoint))
    best = {kind: min(values) for kind, values in times.items()}
    return {"checkpoint": args.checkpoint, "seconds": times, "best_seconds": best,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            "ratio_model_to_trainer": best["model"] / best["trainer"]}


def startup_markdown(result: dict) -> str:
    best = result["best_seconds"]
    return (f"Start-up, a fresh process loading {result['checkpoint']} at tp=1 (best of "
            f"{len(result['seconds']['model'])}, load {' '.join(result['loadavg'])} at the "
            f"end): whole Trainer {best['trainer']:.2f} s, model alone {best['model']:.2f} s "
            f"({result['ratio_model_to_trainer']:.2f}x).\n")


def markdown(result: dict) -> str:
    lines = [f"Model: {result['model']}, {result['parameters'] / 1e6:.1f}M parameters; "
             f"prompt {result['prompt_tokens']} tokens, {result['new_tokens']} new, greedy; "
             f"best of {result['rounds']} rounds, {result['threads']} threads, load "
             f"{' '.join(result['loadavg'])} at the end.", "",
             "| loop | rows | wall s | tokens/s |", "| --- | --- | --- | --- |"]
    rows = {"full_window": 1, "kv_cache": 1, "kv_cache_batch": result["batch"], "weights_read": 1}
    for name, seconds in result["best_seconds"].items():
        lines.append(f"| {name} | {rows[name]} | {seconds:.2f} | "
                     f"{result['tokens_per_s'][name]:.1f} |")
    lines += ["", f"KV cache against the full window: {result['speedup_kv_cache']:.1f}x "
              f"(reading the weights alone: {result['speedup_bound']:.1f}x); "
              f"tokens equal: {result['tokens_equal']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--checkpoint", help="also time generate's start-up on this checkpoint")
    parser.add_argument("--startup-of", choices=("trainer", "model"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.startup_of:  # one start-up, in its own process
        load_once(args.startup_of, args.checkpoint)
        return
    torch.set_num_threads(args.threads)
    results = [measure(args, vocab) for vocab in VOCABULARIES]
    report = "\n".join(markdown(result) for result in results)
    summary: dict = {"generation": results}
    if args.checkpoint:
        summary["startup"] = startup(args)
        report += "\n" + startup_markdown(summary["startup"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generate.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "generate.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
