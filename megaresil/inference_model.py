"""A checkpoint's model alone, for `megaresil eval` and `megaresil generate`:
the trainer's own model construction (train/model_build.py) and its
checkpoint.init_from load (train/checkpointing.py), without what a Trainer
builds around them (data loaders, gradient buffers, fp32 main copies,
numerics checks) or its seeding and kernel switches (nothing here draws
random numbers: every value is loaded)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megaresil.config import FP8, Precision, RecipeConfig
from megaresil.events import EventLog
from megaresil.model.gpt import GPT
from megaresil.model.masks import DocumentMasking
from megaresil.model.moe import named_state_buffers
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.build import document_masking, named_state_parameters
from megaresil.train.checkpointing import TrainCheckpointing
from megaresil.train.model_build import build_model, checkpoint_key_map
from megaresil.train.precision import ComputeContext, cast_to_bf16, resolve
from megaresil.train.progress import Progress
from megaresil.train.state import LiveTrainingState


@dataclass
class LoadedModel:
    """What a job on the model reads: the recipe (inference_recipe's), this
    rank's layout, its one chunk of the model (pp = 1), the recipe's
    document masking and compute context (as the trainer builds them)."""
    cfg: RecipeConfig
    layout: ParallelLayout
    model: GPT
    masking: Optional[DocumentMasking]
    autocast: ComputeContext


def load_model(cfg: RecipeConfig, layout: ParallelLayout) -> LoadedModel:
    """The recipe's model on this rank, holding checkpoint.init_from's weights."""
    chunks = build_model(cfg, layout, draw=False)
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    key = checkpoint_key_map(cfg)
    # The checkpoint's view of a state includes an optimizer; this one never
    # steps, so it allocates nothing.
    state = LiveTrainingState(
        cfg, layout, list(named_state_parameters(chunks, key, params)),
        torch.optim.AdamW(params), Progress(),
        named_buffers=[(key(name), t) for name, t in named_state_buffers(chunks)])
    checkpointing = TrainCheckpointing.build(cfg, state, EventLog(Path(cfg.run.dir), layout.rank),
                                             watchdog=None, device=layout.device, fence=None,
                                             rank=layout.rank, job_started=time.time())
    try:
        checkpointing.initialize_from(Path(str(cfg.checkpoint.init_from)))
    finally:
        checkpointing.close()
    precision = resolve(cfg.train.precision, layout.device)
    if precision == Precision.bf16:  # the trainer's cast of its fp32 main weights
        cast_to_bf16(params)
    fp8 = cfg.train.fp8 != FP8.none
    autocast = ComputeContext(precision, layout.device, fp8=fp8,
                              amax_group=layout.stage_group() if fp8 else None)
    return LoadedModel(cfg, layout, chunks[0].eval(), document_masking(cfg), autocast)
