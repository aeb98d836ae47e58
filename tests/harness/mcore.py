"""Megatron-Core on the CPU: its GPTModel at a megaresil recipe's shape, and
checkpoints it saves with its own `dist_checkpointing` into a directory
shaped as Megatron-LM's, with its logits on a fixed batch. What the Megatron
import and export are tested against; bench/mcore_loop.py builds the
throughput bench's Mcore side from here too.

megatron-core (0.16.1) is a test dependency (`make test` installs it with
`--no-deps`), never a runtime one; `missing_reason()` says why it cannot run.
It is written for CUDA; the CPU shim, applied in this process only, is the
smallest that runs it (two patches for the dense model, a third for the MoE
layer, a fourth for its checkpoint save):

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
3. `moe_utils.te_general_gemm = None` without Transformer Engine: the
   router's gating GEMM tests `te_general_gemm is not None`
   (moe_utils.py:1192), a name only its TE import defines, so without TE it
   raises NameError; None is the value that test means, and the router then
   runs its own torch.mm path.
4. `torch.cuda.synchronize` does nothing: dist_checkpointing's save copies
   the tensors to host memory without blocking and then synchronises the
   device (strategies/filesystem_async.py:230); on the CPU the copies are
   done when made, and there is no device to wait for.

Its optimizer (`optimizer_shim`, applied only in a process that trains with it)
needs three more, each where Mcore assumes a GPU rather than computes on one:

5. `Tensor.type()` without arguments names the CUDA type: the optimizers sort
   parameters into fp32 and fp16/bf16 groups by that name
   (distrib_optimizer.py:419, "torch.cuda.FloatTensor").
6. In the optimizer modules and utils' multi-tensor fallback, `torch.tensor`,
   `zeros`, `empty` and `ones` given `device="cuda"` make the tensor on the
   CPU (the found-inf flag, the unit loss scale, the norm's scratch:
   optimizer.py:473-485, clip_grads.py:90-207, utils.py:1207).
7. `Tensor.cuda()` returns the tensor (the gather of the optimizer state to
   model space copies its buffers to the device, distrib_optimizer.py:1089).

Not a patch: the causal mask is passed as an input (a bool (1, 1, T, T) tensor,
as Megatron's own GPT data pipeline builds it), because Mcore's default mask
(transformer/utils.py:35) is built with device="cuda".
"""
from __future__ import annotations

import argparse
import contextlib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaresil.config import load_recipe
from megaresil.model.layers import ffn_size
from megaresil.ports import free_port
from tests.harness.cli import ROOT

MCORE_VERSION = "0.16.1"


def missing_reason() -> Optional[str]:
    """Why Megatron-Core cannot run here (None when it can)."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        return (f"megatron-core is not installed ({err}); pip install --no-deps "
                f"megatron-core=={MCORE_VERSION}")
    return None


def cpu_shim() -> None:
    """The patches of the docstring, in this process only."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    torch.cuda.current_device = lambda: "cpu"
    no_fork = types.SimpleNamespace(fork=lambda *args, **kwargs: contextlib.nullcontext())
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: no_fork
    if not moe_utils.HAVE_TE:
        moe_utils.te_general_gemm = None
    torch.cuda.synchronize = lambda *args, **kwargs: None


