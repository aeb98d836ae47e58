"""The `faults` recipe key: injected faults as typed `FaultSpec`s, checked here.

A recipe writes a fault as a mapping, `{kind: kill, rank: 1, step: 7}`;
`parse_fault` checks it and types it. Only the fields written are kept (the
others are None and take their meaning from the properties below), so a
resolved recipe, and the checkpoints that store it, holds each fault as it
was written and an older checkpoint's faults read back unchanged.
resilience/faults.py fires them.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Union

from megaresil.config.fields import NON_NEGATIVE, require


class FaultKind(str, enum.Enum):
    kill = "kill"  # SIGKILL the rank's own process
    raise_ = "raise"  # an exception in the training thread
    hang = "hang"  # block forever (how: HangMode)
    slow = "slow"  # compute `seconds` more at every step from then on
    sigterm = "sigterm"  # a preemption notice
    corrupt_checkpoint = "corrupt_checkpoint"  # flip bytes of the newest global checkpoint
    # The local tier's (checkpoint.local): flip a byte of every committed
    # shard of the rank's own; kill the rank and empty its node's directory.
    corrupt_local_checkpoint = "corrupt_local_checkpoint"
    lose_local_node = "lose_local_node"
    # A NaN in the rank's gradients (after their data-parallel reduction):
    # once, or with persistent: true on every attempt of the global batch it
    # first hit (a bad batch, or a rank that recomputes it wrong every time).
    nan = "nan"
    # The loss of the rank's data-parallel replica times `scale` (default
    # 10) at one step, as the spike detector sees it (any rank of the replica
    # will do: TP ranks and pipeline stages alike); gradients are left alone.
    # Once (a bad batch), or with steps: N on every attempt of N steps in a
    # row, whatever the batch (the state causes it; many steps: a new level).
    spike = "spike"
    # One bit flipped (`bit`, else chosen by `seed`) in one element chosen by
    # `seed`: `target: param`, in the rank's copy of a parameter after the
    # step's update (memory at rest); `target: grad`, in the gradient its
    # optimizer steps on, after the data-parallel reduction.
    bitflip = "bitflip"
    # A NaN in the routing scores of the rank's first layer with experts, in
    # every forward pass of the step's first attempt: one token's score for
    # its first choice, which top-k keeps choosing, so its combine weight is
    # NaN too (a recipe with experts only).
    router_nan = "router_nan"

# The kinds that act on a step's numbers where the trainer asks, not at a section's start.
STEP_FAULT_KINDS = (FaultKind.nan, FaultKind.spike, FaultKind.bitflip, FaultKind.router_nan)


class FlipTarget(str, enum.Enum):
    param = "param"
    grad = "grad"

LOCAL_FAULT_KINDS = (FaultKind.corrupt_local_checkpoint, FaultKind.lose_local_node)


class HangMode(str, enum.Enum):
    """How a hang blocks (resilience/faults.py `hang`); device needs a CUDA device."""
    sleep = "sleep"
    collective = "collective"
    gil = "gil"
    native = "native"
    device = "device"


# The sections of a step a fault can fire in (the watchdog's sections too).
SECTIONS = ("setup", "data", "forward_backward", "optimizer", "checkpoint", "eval")


@dataclass
class FaultSpec:
    kind: FaultKind
    rank: int
    step: int
    section: Optional[str] = None  # None: data
    # slow: seconds per step; None: 1. An int stays one, as the recipe wrote it.
    seconds: Optional[Union[int, float]] = None
    mode: Optional[HangMode] = None  # hang: None is sleep
    # Restarts the run directory has seen before the fault may fire; None: 0.
    generation: Optional[int] = None
    persistent: Optional[bool] = None  # nan: every attempt of its batch; None: once
    scale: Optional[float] = None  # spike: the loss's factor; None: 10
    steps: Optional[int] = None  # spike: every attempt of this many steps; None: once
    target: Optional[FlipTarget] = None  # bitflip: None is param
    seed: Optional[int] = None  # bitflip: picks the element (and the bit); None: the step
    bit: Optional[int] = None  # bitflip: 0 is the lowest mantissa bit; None: chosen by seed
    # Fires only in a process started in place of a lost one (live replacement).
    replacement: Optional[bool] = None

    @property
    def fires_in(self) -> str:
        """The section whose start fires it (nan, spike, bitflip: the
        optimizer section, once the grads are reduced; router_nan: the
        forward pass)."""
        if self.kind == FaultKind.router_nan:
            return "forward_backward"
        return self.section or ("optimizer" if self.kind in STEP_FAULT_KINDS else "data")

    @property
    def every_attempt(self) -> bool:
        return bool(self.persistent)

    def lasts_at(self, step: int) -> bool:
        """A spike with `steps`: due on every attempt of `step`."""
        return self.steps is not None and self.step <= step < self.step + self.steps

    @property
    def hang_mode(self) -> HangMode:
        return self.mode or HangMode.sleep

    @property
    def slow_seconds(self) -> float:
        return float(1.0 if self.seconds is None else self.seconds)

    @property
    def restarts_needed(self) -> int:
        return self.generation or 0

    @property
    def loss_scale(self) -> float:
        return float(10.0 if self.scale is None else self.scale)

    @property
    def flip_target(self) -> FlipTarget:
        return self.target or FlipTarget.param

    @property
    def flip_seed(self) -> int:
        return self.step if self.seed is None else self.seed

    def to_dict(self) -> dict[str, Any]:
        """The mapping a recipe writes: the fields given, enums as their values."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


