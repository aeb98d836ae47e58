"""The learning-rate schedule: linear warmup, then the recipe's decay style
(Megatron-LM's --lr-decay-style set: cosine, linear, constant, inverse
square root, warmup-stable-decay).

The LR is a pure function of the step and the recipe, so a resumed run needs
no scheduler state to land on the same LR, at any layout. Step `s`
(1-based, the optimizer step about to be taken) trains at the LR Megatron's
`OptimizerParamScheduler.get_lr` gives after `s` increments (`num_steps = s`,
`lr_warmup_steps = warmup_steps`, `lr_decay_steps = warmup_steps +` the decay
horizon, `init_lr = 0`); Megatron's own loop steps its scheduler after the
optimizer, so its k-th update uses `num_steps = k - 1`, one step behind."""
from __future__ import annotations

import math
from typing import Optional

from megaresil.config import DecayStyle, OptimizerConfig, WSDDecayStyle


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """LR for optimizer step `step` (1-based) of a run of `total_steps`."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.decay_style == DecayStyle.constant:
        return cfg.lr
    decay_steps = cfg.decay_horizon(total_steps)
    past = step - cfg.warmup_steps  # steps into the decay
    if cfg.decay_style == DecayStyle.cosine:
        # This expression, not min_lr + coefficient * delta: the schedule of
        # runs that predate the other styles stays bit for bit.
        progress = min(1.0, past / decay_steps)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    if past > decay_steps:
        return cfg.min_lr
    if cfg.decay_style == DecayStyle.inverse_sqrt:
        return max(cfg.min_lr, cfg.lr * max(cfg.warmup_steps, 1) ** 0.5 / step ** 0.5)
    return cfg.min_lr + decay_coefficient(past, decay_steps, cfg) * (cfg.lr - cfg.min_lr)


def decay_coefficient(past: int, decay_steps: int, cfg: OptimizerConfig) -> float:
    """The share of lr - min_lr kept `past` steps into `decay_steps` of a
    linear or wsd decay (1 at its start, 0 at its end)."""
    if cfg.decay_style == DecayStyle.linear:
        return 1.0 - float(past) / float(decay_steps)
    assert cfg.decay_style == DecayStyle.wsd and cfg.wsd_decay_steps is not None  # validated
    stable = decay_steps - cfg.wsd_decay_steps
    if past <= stable:
        return 1.0
    return wsd_coefficient(float(past - stable) / float(cfg.wsd_decay_steps),
                           cfg.wsd_decay_style or WSDDecayStyle.linear)


def wsd_coefficient(ratio: float, style: WSDDecayStyle) -> float:
    """The share kept `ratio` (0 to 1) through warmup-stable-decay's final decay."""
    if style == WSDDecayStyle.linear:
        return 1.0 - ratio
    if style == WSDDecayStyle.cosine:
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == WSDDecayStyle.exponential:
        return (2.0 * math.pow(0.5, ratio)) - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt


def moved_by_steps_line(cfg: OptimizerConfig, step: int, saved_steps: int,
                        steps: int) -> Optional[str]:
    """One line when resuming after `step` with train.steps changed from
    `saved_steps` to `steps` changes the LR the next step trains at (a decay
    whose length follows train.steps is stretched or shrunk to the new end:
    docs/checkpoints.md); None when that LR stays, or nothing is left to train."""
    if step >= steps:
        return None
    before, now = lr_at(step + 1, cfg, saved_steps), lr_at(step + 1, cfg, steps)
    if before == now:
        return None
    return (f"megaresil: train.steps is {steps}, the checkpoint's recipe had {saved_steps}: the "
            f"LR schedule follows the new length, so step {step + 1} trains at {now:.3g} where "
            f"the old one gave {before:.3g} (optimizer.decay_steps fixes the decay's length)")
