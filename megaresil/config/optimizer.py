"""The recipe's `optimizer` section: AdamW's settings and the learning-rate
schedule's (the schedule itself: train/lr_schedule.py)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from megaresil.config.fields import FRACTION, NON_NEGATIVE, POSITIVE, doc, require


class DecayStyle(str, enum.Enum):
    """After warmup, how the LR falls from optimizer.lr to min_lr (Megatron's
    --lr-decay-style)."""
    cosine = "cosine"
    linear = "linear"
    constant = "constant"
    inverse_sqrt = "inverse_sqrt"
    wsd = "wsd"


class WSDDecayStyle(str, enum.Enum):
    """The shape of warmup-stable-decay's final decay (Megatron's --lr-wsd-decay-style)."""
    linear = "linear"
    cosine = "cosine"
    minus_sqrt = "minus_sqrt"
    exponential = "exponential"


@dataclass
class OptimizerConfig:
    lr: float = doc(1e-3, "Peak learning rate.", bounds=POSITIVE)
    min_lr: float = doc(1e-4, "Learning rate at the end of the decay (and after it); "
                        "decay_style=constant ignores it, inverse_sqrt never falls below it.",
                        bounds=NON_NEGATIVE)
    warmup_steps: int = doc(10, "Linear warmup steps from 0 to lr (step k of the warmup "
                            "trains at lr * k / warmup_steps).", bounds=NON_NEGATIVE)
    decay_style: DecayStyle = doc(DecayStyle.cosine, "After warmup: cosine or linear from lr "
                                  "to min_lr over decay_steps; constant (lr); inverse_sqrt "
                                  "(lr * sqrt(max(warmup_steps, 1) / step), at least min_lr); wsd "
                                  "(warmup-stable-decay: lr, then the last wsd_decay_steps of "
                                  "decay_steps fall to min_lr). After decay_steps every style "
                                  "but constant trains at min_lr. Megatron-LM's "
                                  "--lr-decay-style.")
    decay_steps: Optional[int] = doc(None, "Steps of decay after warmup (Megatron's "
                                     "--lr-decay-iters is warmup_steps + this); null means "
                                     "train.steps - warmup_steps, so the schedule follows "
                                     "train.steps.", bounds=POSITIVE)
    wsd_decay_style: Optional[WSDDecayStyle] = doc(None, "With decay_style=wsd, the final "
                                                   "decay's shape: linear, cosine, minus_sqrt "
                                                   "(1 - sqrt(t)) or exponential; null means "
                                                   "linear.")
    wsd_decay_steps: Optional[int] = doc(None, "With decay_style=wsd (required there), the "
                                         "final decay's length, at most decay_steps; the "
                                         "stable phase is the rest.", bounds=POSITIVE)

    def decay_horizon(self, train_steps: int) -> int:
        """Steps of decay after warmup: decay_steps, or what train.steps leaves after warmup."""
        return self.decay_steps or max(1, train_steps - self.warmup_steps)

    weight_decay: float = doc(0.1, "AdamW weight decay (not applied to biases and norms).",
                              bounds=NON_NEGATIVE)
    beta1: float = doc(0.9, "AdamW beta1.", bounds=FRACTION)
    beta2: float = doc(0.95, "AdamW beta2.", bounds=FRACTION)
    eps: float = doc(1e-8, "AdamW epsilon.", bounds=POSITIVE)
    grad_clip: float = doc(1.0, "Clip the global gradient norm to this; 0 disables clipping.",
                           bounds=NON_NEGATIVE)
    distributed: bool = doc(False, "ZeRO-1 distributed optimizer: AdamW state sharded over "
                            "data-parallel ranks, each parameter cut along dim 0.")


def validate_optimizer(o: OptimizerConfig, train_steps: int) -> None:
    """The section's rules: a schedule that falls, and wsd's knobs."""
    require(o.min_lr <= o.lr, "optimizer.min_lr",
            f"{o.min_lr} exceeds the peak optimizer.lr={o.lr}; the schedule would rise.",
            "give min_lr between 0 and optimizer.lr.")
    _validate_wsd(o, train_steps)


def _validate_wsd(o: OptimizerConfig, train_steps: int) -> None:
    """The wsd knobs belong to decay_style=wsd, which needs its decay's length,
    a part of the decay steps (the stable phase is the rest)."""
    wsd = o.decay_style == DecayStyle.wsd
    for key, value in (("wsd_decay_style", o.wsd_decay_style),
                       ("wsd_decay_steps", o.wsd_decay_steps)):
        require(wsd or value is None, f"optimizer.{key}",
                f"is set but optimizer.decay_style={o.decay_style.value}, which ignores it.",
                f"set optimizer.decay_style=wsd, or leave optimizer.{key} unset.")
    if not wsd:
        return
    horizon = o.decay_horizon(train_steps)
    require(o.wsd_decay_steps is not None, "optimizer.wsd_decay_steps",
            "decay_style=wsd needs the length of its final decay.",
            f"give optimizer.wsd_decay_steps, at most the {horizon} decay steps.")
    require((o.wsd_decay_steps or 0) <= horizon, "optimizer.wsd_decay_steps",
            f"{o.wsd_decay_steps} exceeds the {horizon} decay steps after warmup "
            f"(optimizer.decay_steps, or train.steps - warmup_steps).",
            f"give at most {horizon}, or raise optimizer.decay_steps or train.steps.")