FAULT_KEYS = {f.name for f in dataclasses.fields(FaultSpec)}
FAULT_KINDS = tuple(kind.value for kind in FaultKind)
HANG_MODES = tuple(mode.value for mode in HangMode)
FLIP_TARGETS = tuple(target.value for target in FlipTarget)
# The fields only one kind reads.
KIND_FIELDS = {"persistent": FaultKind.nan, "scale": FaultKind.spike, "steps": FaultKind.spike,
               "target": FaultKind.bitflip, "seed": FaultKind.bitflip, "bit": FaultKind.bitflip}


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def parse_fault(fault: Union[FaultSpec, Mapping[str, Any]], key: str) -> FaultSpec:
    """`fault` checked and typed; `key` (`faults[i]`) names it in an error.
    A FaultSpec is checked as the mapping it stands for (it may have been
    edited, or built in code)."""
    data = fault.to_dict() if isinstance(fault, FaultSpec) else fault
    check_fault(data, key)
    if isinstance(fault, FaultSpec):
        return fault
    mode, target = data.get("mode"), data.get("target")
    return FaultSpec(**{**data, "kind": FaultKind(data["kind"]),
                        "mode": None if mode is None else HangMode(mode),
                        "target": None if target is None else FlipTarget(target)})


def parse_faults(faults: Iterable[Union[FaultSpec, Mapping[str, Any]]]) -> list[FaultSpec]:
    return [parse_fault(fault, f"faults[{i}]") for i, fault in enumerate(faults)]


def check_fault(fault: Any, key: str) -> None:
    """Every rule of one fault's mapping, as `ConfigError`s naming the field."""
    require(isinstance(fault, Mapping), key, "must be a mapping.",
            "write {kind: kill, rank: 0, step: 5}.")
    unknown = set(fault) - FAULT_KEYS
    require(not unknown, key, f"unknown field(s) {sorted(unknown)}.",
            f"use only {sorted(FAULT_KEYS)}.")
    require(fault.get("kind") in FAULT_KINDS, f"{key}.kind",
            f"{fault.get('kind')!r} is not a fault kind.", f"use one of {list(FAULT_KINDS)}.")
    for field_name in ("rank", "step"):
        require(isinstance(fault.get(field_name), int) and fault[field_name] >= 0,
                f"{key}.{field_name}", "is required and must be an integer >= 0.",
                f"add {field_name}: N.")
    seconds = fault.get("seconds", 0)
    require(isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
            and NON_NEGATIVE.admits(seconds), f"{key}.seconds",
            f"must be a number >= 0, got {seconds!r}.", "give seconds: N (e.g. 0.5).")
    require(isinstance(fault.get("generation", 1), int) and fault.get("generation", 1) >= 1,
            f"{key}.generation", "must be an integer >= 1 (restarts seen before it fires).",
            "write generation: 1 for the first restart, or leave it out.")
    require(fault.get("section", "data") in SECTIONS, f"{key}.section",
            f"{fault.get('section')!r} is not a section.", f"use one of {list(SECTIONS)}.")
    for flag in ("persistent", "replacement"):
        require(fault.get(flag) in (None, True, False), f"{key}.{flag}",
                f"must be true or false, got {fault.get(flag)!r}.", f"write {flag}: true.")
    for name, kind in KIND_FIELDS.items():
        require(name not in fault or fault.get("kind") == kind.value, f"{key}.{name}",
                f"applies to kind {kind.value} only.", f"drop it, or use kind: {kind.value}.")
    scale = fault.get("scale", 10.0)
    require(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
            f"{key}.scale", f"must be a number > 0, got {scale!r}.", "write scale: 10.")
    require(fault.get("target", "param") in FLIP_TARGETS, f"{key}.target",
            f"{fault.get('target')!r} is not a bit-flip target.",
            f"use one of {list(FLIP_TARGETS)}.")
    for name, low, high in (("seed", 0, 2**63 - 1), ("bit", 0, 31), ("steps", 1, 10**9)):
        value = fault.get(name, low)
        require(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high,
                f"{key}.{name}", f"must be an integer in [{low}, {high}], got {value!r}.",
                f"write {name}: {low}.")
    require(fault.get("mode", "sleep") in HANG_MODES, f"{key}.mode",
            f"{fault.get('mode')!r} is not a hang mode.", f"use one of {list(HANG_MODES)}.")
