"""train.compile: regional compilation, TorchTitan's way. Each transformer
block is compiled on its own (`nn.Module.compile`, in place: the module
and its state-dict keys stay as they were, no `_orig_mod.` prefix), so the
compiled unit is small, identical blocks share one graph, and full
recomputation and pipeline chunks, which cut the model between blocks,
see the same modules as in eager mode. Compilation is lazy: the first step
pays it. Whether `auto` compiles, and how close compiled losses stay to
eager ones, is measured in bench/README.md ("Training throughput")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from megaresil.config import Compile, RecipeConfig
from megaresil.config.compiling import composes_with_compile
from megaresil.model.gpt import GPT
from megaresil.model.moe import has_experts


@dataclass(frozen=True)
class BlockCompile:
    """What was compiled on this rank (its pipeline chunks' blocks): how many
    modules, and whether as whole graphs."""
    units: int
    fullgraph: bool

    def words(self) -> str:
        graphs = "whole graphs" if self.fullgraph else "graph breaks allowed"
        return (f"train.compile: this rank's {self.units} blocks compiled ({graphs}) on the "
                "first step, whose time includes it")


def compiles_blocks(cfg: RecipeConfig, device: torch.device) -> bool:
    """Whether this run compiles: `auto` on CUDA, where regional compilation
    is expected to win (unmeasured here: tools/gpu_check.py's compile_vs_eager
    measures it), and where config/compiling.py would accept `blocks`."""
    if cfg.train.compile != Compile.auto:
        return cfg.train.compile == Compile.blocks
    return device.type == "cuda" and composes_with_compile(cfg)


def whole_graphs(cfg: RecipeConfig) -> bool:
    """Whether a block traces without a graph break (fullgraph=True), as
    measured on torch 2.13; elsewhere dynamo runs the untraceable parts
    eagerly between graphs:
    - dropout draws its masks from a torch.Generator per sample
      (parallel/random.py), an object dynamo cannot create in a graph;
    - sequence parallelism's all-gather and reduce-scatter over lists of
      tensors (parallel/tensor_parallel.py) are not traceable inside their
      autograd.Function (plain tp's all-reduce is);
    - context parallelism and document masking are untried here."""
    m, p = cfg.model, cfg.parallel
    return (m.dropout == 0 and m.attention_dropout == 0 and not p.sequence_parallel
            and p.cp == 1 and not cfg.data.masks_documents)


def compiled_units(chunks: Sequence[GPT], cfg: RecipeConfig) -> list[nn.Module]:
    """The modules compiled: each block, but in a block with experts only its
    attention. The experts' routing has data-dependent shapes and grouped_mm's
    fake-tensor rule wants bf16 on the CPU, so the MoE layer runs eagerly."""
    units = []
    for chunk in chunks:
        for index, block in chunk.layers.items():
            units.append(block.get_submodule("attn") if has_experts(cfg.model.moe, int(index)) else block)
    return units


def compile_blocks(chunks: Sequence[GPT], cfg: RecipeConfig, device: torch.device, *,
                   backend: str = "inductor") -> BlockCompile | None:
    """Compile each block of the chunks in place when the run compiles;
    None when it does not. `backend`: inductor for training; tests use
    aot_eager (the same tracing and autograd, no code generation)."""
    if not compiles_blocks(cfg, device):
        return None
    fullgraph = whole_graphs(cfg)
    units = compiled_units(chunks, cfg)
    for unit in units:
        unit.compile(backend=backend, fullgraph=fullgraph)
    return BlockCompile(len(units), fullgraph)
