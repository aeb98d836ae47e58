"""The chunk factory: this rank's pieces of the GPT for the pipeline runtime.

Virtual stage v holds layers [v*L/(pp*vpp), (v+1)*L/(pp*vpp)); which virtual
stages a pipeline rank holds is the runtime's `virtual_stages`. With pp=1 the
one chunk is the whole model. The trainer and the checkpoint planner both build
chunks here, so a planned rank holds exactly the parameters a trained one does.
"""
from __future__ import annotations

from megaresil.config import ModelConfig
from megaresil.model.gpt import GPT
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.pipeline import virtual_stages


def stage_layers(cfg: ModelConfig, layout: ParallelLayout, stage: int) -> range:
    """The global layer numbers of virtual stage `stage`."""
    per_stage = cfg.num_layers // (layout.pp * layout.vpp)
    return range(stage * per_stage, (stage + 1) * per_stage)


def build_chunks(cfg: ModelConfig, layout: ParallelLayout, seed: int, *,
                 z_loss: float = 0.0) -> list[GPT]:
    """This rank's model chunks, in virtual-stage order (uninitialised, on the
    current default device); `z_loss`: the output z-loss's coefficient."""
    last = layout.pp * layout.vpp - 1
    return [GPT(cfg, tp=layout.tensor_parallel(), ep=layout.expert_parallel(),
                cp=layout.context_parallel(), seed=seed, layer_ids=stage_layers(cfg, layout, v),
                first=v == 0, last=v == last, z_loss=z_loss)
            for v in virtual_stages(layout)]
