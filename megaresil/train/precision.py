"""Numeric precision of training: fp32, bf16 Megatron style, or bf16 autocast.

- `fp32`: parameters, activations and grads in fp32 (exact layout equivalence).
- `bf16` (Megatron's mixed precision): the model's parameters and activations
  are bf16; the optimizer steps fp32 *main* copies of them, whose fp32 grads
  accumulate the micro-batches' bf16 grads (data_parallel.GradBuffers), and
  copies the result back to bf16 after each step. Softmax/cross-entropy run in
  fp32. Checkpoints hold the fp32 main weights and moments, so a bf16 run
  resumes under fp32 and vice versa. Under the distributed optimizer (ZeRO-1)
  each DP rank keeps only its row shard of the fp32 main weights (and grads),
  as Megatron's distributed optimizer does: `shard_main_params`.
- `amp`: fp32 parameters under bf16 autocast.
- `auto`: fp32 on CPU, bf16 on CUDA.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
import torch.nn as nn

from megaresil.config import ConfigError, Precision
from megaresil.parallel.distributed_optimizer import DistributedOptimizer
from megaresil.parallel.sharding import carry_spec


def resolve(precision: Precision, device: torch.device) -> Precision:
    if precision != Precision.auto:
        return precision
    return Precision.bf16 if device.type == "cuda" else Precision.fp32


class ComputeContext:
    """Entered around every forward: bf16 autocast under `amp`, TE's FP8
    autocast under train.fp8. Reusable (a fresh FP8 context each time)."""

    def __init__(self, precision: Precision, device: torch.device, fp8: bool,
                 amax_group=None):
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                         if precision == Precision.amp else None)
        self.fp8, self.amax_group = fp8, amax_group
        self.stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        if self.autocast is not None:
            stack.enter_context(self.autocast)
        if self.fp8:
            from megaresil.model import te
            stack.enter_context(te.fp8_context(True, self.amax_group))
        self.stack.append(stack)

    def __exit__(self, *exc) -> None:
        self.stack.pop().__exit__(*exc)


# cuBLAS reads its workspace setting once per process, at the first GEMM, and
# deterministic GEMMs need a fixed one (NVIDIA's documented value): a worker
# sets it before CUDA starts (launch.worker), never after.
CUBLAS_DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def deterministic_kernels(setting: Optional[bool], device: torch.device) -> bool:
    """train.deterministic's value: unset means on for the CPU (its kernels
    are deterministic anyway) and off on CUDA (it costs speed there)."""
    return setting if setting is not None else device.type != "cuda"


def env_before_cuda(setting: Optional[bool]) -> dict[str, str]:
    """What a worker's environment needs before its first CUDA call."""
    return dict(CUBLAS_DETERMINISTIC_ENV) if setting else {}


def set_kernel_determinism(setting: Optional[bool], device: torch.device) -> None:
    """Deterministic kernels on or off as the recipe says, every time: the
    flag is process-wide, and a run after a deterministic one (a test, a
    check in tools/gpu_check.py) must not inherit its slower kernels."""
    on = deterministic_kernels(setting, device)
    if on and device.type == "cuda" and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        if torch.cuda.is_initialized():
            raise ConfigError("train.deterministic", "deterministic cuBLAS needs "
                              "CUBLAS_WORKSPACE_CONFIG before CUDA starts (cuBLAS reads it "
                              "once per process) and CUDA already ran in this one.",
                              "export CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting Python "
                              "(megaresil's own workers set it themselves).")
        os.environ.update(CUBLAS_DETERMINISTIC_ENV)
    torch.use_deterministic_algorithms(on)
    # Deterministic kernels are the guarantee. Torch also NaN-fills every new
    # tensor's memory in this mode (a check against reading torch.empty's
    # garbage, which no kernel here does): ~900 fills per step of gpt-tiny.
    # A property of the module's class at runtime, absent from torch's stub.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def logits_dtype(precision: Precision) -> torch.dtype:
    return torch.float32 if precision == Precision.fp32 else torch.bfloat16


def main_copy(param: nn.Parameter) -> nn.Parameter:
    """An fp32 Parameter with `param`'s values and `ShardSpec`."""
    main = nn.Parameter(param.detach().to(torch.float32, copy=True))
    carry_spec(param, main)
    return main


def cast_to_bf16(params: list[nn.Parameter]) -> None:
    for param in params:
        param.data = param.data.to(torch.bfloat16)


class MainParams:
    """Whole fp32 main copies of some of a model's parameters (those whose
    gradient group keeps whole optimizer state: every rank holds them all),
    which are cast to bf16 here."""

    def __init__(self, params: list[nn.Parameter]):
        self.model = params
        self.main = [main_copy(p) for p in params]
        self.copy_of = {id(p): m for p, m in zip(params, self.main)}
        cast_to_bf16(params)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """After an optimizer step or a checkpoint load: bf16 model := fp32 main."""
        for param, main in zip(self.model, self.main):
            param.copy_(main)


def optimizer_params(params: list[nn.Parameter], main: MainParams | None) -> list[nn.Parameter]:
    """What the optimizer steps and the checkpoint holds for each parameter:
    its fp32 main copy where `main` keeps one, else the parameter itself
    (under ZeRO-1 its shard keeps the fp32 rows: shard_main_params)."""
    if main is None:
        return params
    return [main.copy_of.get(id(p), p) for p in params]


def shard_main_params(optimizer: DistributedOptimizer) -> None:
    """bf16 under ZeRO-1: `optimizer` was built with separate_main, so its row
    shards hold fp32 copies of this rank's rows; cast the model to bf16. The
    checkpoint saves the fp32 rows under the parameter's key, and a load fills
    them (`AdamState.main_rows`; then `optimizer.gather_params` makes the
    bf16 model)."""
    cast_to_bf16([shard.param for shard in optimizer.shards])