def optimizer_shim() -> None:
    """The optimizer's patches of the docstring (5-7), in this process only
    (once: a second call leaves them as they are)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as plain_optimizer

    def on_the_cpu(make):
        def made(*args, **kwargs):
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)
        return made

    cpu_torch = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch)
                                         if not name.startswith("__")})
    for name in ("tensor", "zeros", "empty", "ones"):
        setattr(cpu_torch, name, on_the_cpu(getattr(torch, name)))
    if isinstance(utils.torch, types.SimpleNamespace):
        return
    for module in (plain_optimizer, clip_grads, distrib_optimizer, utils):
        module.torch = cpu_torch
    type_name = torch.Tensor.type
    torch.Tensor.type = lambda self, *args, **kwargs: (  # type: ignore[method-assign]
        type_name(self, *args, **kwargs) if args or kwargs
        else type_name(self).replace("torch.", "torch.cuda.", 1))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def moe_config(m) -> dict:
    """A recipe's `model.moe` in TransformerConfig's terms ({} for a dense
    model): the export's Megatron-LM args (`experts_args`: the logits tests
    hold that mapping to megaresil's model), under TransformerConfig's name
    for the expert count, with what only a running Mcore needs. The
    "allgather" token dispatcher (the "alltoall" one makes a CUDA stream for
    its device-to-host copies in its constructor, token_dispatcher.py:445);
    the local spec runs the experts as a SequentialMLP (one SwiGLU MLP per
    local expert, in a loop), since its grouped GEMM needs the CUDA-only
    grouped_gemm package."""
    from megaresil.checkpoint.megatron.writing import experts_args

    args = experts_args(m)
    if args["num_experts"] is None:
        return {}
    return {"num_moe_experts": args.pop("num_experts"), **args, "moe_router_dtype": "fp32", "moe_token_dispatcher_type": "allgather"}


def is_llama(cfg) -> bool:
    """Llama's form (RoPE, RMSNorm, SwiGLU): every flavour but gpt2."""
    return cfg.model.flavour.value != "gpt2"


def ties(cfg) -> bool:
    from megaresil.model.gpt import ties_embeddings

    return ties_embeddings(cfg.model)


def rope_scaling(m) -> dict:
    """Llama 3's RoPE scaling in GPTModel's and Megatron-LM's terms."""
    from megaresil.config.schema import RopeScalingType

    return {"rope_scaling": m.rope_scaling.type == RopeScalingType.llama3,
            "rope_scaling_factor": m.rope_scaling.factor}


def attention_extras(m) -> dict:
    """What qwen2 and qwen3 add to Llama's attention, in TransformerConfig's
    terms (Megatron-LM's args use the same names)."""
    from megaresil.config.flavours import MEGATRON
    from megaresil.config.schema import attention_head_dim

    form = MEGATRON[m.flavour]
    return {"add_qkv_bias": form.add_qkv_bias, "qk_layernorm": form.qk_layernorm,
            "kv_channels": attention_head_dim(m)}


