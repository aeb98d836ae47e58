"""What of a Megatron checkpoint's optimizer state an import carries over.

Megatron saves an optimizer's state in model space, each parameter's state a
tensor of the parameter's own global shape under
`optimizer.state.<name>.<the parameter's key>`, in two cases: its distributed
optimizer's `fully_reshardable` format (`--dist-ckpt-optim-fully-reshardable`:
names `param`, `exp_avg`, `exp_avg_sq`) and the optimizer without ZeRO (the
fp32 main weights as `fp32_param`). Those are layout-free exactly as
megaresil's own moments are, so an import reads them through the weights'
name table. Its other formats are tied to the layout that saved them
(`dp_reshardable`: the data-parallel gradient buffers, in their bucket order;
`fully_sharded_model_space`: each rank's flattened range) and are left out,
said in one line with the fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

STATE = "optimizer.state."
# An optimizer entry's key: a chained optimizer (its param groups apart, as
# for experts) prefixes `chained_<i>.` unless its save said chained_optim_avoid_prefix.
_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
MOMENTS = ("exp_avg", "exp_avg_sq")  # the same names as megaresil's (checkpoint/keys.py)
MAIN_WEIGHTS = ("param", "fp32_param")  # fully_reshardable's name, the plain optimizer's
FIX = "save with --dist-ckpt-optim-fully-reshardable to carry it"
NOT_MODEL_SPACE = {
    "dp_reshardable": "dp_reshardable (the data-parallel buffers of the layout that saved "
                      "it, not model space)",
    "fully_sharded_model_space": "fully_sharded_model_space (each rank's flattened range), "
                                 "which megaresil does not read",
    "dp_zero_gather_scatter": "dp_zero_gather_scatter (one object per tp x pp rank, tied to "
                              "that layout)",
}


@dataclass(frozen=True)
class CarriedState:
    """The optimizer state an import takes: the key prefix of the fp32 main
    weights (None: the model's own weights), whether AdamW's moments come
    (False: a weights-only import), Adam's step count, and what the note says."""
    main: Optional[str]
    moments: bool
    adam_step: Optional[int]
    note: str


def is_optimizer_key(key: str) -> bool:
    return bool(_OPTIMIZER_KEY.match(key))


def prefix(name: str) -> str:
    return f"{STATE}{name}."


def held_under(stored: dict[str, tuple[int, ...]], key_prefix: str) -> dict[str, tuple[int, ...]]:
    """The tensors under `key_prefix`, by the rest of their key."""
    return {key[len(key_prefix):]: shape for key, shape in stored.items()
            if key.startswith(key_prefix)}


def _in_model_space(held: dict[str, tuple[int, ...]], model: dict[str, tuple[int, ...]]) -> bool:
    return bool(held) and all(model.get(key) == shape for key, shape in held.items())


def _adam_step(common_optimizer: dict) -> Optional[int]:
    """The step count of the param groups (fully_reshardable keeps it there,
    the plain optimizer one level down); None when they disagree or lack one."""
    inner = common_optimizer.get("optimizer")
    groups = common_optimizer.get("param_groups") or (
        inner.get("param_groups") if isinstance(inner, dict) else None) or []
    steps = {group.get("step") for group in groups if isinstance(group, dict)}
    step = steps.pop() if len(steps) == 1 else None
    return int(step) if isinstance(step, (int, float)) and step >= 0 else None


def carried_state(model: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]],
                  common_optimizer: dict, iteration: int) -> CarriedState:
    """What an import carries of a checkpoint whose weights are `model`
    (key: global shape), whose tensors are `stored` and whose common state's
    optimizer entry is `common_optimizer`."""
    moments = [held_under(stored, prefix(name)) for name in MOMENTS]
    if not all(_in_model_space(held, model) for held in moments) or moments[0] != moments[1]:
        return CarriedState(None, False, None, _why_not(stored, common_optimizer))
    main = next((name for name in MAIN_WEIGHTS
                 if held_under(stored, prefix(name)) == moments[0]), None)
    step = _adam_step(common_optimizer)
    counted = (f"Adam's step {step}" if step is not None else
               f"Adam's step taken as the iteration, {iteration} (the param groups say none)")
    weights = (f"the fp32 main weights (optimizer.state.{main}.*) as the weights" if main else
               "the model's own weights (no fp32 main copy saved)")
    kind = common_optimizer.get("param_state_sharding_type") or "the optimizer without ZeRO"
    return CarriedState(prefix(main) if main else None, True,
                        step if step is not None else iteration,
                        f"optimizer state carried ({kind}): AdamW's moments of "
                        f"{len(moments[0])} tensors, {weights}, {counted}")


def _why_not(stored: dict[str, tuple[int, ...]], common_optimizer: dict) -> str:
    if not any(is_optimizer_key(key) for key in stored) and not common_optimizer:
        return "no optimizer state in the checkpoint (saved with --no-save-optim)"
    kind = str(common_optimizer.get("param_state_sharding_type") or "unnamed")
    saved_as = NOT_MODEL_SPACE.get(kind, f"a form megaresil does not read ({kind})")
    return f"optimizer state not carried: Megatron saved it as {saved_as}; {FIX}"
