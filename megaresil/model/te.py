"""Transformer Engine backend (`model.backend=te`): TE's Linear and norm
kernels (and FP8, `train.fp8=hybrid`) in place of the local ones.

Written against TE's documented API (transformer_engine.pytorch.Linear,
LayerNorm, RMSNorm, fp8_autocast, common.recipe.DelayedScaling) and untested
until a CUDA machine with TE runs `pytest -m gpu` (tools/gpu_check.sh does).

The model is built and initialised with the local layers, then `convert`
swaps each linear layer and norm for TE's module of the same shape, with the
same parameter names (`weight`, `bias`) and marks, and the same values: the
checkpoint keys are the local backend's, so a TE-trained checkpoint resumes on
the local backend and the other way round.

What is left: TE's own tensor/sequence parallel modes (parallel_mode,
tp_group) and its fused LayerNormLinear / LayerNormMLP (their parameters are
named layer_norm_weight, fc1_weight, ..., which needs a key map), and
DotProductAttention (attention stays torch's SDPA, itself flash/cuDNN on
CUDA). Until then the config allows backend=te only at tp=1.

`import transformer_engine` without CUDA raises RuntimeError, not
ImportError, hence the broad except.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from megaresil.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

_IMPORT_ERROR: Optional[str] = None
try:
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format
except Exception as err:  # ImportError, or RuntimeError without CUDA
    te = None
    _IMPORT_ERROR = f"{type(err).__name__}: {err}"


def available() -> bool:
    return te is not None


def import_error() -> Optional[str]:
    return _IMPORT_ERROR


def require() -> None:
    if te is None:
        raise RuntimeError(f"model.backend=te needs NVIDIA Transformer Engine on a CUDA machine "
                           f"({_IMPORT_ERROR}). Fix: pip install 'megaresil[gpu]' there, or "
                           "use model.backend=local")


def device_context(device: torch.device):
    """Where TE creates its parameters (its default is the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _carry(old: nn.Parameter, new: nn.Parameter) -> None:
    """Same values and the marks the parallel code and checkpoints read."""
    with torch.no_grad():
        new.copy_(old)
    new.__dict__.update({k: v for k, v in vars(old).items() if not k.startswith("_")})


def _te_linear(layer: nn.Module, device: torch.device) -> nn.Module:
    weight = layer.weight
    out_features, in_features = weight.shape
    linear = te.Linear(in_features, out_features, bias=layer.bias is not None,
                       params_dtype=weight.dtype, device=device)
    _carry(weight, linear.weight)
    if layer.bias is not None:
        _carry(layer.bias, linear.bias)
    return linear


def _te_norm(norm: nn.Module, device: torch.device) -> nn.Module:
    size = norm.weight.shape[0]
    if isinstance(norm, nn.LayerNorm):
        new = te.LayerNorm(size, eps=norm.eps, params_dtype=norm.weight.dtype, device=device)
        _carry(norm.bias, new.bias)
    else:
        new = te.RMSNorm(size, eps=norm.eps, params_dtype=norm.weight.dtype, device=device)
    _carry(norm.weight, new.weight)
    return new


def convert(model: nn.Module, device: torch.device) -> nn.Module:
    """Swap `model`'s linear layers and norms for TE's, keeping names and values."""
    require()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                if child.tp.active:
                    raise ValueError("model.backend=te runs at parallel.tp=1 for now (TE's own "
                                     "tensor-parallel modes are not wired). Fix: parallel.tp=1 "
                                     "or model.backend=local")
                setattr(parent, name, _te_linear(child, device))
            elif isinstance(child, (nn.LayerNorm, nn.RMSNorm)):
                setattr(parent, name, _te_norm(child, device))
    return model


def fp8_context(enabled: bool):
    """FP8 with E4M3 forward / E5M2 backward tensors and delayed scaling."""
    if not enabled:
        return contextlib.nullcontext()
    require()
    return te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID))
