"""What a checkpoint holds besides tensor data, and what a trainer hands it.

`RunRecord` is the manifest's non-tensor state (docs/architecture.md ("The
manifest's non-tensor state"): step, layout, data position, optimizer
hyper-state and step count, per-rank RNG states, the recipe), typed. It is the only code that writes that state into a
manifest or reads it back; whoever saves (the trainer, the converter, the
Hugging Face import) builds one.

`TrainingState` is all the checkpoint sees of a trainer: its parameters
and state buffers by layout-free key, its optimizer's state through `OptimizerState` (whatever the
implementation keeps where), its run state and RNG. train/state.py
implements it; checkpoint/ knows no trainer attribute and no optimizer class.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Protocol, Sequence

import torch
import torch.nn as nn

from megaresil.checkpoint.keys import MainRowsOf, MomentsOf, state_rects
from megaresil.checkpoint.sharded import Rect
from megaresil.config import ModelConfig
from megaresil.parallel.layout import ParallelLayout

# Manifest fields about the tensors and the file format (manager.build_manifest).
FORMAT_FIELDS = ("format", "version", "backend", "tensors")
# Fields older checkpoints carry that nothing reads: they load, and are not
# carried into new checkpoints. `lr_schedule`: the LR is a pure function of
# the step and the recipe (train/lr_schedule.lr_at).
RETIRED_FIELDS = ("lr_schedule",)
_RUN_FIELDS = ("step", "layout", "data", "optimizer", "recipe", "rank_states", "weights_only")


def layout_record(layout: ParallelLayout, distributed_optimizer: bool) -> dict:
    """The manifest's `layout`: the saving ranks' layout and whether their
    optimizer state is sharded over data parallelism."""
    return {**layout.describe(), "distributed_optimizer": distributed_optimizer}


@dataclass
class RunRecord:
    """A checkpoint's non-tensor state."""
    step: int  # optimizer steps taken by the run
    layout: dict  # layout_record of the ranks that saved
    recipe: dict  # the resolved recipe (config.to_dict); its `optimizer` is the hyper-state
    consumed_samples: int  # the data position: global samples consumed
    optimizer_steps: int  # the optimizer's own step count (AdamW's bias correction)
    # Per-rank RNG states, in rank order; None for a rank whose state the
    # record does not carry (a local shard holds its owner's only).
    rank_states: Sequence[Optional[dict]] = field(default_factory=list)
    weights_only: bool = False  # no optimizer state: not a point to resume training from
    # Fields of other parts (the watchdog's calibration, a Hugging Face
    # import's origin), stored and carried over as given.
    extra: dict = field(default_factory=dict)

    def to_manifest(self) -> dict:
        fields = {"step": self.step, "layout": self.layout,
                  "data": {"consumed_samples": self.consumed_samples},
                  "optimizer": {"adam_step": self.optimizer_steps,
                                "hyper": self.recipe["optimizer"]},
                  "recipe": self.recipe, "rank_states": self.rank_states}
        if self.weights_only:
            fields["weights_only"] = True
        return {**fields, **self.extra}

    @classmethod
    def from_manifest(cls, manifest: dict) -> RunRecord:
        ignored = set(_RUN_FIELDS + FORMAT_FIELDS + RETIRED_FIELDS)
        return cls(step=manifest["step"], layout=manifest["layout"], recipe=manifest["recipe"],
                   consumed_samples=manifest["data"]["consumed_samples"],
                   optimizer_steps=manifest["optimizer"]["adam_step"],
                   rank_states=list(manifest.get("rank_states") or []),
                   weights_only=bool(manifest.get("weights_only", False)),
                   extra={k: v for k, v in manifest.items() if k not in ignored})

    def rank_state(self, layout: dict, rank: int) -> Optional[dict]:
        """Rank `rank`'s saved RNG state when the checkpoint was saved by
        the same ranks (`layout`, a layout_record); None otherwise: a
        per-rank stream means nothing on another rank."""
        if layout == self.layout and len(self.rank_states) == layout["world_size"]:
            return self.rank_states[rank]
        return None


class OptimizerState(Protocol):
    """An optimizer's state as a checkpoint holds it, whatever the
    implementation keeps where: per parameter the AdamW moments, and the
    step count that drives bias correction."""

    def moments(self) -> MomentsOf:
        """Per parameter, its moments by name (live tensors, loaded in place)
        and the DP row shard they cover; creates zero state where the
        optimizer has not stepped yet, so a checkpoint can be loaded into it."""

    def main_rows(self) -> MainRowsOf:
        """Per parameter, the row shard whose fp32 main rows are its weights
        on this rank (bf16 under ZeRO-1), else None."""

    def step_count(self) -> int:
        """Steps the optimizer has taken."""

    def set_step_count(self, steps: int) -> None:
        """Go on as if the optimizer had taken `steps` steps."""


class TrainingState(Protocol):
    """A trainer's state as the checkpoint sees it (train/state.py)."""

    model_config: ModelConfig

    # Read-only: an implementation's own optimizer view may offer more.
    @property
    def optimizer(self) -> OptimizerState:
        """The optimizer's state as the checkpoint holds it."""

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """(layout-free key, parameter) over this rank's model chunks, each
        with its `ShardSpec` (parallel/sharding.py): where its block lies, and
        whether it is the last stage's copy of a tied embedding."""

    def named_buffers(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(layout-free key, tensor) of the state held outside the
        parameters (the expert biases): whole, no optimizer state."""

    def layout_record(self) -> dict:
        """This rank's layout as the manifest records it (`layout_record`)."""

    def run_record(self) -> RunRecord:
        """The non-tensor state to save now (rank_states empty: the
        checkpointer gathers each rank's `rng_state`)."""

    def adopt(self, whole: Mapping[str, torch.Tensor]) -> None:
        """Take tensors this rank held before (by key, whole) as the state's
        own storage where they fit, instead of loading them."""

    def rng_state(self) -> dict:
        """This rank's RNG state, JSON-safe."""

    def restore(self, saved: RunRecord) -> None:
        """Go on from a checkpoint whose tensors are already loaded."""


def training_rects(state: TrainingState, *, include_copies: bool = False) -> list[Rect]:
    """Every tensor of a trainer's state on this rank; `include_copies` adds
    the tied-embedding copy (a load target, never saved)."""
    return state_rects(state.named_parameters(), state.model_config, state.optimizer.moments(),
                       include_copies, state.optimizer.main_rows(), state.named_buffers())


def weight_rects(state: TrainingState) -> list[Rect]:
    """The weights of a trainer on this rank, tied-embedding copy included:
    what a run that starts from another model's weights loads."""
    return state_rects(state.named_parameters(), state.model_config, None, include_copies=True,
                       main_rows=state.optimizer.main_rows())
