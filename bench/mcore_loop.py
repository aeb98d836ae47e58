"""Megatron-Core's GPTModel in a plain training loop on CPU: the third side of
bench/train_throughput.py. One process per tensor-parallel rank, gloo.

Mcore (megatron-core, a test dependency, not a megaresil one) is written for
CUDA; its own training loop (pretrain, DDP wrapper, optimizer) needs it. This
side is Mcore's model with the local (non-Transformer-Engine) layer spec, its
tensor-parallel layers, mappings and vocab-parallel cross-entropy, in a loop
with torch's fused AdamW and Mcore's clipping rule written in torch ops. The
model and the CPU shim it runs under (applied in this process only) are
tests/harness/mcore.py's, which the Megatron checkpoint tests build too: its
docstring lists the patches. A recipe with `model.moe` becomes Mcore's MoE
layer (`moe_config` there), with its "allgather" token dispatcher. At
`--dp`/`--ep`, the grads are reduced over Mcore's data-parallel and
expert-data-parallel groups as its DDP does (`sync_grads`). The causal mask
is an input (a bool (1, 1, T, T) tensor, as Megatron's own GPT data pipeline
builds it): Mcore's default mask is built with device="cuda".

Clipping: Mcore's clip_grads.py makes its norm buffers with device="cuda", so
the rule it implements is written here in torch ops: the sum of squared grad
norms of the parameters that are not tensor-parallel duplicates, all-reduced
over the TP group, clip coefficient max_norm / (norm + 1e-6) applied when < 1.

On CUDA (tools/gpu_check.py's Megatron-Core side of the ~1B Llama
throughput) there is no shim: the model lives on the GPU, its causal mask and
positions too, one process (tp=1, a one-rank NCCL group). Under bf16 (the
recipe's train.precision, as megaresil resolves it) the parameters are bf16
with fp32 main copies that AdamW steps, Megatron's mixed precision.

    python bench/mcore_loop.py SIZE --steps N [--tp 2 --rank R --port P]
    python bench/mcore_loop.py recipe --steps N [--tp T --dp D --ep E --rank R --port P]
        -- RECIPE [KEY=VALUE ...]
    (every rank prints {"step_s": median seconds per step, "peak_memory_mb": CUDA
    peak or null, "peak_rss_mb": ...} as its last line)
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_throughput import SIZES, WARMUP_STEPS, recipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # Mcore as the tests build it
from tests.harness.mcore import build_model, cpu_shim

FROM_RECIPE = "recipe"  # the size named by a recipe and overrides after `--`


def squares(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(grads)).square().sum()


def clip_grads(params: list[torch.nn.Parameter], main: list[torch.nn.Parameter],
               max_norm: float) -> None:
    """Mcore's get_grad_norm_fp32 + clip_grad_by_total_norm_fp32, in torch ops,
    on the main grads (`main[i]` is `params[i]`'s fp32 copy, or itself). The
    expert-parallel grads' squares are summed over the expert tensor x model
    group, as its chained optimizer does."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [q.grad for q in main if q.grad is not None]
    counted = [(getattr(p, "allreduce", True), q.grad) for p, q in zip(params, main)
               if q.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
    total = squares([g for dense, g in counted if dense])
    dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    expert = [g for dense, g in counted if not dense]
    if expert:
        expert_total = squares(expert)
        dist.all_reduce(expert_total,
                        group=parallel_state.get_expert_tensor_and_model_parallel_group())
        total += expert_total
    coeff = max_norm / (total.sqrt().item() + 1e-6)
    if coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


def micro_batch_loss(model, tokens, positions, causal_mask, tp: int) -> torch.Tensor:
    """Mean next-token loss. At tp=1, F.cross_entropy on the (B, T, V) logits
    Mcore returns (as the other sides; Mcore's own loss would be its
    vocab-parallel CE, slower on a whole vocabulary). At tp>1, Mcore's own
    path: labels in, its vocab-parallel CE on the [T, B, V/tp] logits, per-token
    losses (B, T) out."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if tp == 1:
        logits = model(inputs, positions, causal_mask)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return model(inputs, positions, causal_mask, labels=targets).mean()


class MainParams:
    """fp32 main copies of bf16 parameters, as Megatron's mixed precision
    keeps them: grads are copied up, AdamW steps the copies, the bf16 weights
    are refreshed from them. With fp32 parameters, the parameters themselves."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.mixed = any(p.dtype != torch.float32 for p in params)
        self.main = ([torch.nn.Parameter(p.detach().float()) for p in params] if self.mixed
                     else params)

    def grads_up(self) -> None:
        if self.mixed:
            for p, main in zip(self.params, self.main):
                main.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def weights_down(self) -> None:
        if self.mixed:
            torch._foreach_copy_(self.params, self.main)


def sync_grads(params: list[torch.nn.Parameter], dp: int) -> None:
    """Data parallelism as Mcore's DDP reduces: every grad divided by dp and
    summed in one flat buffer per group, the dense ones over the data-parallel
    group, the expert-parallel ones (Mcore marks them `allreduce=False`) over
    the expert-data-parallel group (their grads already hold the tokens of
    the whole expert-parallel group)."""
    from megatron.core import parallel_state

    dense = [p for p in params if getattr(p, "allreduce", True)]
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    for group, members in ((parallel_state.get_data_parallel_group(), dense),
                           (parallel_state.get_expert_data_parallel_group(), experts)):
        grads = [p.grad for p in members if p.grad is not None]
        if not grads or dist.get_world_size(group) == 1 and dp == 1:
            continue
        flat = torch.cat([g.flatten() for g in grads]).div_(dp)
        dist.all_reduce(flat, group=group)
        pieces = flat.split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(pieces, grads)])


