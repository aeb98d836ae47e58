"""Transformer Engine backend (`model.backend=te`): TE's fused modules in place
of the local layers, with the layout's TP group and sequence parallelism, and
FP8 (`train.fp8=hybrid`).

`convert` swaps a built, initialised local model's layers for TE modules that
hold the same local shard and marks; the converted blocks run on (T, B, C)
(`GPT.blocks_layout` transposes around them). `local_key` / `te_key` map TE's
parameter names to the local backend's, so checkpoints keep the local keys.
Written against TE's documented API and untested until a CUDA machine with TE
runs `pytest -m gpu`. `import transformer_engine` without CUDA raises
RuntimeError, not ImportError, hence the broad except. See docs/gpu.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional, Protocol, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaresil.config import ConfigError
from megaresil.model.flavours import FLAVOURS, spec_of_model
from megaresil.model.flavours.base import FlavourSpec
from megaresil.model.gpt import GPT
from megaresil.model.layers import Attention, Block, split_heads
from megaresil.model.masks import Documents
from megaresil.model.mlp import GeluMLP, SwiGLUMLP
from megaresil.parallel.sharding import ShardSpec, carry_spec, has_spec, set_spec, spec_of
from megaresil.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    swap_batch_and_sequence,
)

_IMPORT_ERROR: Optional[str] = None
try:
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format
except Exception as err:  # noqa: BLE001 (ImportError, or RuntimeError without CUDA)
    te = None
    _IMPORT_ERROR = f"{type(err).__name__}: {err}"

# A module TE builds: transformer_engine ships no types (pyproject.toml's mypy
# overrides), so the parameters it names (layer_norm_weight, fc1_weight, ...) are unchecked.
TEModule = Any


def available() -> bool:
    return te is not None


def import_error() -> Optional[str]:
    return _IMPORT_ERROR


def require() -> None:
    """A recipe error, not a failure: no restart installs Transformer Engine."""
    if te is None:
        raise ConfigError("model.backend", f"te needs NVIDIA Transformer Engine on a CUDA "
                          f"machine ({_IMPORT_ERROR}).", "pip install 'megaresil[gpu]' there, "
                          "or use model.backend=local.")


def device_context(device: torch.device):
    """Where TE creates its parameters (its default is the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _carry(old: torch.Tensor, new: torch.Tensor) -> None:
    """Same values and the `ShardSpec` the parallel code and checkpoints read."""
    with torch.no_grad():
        new.copy_(old)
    carry_spec(old, new)


# --- names: TE's fused modules <-> the local backend's keys ------------------------

# (local suffix, TE suffix) inside `layers.<i>.`, per flavour name (each
# flavour spec's te_names); a key not listed is the same in both.
_BLOCK_NAMES = {flavour.value: spec.te_names for flavour, spec in FLAVOURS.items()}


def _split_block_key(key: str) -> tuple[str, str]:
    """("layers.<i>.", rest) for a block's key, ("", key) otherwise."""
    parts = key.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        return f"layers.{parts[1]}.", parts[2]
    return "", key


def _rename(key: str, flavour: str, *, to_te: bool) -> str:
    prefix, rest = _split_block_key(key)
    if prefix:
        for local, fused in _BLOCK_NAMES[flavour]:
            src, dst = (local, fused) if to_te else (fused, local)
            if rest == src:
                return prefix + dst
    return key


def te_key(key: str, flavour: str) -> str:
    """The name a local-backend parameter key has in the TE model."""
    return _rename(key, flavour, to_te=True)


def local_key(key: str, flavour: str) -> str:
    """The local-backend key (the checkpoint's) of a TE model's parameter name."""
    return _rename(key, flavour, to_te=False)


# --- modules -------------------------------------------------------------------------


class _Norm(Protocol):
    """What TE takes of a flavour's norm (FlavourSpec.make_norm's module, typed
    nn.Module there), besides its bias where it has one."""
    weight: torch.Tensor
    eps: Optional[float]


def _parallel(tp: TPGroup, mode: str) -> dict:
    """TE's tensor-parallel arguments for a layer cut `mode`-wise over `tp`."""
    if not tp.active:
        return {}
    return dict(parallel_mode=mode, tp_group=tp.group, tp_size=tp.size,
                sequence_parallel=tp.sequence_parallel)


def _copy_norm(norm: _Norm, module: TEModule) -> None:
    _carry(norm.weight, module.layer_norm_weight)
    bias = getattr(norm, "bias", None)
    if bias is not None:
        _carry(bias, module.layer_norm_bias)


def _te_row_linear(layer: RowParallelLinear, tp: TPGroup, device: torch.device) -> TEModule:
    """TE Linear holding the same local shard as a RowParallelLinear."""
    out_features, local_in = layer.weight.shape
    linear = te.Linear(local_in * tp.size, out_features, bias=layer.bias is not None,
                       params_dtype=layer.weight.dtype, device=device, **_parallel(tp, "row"))
    _carry(layer.weight, linear.weight)
    if layer.bias is not None:
        _carry(layer.bias, linear.bias)
    return linear


def _te_norm_linear(norm: _Norm, normalization: str, weight: torch.Tensor, bias: bool,
                    tp: TPGroup, device: torch.device, **split: Any) -> TEModule:
    """`norm` (TE's `normalization`) then a column-parallel linear whose local
    weight is shaped as `weight`, fused (the norm's values copied); `split`:
    TE's parameters_split."""
    rows, in_features = weight.shape
    fused = te.LayerNormLinear(in_features, rows * tp.size, eps=norm.eps, bias=bias,
                               normalization=normalization, params_dtype=weight.dtype,
                               device=device, **_parallel(tp, "column"), **split)
    _copy_norm(norm, fused)
    return fused


def _fuse_norm_qkv(norm: _Norm, normalization: str, qkv: ColumnParallelLinear, tp: TPGroup,
                   device: torch.device) -> TEModule:
    fused = _te_norm_linear(norm, normalization, qkv.weight, qkv.bias is not None, tp, device)
    _carry(qkv.weight, fused.weight)
    if qkv.bias is not None:
        _carry(qkv.bias, fused.bias)
    return fused


def _te_norm(norm: _Norm, normalization: str, device: torch.device) -> TEModule:
    """TE's module of that name (te.LayerNorm, te.RMSNorm) holding `norm`'s values."""
    module = getattr(te, normalization)
    new = module(norm.weight.shape[0], eps=norm.eps, params_dtype=norm.weight.dtype, device=device)
    bias = getattr(norm, "bias", None)
    if bias is not None:
        _carry(bias, new.bias)
    _carry(norm.weight, new.weight)
    return new


class FusedGeluMLP(nn.Module):
    """GPT-2's norm2 + MLP as one TE LayerNormMLP (gelu: TE's tanh form, GPT-2's gelu_new)."""

    def __init__(self, norm: _Norm, normalization: str, mlp: GeluMLP, tp: TPGroup,
                 device: torch.device):
        super().__init__()
        ffn_local, hidden = mlp.fc.weight.shape
        self.fused = te.LayerNormMLP(hidden, ffn_local * tp.size, eps=norm.eps, bias=True,
                                     normalization=normalization, activation="gelu",
                                     params_dtype=mlp.fc.weight.dtype, device=device,
                                     **({"tp_group": tp.group, "tp_size": tp.size,
                                         "set_parallel_mode": True,
                                         "sequence_parallel": tp.sequence_parallel}
                                        if tp.active else {}))
        _copy_norm(norm, self.fused)
        local: ColumnParallelLinear | RowParallelLinear
        for local, name in ((mlp.fc, "fc1"), (mlp.proj, "fc2")):
            assert local.bias is not None  # GeluMLP's linears have biases
            _carry(local.weight, getattr(self.fused, f"{name}_weight"))
            _carry(local.bias, getattr(self.fused, f"{name}_bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)


class FusedSwiGLUMLP(nn.Module):
    """Llama's norm2 + gate/up projections as one TE LayerNormLinear, then down."""

    def __init__(self, norm: _Norm, normalization: str, mlp: SwiGLUMLP, tp: TPGroup,
                 device: torch.device):
        super().__init__()
        # Local weight [gate rows; up rows], exposed as two Parameters.
        stacked = torch.empty(2 * mlp.gate.weight.shape[0], mlp.gate.weight.shape[1],
                              dtype=mlp.gate.weight.dtype, device="meta")
        self.gate_up = _te_norm_linear(norm, normalization, stacked, False, tp, device,
                                       parameters_split=("gate", "up"))
        _carry(mlp.gate.weight, self.gate_up.gate_weight)
        _carry(mlp.up.weight, self.gate_up.up_weight)
        self.down = _te_row_linear(mlp.down, tp, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # each (T, B, local ffn)
        return self.down(F.silu(gate) * up)


class SequenceFirstAttention(nn.Module):
    """The local Attention's computation on (T, B, C) activations, its core
    called with DotProductAttention's contract (qkv_format="sbhd"): q
    (T, B, heads, D), k and v (T, B, kv heads, D) in, (T, B, heads * D) out,
    causal. Holds the same parameters under the same names (qkv, proj)."""

    def __init__(self, attn: Attention, qkv: nn.Module, proj: nn.Module, core: nn.Module):
        super().__init__()
        self.qkv, self.proj, self.core, self.rope = qkv, proj, core, attn.rope
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm  # over D: any layout
        self.heads, self.kv_heads = attn.local_heads, attn.local_kv_heads
        self.head_dim = attn.head_dim
        self.recompute_core = attn.recompute_core

    def rotate(self, x: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
        """RoPE on (T, B, heads, D), through the local RotaryEmbedding's (B, heads, T, D)."""
        assert self.rope is not None  # forward rotates only with RoPE
        return self.rope(x.permute(1, 2, 0, 3), positions).permute(2, 0, 1, 3)

    def forward(self, x: torch.Tensor, samples: Optional[torch.Tensor],
                documents: Optional[Documents] = None) -> torch.Tensor:
        """`documents` reset RoPE's positions only: the recipe's validation
        refuses document-separated attention with this backend."""
        q, k, v = split_heads(self.qkv(x), self.heads, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            positions = None if documents is None else documents.positions
            q, k = self.rotate(q, positions), self.rotate(k, positions)
        # Contiguous sbhd: a layout every TE version's DotProductAttention takes.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        y = self.core(q, k, v, checkpoint_core_attention=self.recompute_core and self.training)
        return self.proj(y)


class SequenceFirstDropout(nn.Module):
    """A block's LayoutDropout on (T, B, C) activations: its masks are drawn per
    sample, so it runs on the batch-first view and keeps the local backend's masks."""

    def __init__(self, dropout: nn.Module):
        super().__init__()
        self.dropout = dropout

    def forward(self, x: torch.Tensor, samples: Optional[torch.Tensor]) -> torch.Tensor:
        return swap_batch_and_sequence(self.dropout(swap_batch_and_sequence(x), samples))


def make_sequence_first(block: Block, qkv: nn.Module, proj: nn.Module, core: nn.Module) -> None:
    """Make `block` run on (T, B, C): the attention with `qkv`, `proj` and the
    attention `core` (DotProductAttention's contract), the dropouts on the
    batch-first view. The norms and the MLP act on the last dim: any layout."""
    block.attn = SequenceFirstAttention(_local_attention(block), qkv, proj, core)
    block.attn_dropout = SequenceFirstDropout(block.attn_dropout)
    block.mlp_dropout = SequenceFirstDropout(block.mlp_dropout)


def _local_attention(block: Block) -> Attention:
    """`block`'s own attention: a block is made sequence-first once."""
    assert isinstance(block.attn, Attention)
    return block.attn


def _dot_product_attention(attn: Attention, tp: TPGroup) -> nn.Module:
    """TE's attention core for the local `attn`: global head counts, as TE divides by tp."""
    parallel = (dict(tp_group=tp.group, tp_size=tp.size, sequence_parallel=tp.sequence_parallel)
                if tp.active else {})
    return te.DotProductAttention(attn.local_heads * tp.size, attn.head_dim,
                                  num_gqa_groups=attn.local_kv_heads * tp.size,
                                  attention_dropout=attn.prob_dropout.p, qkv_format="sbhd",
                                  attn_mask_type="causal", **parallel)


# The fused norm + MLP module standing for each FlavourSpec.te_mlp, built
# from the MLP module that flavour's make_mlp builds.
_FUSED_MLP: dict[str, Callable[..., nn.Module]] = {"gelu": FusedGeluMLP, "swiglu": FusedSwiGLUMLP}


def convert_block(block: Block, spec: FlavourSpec, tp: TPGroup, device: torch.device) -> None:
    """Swap a block's norms, linears and attention core for TE's modules, in
    place; the block then runs on (T, B, C)."""
    attn = _local_attention(block)
    qkv = _fuse_norm_qkv(cast(_Norm, block.norm1), spec.te_norm, attn.qkv, tp, device)
    proj = _te_row_linear(attn.proj, tp, device)
    make_sequence_first(block, qkv, proj, _dot_product_attention(attn, tp))
    block.mlp = _FUSED_MLP[spec.te_mlp](block.norm2, spec.te_norm, block.mlp, tp, device)
    # The norms now live inside the fused modules.
    block.norm1, block.norm2 = nn.Identity(), nn.Identity()


def sequence_parallel_names(model: nn.Module, flavour: str) -> set[str]:
    """TE names of the local `model`'s parameters marked sequence-parallel: the
    replicated ones (norms, row-parallel biases, positions) that see only this
    rank's sequence shard, whose grads the grad sync sums over the TP group."""
    return {te_key(name, flavour) for name, param in model.named_parameters()
            if "tp" in spec_of(param).grad_sum_axes}


def set_sequence_parallel_marks(model: nn.Module, names: set[str]) -> None:
    """The local model's marks decide, so the grad sync sums what it sums
    locally (a TE parameter made without a local one is replicated)."""
    for name, param in model.named_parameters():
        spec = spec_of(param) if has_spec(param) else ShardSpec()
        set_spec(param, dataclasses.replace(spec, grad_sum_axes=("tp",) if name in names else ()))


def convert(model: GPT, device: torch.device) -> GPT:
    """Swap `model`'s blocks and final norm for TE's modules, keeping the values
    (the parameter names change as `te_key` says); its blocks then run on (T, B, C)."""
    require()
    marked = sequence_parallel_names(model, model.cfg.flavour.value)
    spec = spec_of_model(model.cfg)
    for block in model.layers.values():
        assert isinstance(block, Block)  # what GPT's layers hold
        convert_block(block, spec, model.tp, device)
    model.sequence_first = True
    if model.last:
        model.norm = _te_norm(cast(_Norm, model.norm), spec.te_norm, device)
    set_sequence_parallel_marks(model, marked)
    return model


def fp8_context(enabled: bool, amax_group=None):
    """FP8 with E4M3 forward / E5M2 backward tensors and delayed scaling; the
    amax history is reduced over `amax_group` (every TP and DP rank of the
    stage: one scale for the tensors they split or replicate)."""
    if not enabled:
        return contextlib.nullcontext()
    require()
    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    if hasattr(te, "autocast"):  # TE 2.8+; fp8_autocast is deprecated there
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=amax_group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=amax_group)
