"""A rank's model, built: its chunks of the recipe's model, initialised on
its device, with reproducible randomness, and the names its parameters are
checkpointed under."""
from __future__ import annotations

import random

import numpy as np
import torch

from megaresil.config import Backend, RecipeConfig
from megaresil.model.chunks import build_chunks
from megaresil.model.gpt import GPT
from megaresil.model.init import materialize
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.precision import set_kernel_determinism


def make_deterministic(cfg: RecipeConfig, device: torch.device) -> None:
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    set_kernel_determinism(cfg.train.deterministic, device)


def build_model(cfg: RecipeConfig, layout: ParallelLayout, draw: bool = True) -> list[GPT]:
    """This rank's model chunks, initialised: the whole model when pp=1.
    Built on the meta device, then only this rank's slices are allocated and,
    with `draw`, drawn, on the rank's device (no global tensor, no host copy
    of the model). Without it the values are whatever the memory held: for a
    state about to be loaded over them (drawing, with its first touch of the
    memory, is most of a 1 GB state's build on the CPU)."""
    with torch.device("meta"):
        chunks = build_chunks(cfg.model, layout, cfg.train.seed, z_loss=cfg.train.z_loss)
    chunks = [materialize(chunk, cfg.model, cfg.train.seed, layout.device, draw=draw)
              for chunk in chunks]
    if cfg.model.backend == Backend.te:
        from megaresil.model import te  # imports only where TE is wanted
        chunks = [te.convert(chunk, layout.device) for chunk in chunks]
    return chunks


def checkpoint_key_map(cfg: RecipeConfig):
    """Parameter name -> checkpoint key: the same, except TE's fused modules' names."""
    if cfg.model.backend != Backend.te:
        return lambda name: name
    from megaresil.model import te
    return lambda name: te.local_key(name, cfg.model.flavour.value)