def mcore_loop(cfg, steps: int, device: torch.device, tp: int = 1, ep: int = 1) -> list[float]:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    dp = dist.get_world_size() // tp
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    if device.type == "cuda":  # Mcore's GPU init draws inside its CUDA RNG tracker's fork
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(cfg.train.seed)
    model = build_model(cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    state = MainParams(params)
    o = cfg.optimizer
    groups = [{"params": [q for p, q in zip(params, state.main) if p.ndim >= 2],
               "weight_decay": o.weight_decay},
              {"params": [q for p, q in zip(params, state.main) if p.ndim < 2],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  fused=True)
    micro, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    accum = cfg.train.global_batch_size // (micro * dp)
    # The routing losses' grads are scaled as the main loss is (Mcore's schedule sets it).
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / accum, device=device))
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(micro, -1)
    causal_mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1).view(
        1, 1, seq, seq)
    # Same tokens on every TP rank, each data-parallel rank its own.
    generator = torch.Generator(device).manual_seed(parallel_state.get_data_parallel_rank())
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        for _ in range(accum):
            tokens = torch.randint(cfg.model.vocab_size, (micro, seq + 1), generator=generator,
                                   device=device)
            loss = micro_batch_loss(model, tokens, positions, causal_mask, tp) / accum
            loss.backward()
        sync_grads(params, dp)
        state.grads_up()
        clip_grads(params, state.main, o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        state.weights_down()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds


def peak_rss_mb() -> float:
    """This process's peak resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def recipe_of(args, recipe_args: list[str]):
    if args.size != FROM_RECIPE:
        return recipe(args.size, args.steps)
    from megaresil.config import load_recipe
    return load_recipe(recipe_args[0], recipe_args[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", choices=[*SIZES, FROM_RECIPE])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (divides dp)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    argv = sys.argv[1:]  # after `--`: the recipe and its overrides, megaresil's own syntax
    split = argv.index("--") if "--" in argv else len(argv)
    args, recipe_args = parser.parse_args(argv[:split]), argv[split + 1:]
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        cpu_shim()
    else:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.tp * args.dp)
    seconds = mcore_loop(recipe_of(args, recipe_args), args.steps, device, args.tp, args.ep)
    dist.destroy_process_group()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    print(json.dumps({"step_s": statistics.median(seconds[WARMUP_STEPS:]),
                      "peak_memory_mb": peak, "peak_rss_mb": peak_rss_mb()}), flush=True)


if __name__ == "__main__":
    main()
