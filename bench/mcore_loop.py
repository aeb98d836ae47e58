"""Megatron-Core's GPTModel in a plain training loop on CPU: the third side of
bench/train_throughput.py. One process per tensor-parallel rank, gloo.

Mcore (megatron-core, bench-only, not a megaresil dependency) is written for
CUDA; its own training loop (pretrain, DDP wrapper, optimizer) needs it. This
side is Mcore's model with the local (non-Transformer-Engine) layer spec, its
tensor-parallel layers, mappings and vocab-parallel cross-entropy, in a loop
with torch's fused AdamW and Mcore's clipping rule written in torch ops. The
CPU shim, applied in this process only, is the smallest that runs it:

1. `torch.cuda.current_device` returns "cpu": Mcore allocates its scratch and
   communication buffers with `device=torch.cuda.current_device()` (the
   attention's score buffer from the global memory buffer,
   dot_product_attention.py:189 via utils.py:631; the TP all-gather/
   reduce-scatter outputs in tensor_parallel/mappings.py). The buffers are
   the same, only on the CPU.
2. `tensor_parallel.get_cuda_rng_tracker` returns a tracker whose `fork()`
   does nothing: the attention forks the CUDA RNG around its probability
   dropout (dot_product_attention.py:217) by reading and setting the CUDA
   generator's state. Dropout is 0 in these sizes, so no random number is drawn
   inside the fork; the fork would only move CUDA RNG state that does not exist.

Not a patch: the causal mask is passed as an input (a bool (1, 1, T, T) tensor,
as Megatron's own GPT data pipeline builds it), because Mcore's default mask
(transformer/utils.py:35) is built with device="cuda".

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
    python bench/mcore_loop.py recipe --steps N [--port P] -- RECIPE [KEY=VALUE ...]
    (rank 0 prints {"step_s": median seconds per step, "peak_memory_mb": ...}
    as its last line)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from train_throughput import SIZES, WARMUP_STEPS, recipe

FROM_RECIPE = "recipe"  # the size named by a recipe and overrides after `--`


def cpu_shim() -> None:
    """The two patches of the docstring, in this process only."""
    from megatron.core import tensor_parallel
    torch.cuda.current_device = lambda: "cpu"
    no_fork = types.SimpleNamespace(fork=lambda *args, **kwargs: contextlib.nullcontext())
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: no_fork


def build_model(cfg, device: torch.device):
    """megaresil's model shape in Mcore's GPTModel, local layer spec. gpt2:
    learned positions, LayerNorm, tanh GELU, biases, 4h MLP, tied embeddings.
    llama: RoPE, RMSNorm, SwiGLU, no biases, grouped-query attention, untied
    unless the recipe ties. No dropout; the recipe's precision (auto: fp32 on
    CPU, bf16 on CUDA)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megaresil.config import Precision
    from megaresil.train.precision import resolve

    m = cfg.model
    llama = m.flavour.value == "llama"
    bf16 = resolve(cfg.train.precision, device) == Precision.bf16  # as megaresil reads it
    flavour = dict(
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, num_query_groups=m.num_kv_heads or m.num_heads,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
    ) if llama else dict(
        normalization="LayerNorm", add_bias_linear=True, ffn_hidden_size=4 * m.hidden_size,
        activation_func=lambda x: F.gelu(x, approximate="tanh"))
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
        hidden_dropout=m.dropout, attention_dropout=m.attention_dropout,
        layernorm_epsilon=m.norm_eps, init_method_std=m.init_std,
        tensor_model_parallel_size=dist.get_world_size(),
        use_cpu_initialization=device.type == "cpu", bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        # CUDA-only fusions off (each is a custom kernel; the unfused path is torch ops).
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        **flavour)
    tied = m.tie_embeddings if m.tie_embeddings is not None else not llama
    padded_vocab = -(-m.vocab_size // m.make_vocab_size_divisible_by) * m.make_vocab_size_divisible_by
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                         normalization=config.normalization),
                     vocab_size=padded_vocab, max_sequence_length=m.max_seq_len,
                     share_embeddings_and_output_weights=tied,
                     position_embedding_type="rope" if llama else "learned_absolute",
                     rotary_base=int(m.rope_theta))
    return model.to(device)


def clip_grads(params: list[torch.nn.Parameter], main: list[torch.nn.Parameter],
               max_norm: float) -> None:
    """Mcore's get_grad_norm_fp32 + clip_grad_by_total_norm_fp32, in torch ops,
    on the main grads (`main[i]` is `params[i]`'s fp32 copy, or itself)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [q.grad for q in main if q.grad is not None]
    counted = [q.grad for p, q in zip(params, main) if q.grad is not None
               and param_is_not_tensor_parallel_duplicate(p)]
    total = torch.stack(torch._foreach_norm(counted)).square().sum()
    dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
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


def mcore_loop(cfg, steps: int, device: torch.device) -> list[float]:
    from megatron.core import parallel_state

    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tp, 1)
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
    accum = cfg.train.global_batch_size // micro
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(micro, -1)
    causal_mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1).view(
        1, 1, seq, seq)
    generator = torch.Generator(device).manual_seed(0)  # same tokens on every TP rank
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        for _ in range(accum):
            tokens = torch.randint(cfg.model.vocab_size, (micro, seq + 1), generator=generator,
                                   device=device)
            loss = micro_batch_loss(model, tokens, positions, causal_mask, tp) / accum
            loss.backward()
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
                            rank=args.rank, world_size=args.tp)
    seconds = mcore_loop(recipe_of(args, recipe_args), args.steps, device)
    dist.destroy_process_group()
    if args.rank == 0:
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
        print(json.dumps({"step_s": statistics.median(seconds[WARMUP_STEPS:]),
                          "peak_memory_mb": peak}), flush=True)


if __name__ == "__main__":
    main()