def build_model(cfg, device: torch.device, padded_vocab: Optional[int] = None,
                pre_process: bool = True, post_process: bool = True):
    """megaresil's model shape in Mcore's GPTModel, local layer spec. gpt2:
    learned positions, LayerNorm, tanh GELU, biases, 4h MLP, tied embeddings.
    llama: RoPE, RMSNorm, SwiGLU, no biases, grouped-query attention, untied
    unless the recipe ties. No dropout; the recipe's precision (auto: fp32 on
    CPU, bf16 on CUDA). The vocabulary is padded to a multiple of
    make_vocab_size_divisible_by unless `padded_vocab` says otherwise;
    `pre_process`/`post_process`: this pipeline stage holds the embedding /
    the output layer."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megaresil.config import Precision
    from megaresil.train.precision import resolve

    m = cfg.model
    bf16 = resolve(cfg.train.precision, device) == Precision.bf16  # as megaresil reads it
    flavour = dict(
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, num_query_groups=m.num_kv_heads or m.num_heads,
        ffn_hidden_size=ffn_size(m), **attention_extras(m),
    ) if is_llama(cfg) else dict(
        normalization="LayerNorm", add_bias_linear=True, ffn_hidden_size=4 * m.hidden_size,
        activation_func=lambda x: F.gelu(x, approximate="tanh"))
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
        hidden_dropout=m.dropout, attention_dropout=m.attention_dropout,
        layernorm_epsilon=m.norm_eps, init_method_std=m.init_std,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        use_cpu_initialization=device.type == "cpu", bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        # CUDA-only fusions off (each is a custom kernel; the unfused path is torch ops).
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        **flavour, **moe_config(m))
    if padded_vocab is None:
        multiple = m.make_vocab_size_divisible_by
        padded_vocab = -(-m.vocab_size // multiple) * multiple
    spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization=config.normalization)
            if m.moe.num_experts else
            get_gpt_layer_local_spec(normalization=config.normalization,
                                     qk_layernorm=config.qk_layernorm))
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=padded_vocab, max_sequence_length=m.max_seq_len,
                     pre_process=pre_process, post_process=post_process,
                     share_embeddings_and_output_weights=ties(cfg),
                     position_embedding_type="rope" if is_llama(cfg) else "learned_absolute",
                     rotary_base=int(m.rope_theta), **rope_scaling(m))
    return model.to(device)


# --- checkpoints saved by Megatron-Core, shaped as Megatron-LM's ---------------------

ITERATION = 7  # the saved checkpoints' iteration (Megatron-LM's step)
RECIPE = ROOT / "recipes" / "gpt-tiny.yaml"
# Tiny models: two layers (one per stage at pp=2), a vocabulary that Megatron
# pads (300 -> 384 at tp=1, 512 at tp=2), 4 heads of 16 with 2 query groups.
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
        "model.vocab_size=300", "model.max_seq_len=32", "data.seq_len=16",
        "data.source=synthetic", "model.dropout=0.0", "model.attention_dropout=0.0"]
FLAVOURS = {"gpt2": ["model.flavour=gpt2"],
            "llama": ["model.flavour=llama", "model.num_kv_heads=2",
                      "model.ffn_hidden_size=96", "model.rope_theta=10000"]}
# Llama's with experts: a dense first layer, then 4 experts (top-2) and a shared expert.
FLAVOURS["moe"] = FLAVOURS["llama"] + [
    "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.first_dense_layers=1",
    "model.moe.shared_expert_hidden_size=32"]
# Aux-loss-free balancing: sigmoid scores with an expert bias (random in a save).
FLAVOURS["moebias"] = FLAVOURS["moe"] + ["model.moe.score_function=sigmoid",
                                         "model.moe.bias_update_rate=0.001"]
# Qwen2: q/k/v biases. Qwen3: each head's queries and keys normalised, heads
# 32 wide (4 x 32 > hidden 64). Qwen3-MoE: Qwen3's attention, 4 experts in each layer.
FLAVOURS["qwen2"] = ["model.flavour=qwen2", *FLAVOURS["llama"][1:]]
FLAVOURS["qwen3"] = ["model.flavour=qwen3", *FLAVOURS["llama"][1:], "model.head_dim=32"]
# Llama 3's RoPE scaling (Mcore's fixed low/high factors and original length).
FLAVOURS["llama3"] = FLAVOURS["llama"] + ["model.rope_scaling.type=llama3",
                                          "model.rope_scaling.factor=8"]
FLAVOURS["mistral"] = ["model.flavour=mistral", *FLAVOURS["llama"][1:]]
FLAVOURS["mixtral"] = ["model.flavour=mixtral", *FLAVOURS["llama"][1:],
                       "model.moe.num_experts=4", "model.moe.top_k=2"]
FLAVOURS["qwen3moe"] = ["model.flavour=qwen3_moe", *FLAVOURS["qwen3"][1:],
                        "model.moe.num_experts=4", "model.moe.top_k=2",
                        "model.moe.expert_ffn_hidden_size=48"]
BATCH, SEQ = 2, 16


@dataclass(frozen=True)
class Saved:
    """One Megatron-Core checkpoint to save: a flavour (a key of FLAVOURS)
    at tp x pp, and ep for experts."""
    flavour: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    # With its distributed optimizer's state, after TRAINED_STEPS, in this format.
    optimizer: Optional[str] = None

    @property
    def name(self) -> str:
        return (f"{self.flavour}-tp{self.tp}-pp{self.pp}" + (f"-ep{self.ep}" if self.ep > 1 else "")
                + (f"-{self.optimizer}" if self.optimizer else ""))

    def recipe(self):
        return load_recipe(RECIPE, TINY + FLAVOURS[self.flavour])


def megatron_padded_vocab(cfg, tp: int) -> int:
    """Megatron-LM's padded_vocab_size: a multiple of divisible_by x tp."""
    multiple = cfg.model.make_vocab_size_divisible_by * tp
    return -(-cfg.model.vocab_size // multiple) * multiple


def megatron_args(cfg, tp: int, pp: int) -> argparse.Namespace:
    """The fields of Megatron-LM's `args` (megatron/training/arguments.py)
    that say the model's shape, as its save_checkpoint stores the whole
    Namespace in the common state, with the run's parallelism and
    tokenizer."""
    m, llama = cfg.model, is_llama(cfg)
    heads = m.num_heads
    experts = {key.replace("num_moe_experts", "num_experts"): value  # Megatron-LM's name
               for key, value in moe_config(m).items()}
    return argparse.Namespace(
        **experts,
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=heads,
        group_query_attention=llama, num_query_groups=(m.num_kv_heads or heads) if llama else 1,
        **(attention_extras(m) if llama else {"kv_channels": m.hidden_size // heads,
                                              "add_qkv_bias": False, "qk_layernorm": False}),
        ffn_hidden_size=ffn_size(m) if llama else 4 * m.hidden_size, swiglu=llama,
        normalization="RMSNorm" if llama else "LayerNorm", norm_epsilon=m.norm_eps,
        position_embedding_type="rope" if llama else "learned_absolute",
        add_position_embedding=not llama, rotary_base=int(m.rope_theta), rotary_percent=1.0,
        use_rope_scaling=rope_scaling(m)["rope_scaling"],
        rope_scaling_factor=rope_scaling(m)["rope_scaling_factor"],
        max_position_embeddings=m.max_seq_len, seq_length=cfg.data.seq_len,
        untie_embeddings_and_output_weights=not ties(cfg), add_bias_linear=not llama,
        openai_gelu=not llama,
        vocab_size=m.vocab_size, padded_vocab_size=megatron_padded_vocab(cfg, tp),
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        tokenizer_type="NullTokenizer", tokenizer_model=None, init_method_std=m.init_std,
        hidden_dropout=m.dropout, attention_dropout=m.attention_dropout,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        ckpt_format="torch_dist", use_dist_ckpt=True, params_dtype=torch.float32,
        bf16=False, fp16=False, iteration=ITERATION, consumed_train_samples=0)


def save_megatron_lm(model, args: argparse.Namespace, save_dir: Path,
                     iteration: int = ITERATION, optimizer=None,
                     sharding: Optional[str] = None) -> Path:
    """The model saved with Mcore's own dist_checkpointing.save (torch_dist)
    as Megatron-LM's save_checkpoint lays it out: `iter_NNNNNNN/` with the
    model's sharded state under "model" and args, checkpoint_version and
    iteration beside it (the common state, common.pt), then
    latest_checkpointed_iteration.txt; with `optimizer`, its sharded state
    under "optimizer" in the distributed optimizer's `sharding` format
    (Megatron-LM's --dist-ckpt-optim-fully-reshardable: "fully_reshardable",
    else "dp_reshardable"). Every rank calls it."""
    from megatron.core import dist_checkpointing

    iteration_dir = save_dir / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        iteration_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0,
             "iteration": iteration, "num_floating_point_operations_so_far": 0}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            state["model"], metadata={"distrib_optim_sharding_type": sharding})
    dist_checkpointing.save(state, str(iteration_dir))
    if dist.get_rank() == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()
    return save_dir


def fixed_tokens(cfg) -> torch.Tensor:
    return torch.randint(cfg.model.vocab_size, (BATCH, SEQ),
                         generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def stage_logits(model, cfg, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """The whole model's logits (B, T, padded vocab) on `tokens`, on the last
    pipeline stage's tensor-parallel rank 0 (None elsewhere): a stage
    receives the previous one's hidden states, tensor-parallel logits are
    gathered."""
    from megatron.core import parallel_state as ps

    model.eval()
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)
    tp = ps.get_tensor_model_parallel_world_size()
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(SEQ, BATCH, cfg.model.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(tokens, positions, mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    pieces = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(pieces, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=-1) if ps.get_tensor_model_parallel_rank() == 0 else None


TRAINED_STEPS = 2  # Adam's step count in a save with optimizer state (its iteration: ITERATION)


def trained(model, cfg):
    """Mcore's distributed optimizer (AdamW, ZeRO over the data-parallel
    ranks, no clipping) after TRAINED_STEPS steps of `model` on
    `fixed_tokens`, each rank on the same batch (pipeline parallelism aside)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer_shim()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.1, use_distributed_optimizer=True,
        bf16=False, fp16=False, clip_grad=0.0), [ddp])
    tokens = fixed_tokens(cfg)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)
    for _ in range(TRAINED_STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ddp(tokens, positions, mask, labels=tokens.roll(-1, 1)).float().mean().backward()
        ddp.finish_grad_sync()
        optimizer.step()
    return optimizer


@torch.no_grad()
def moment_as_weights(model, optimizer, moment: str) -> None:
    """Each parameter of `model` overwritten with its `moment` as Mcore's
    optimizer gives it in model space: saved as a model, a checkpoint whose
    weights are where Mcore itself puts each parameter's moment."""
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    model_state = model.sharded_state_dict()
    params = {_where(sharded, ""): sharded.data
              for sharded in extract_sharded_tensors_and_factories(model_state)[0].values()}
    state = optimizer.sharded_state_dict(
        model_state, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    for tensors in state["param_state"].values():
        params[_where(tensors[moment], f"optimizer.state.{moment}.")].copy_(tensors[moment].data)


def _where(sharded, key_prefix: str) -> tuple:
    """Which parameter a sharded tensor (or the factory of a SwiGLU fc1) is
    of: a stacked key names every layer's, told apart by the offset (by the
    factory's build function, which holds it and which the optimizer's copy keeps)."""
    offset = getattr(sharded, "global_offset", None)
    return (sharded.key.removeprefix(key_prefix),
            offset if offset is not None else id(sharded.build_fn))


@torch.no_grad()
def _random_expert_biases(model) -> None:
    """Every expert bias of `model` drawn at random (seeded): a fresh one is
    zero, which would not show where an import puts it."""
    draw = torch.Generator().manual_seed(3)
    for name, buffer in model.named_buffers():
        if name.endswith("expert_bias"):
            buffer.copy_(0.5 * torch.randn(buffer.shape, generator=draw))


def _save_one(saved: Saved, out: Path) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(saved.tp, saved.pp, expert_model_parallel_size=saved.ep)
    try:
        cfg = saved.recipe()
        torch.manual_seed(0)
        model = build_model(cfg, torch.device("cpu"), megatron_padded_vocab(cfg, saved.tp),
                            pre_process=ps.is_pipeline_first_stage(),
                            post_process=ps.is_pipeline_last_stage())
        _random_expert_biases(model)
        optimizer = trained(model, cfg) if saved.optimizer else None
        args = megatron_args(cfg, saved.tp, saved.pp)
        save_megatron_lm(model, args, out / saved.name, optimizer=optimizer,
                         sharding=saved.optimizer)
        logits = stage_logits(model, cfg, fixed_tokens(cfg))
        if logits is not None:
            torch.save(logits, out / saved.name / "logits.pt")
        if saved.optimizer == "fully_reshardable":
            for moment in ("exp_avg", "exp_avg_sq"):
                moment_as_weights(model, optimizer, moment)
                save_megatron_lm(model, args, out / saved.name / moment)
        dist.barrier()
    finally:
        ps.destroy_model_parallel()


def _worker(rank: int, world: int, port: int, saves: list[Saved], out: str) -> None:
    from tests.harness.dist import join_group

    join_group(rank, world, port)
    cpu_shim()
    try:
        for saved in saves:
            _save_one(saved, Path(out))
    finally:
        dist.destroy_process_group()


WORLD = 2  # every save runs in one 2-rank group: tp=2, pp=2, or tp=1 at dp=2


def save_checkpoints(saves: list[Saved], out: Path) -> dict[str, Path]:
    """Save each of `saves` with Megatron-Core (in one spawned 2-rank
    group); returns each save directory by name. Each holds
    `latest_checkpointed_iteration.txt`, `iter_0000007/` and `logits.pt`
    (the model's logits on `fixed_tokens`, padded vocabulary)."""
    from tests.harness.dist import spawn_ranks

    assert all(WORLD % (s.tp * s.pp) == 0 and WORLD % s.ep == 0 for s in saves)
    spawn_ranks(_worker, (WORLD, free_port(), saves, str(out)), WORLD)
    return {s.name: out / s.name for s in saves}
