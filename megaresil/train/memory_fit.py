"""Whether a recipe's layout fits its devices, and the layout changes at the
same world size that would: the launcher's memory check before any worker
starts (launch/preflight.py). See docs/clusters.md ("Memory before launch").
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

from megaresil.config import ConfigError, RecipeConfig, Recompute, validate
from megaresil.plan.memory import HEADROOM, mib, usable
from megaresil.train.memory_census import estimate, layout_line

# Alternatives tried before giving up (each is an estimate: seconds for a
# large model's stage), and how many that fit are named.
MAX_TRIED = 12
MAX_NAMED = 3

Change = dict[str, Any]  # dotted recipe key -> value


def peak_bytes(cfg: RecipeConfig, device_type: str = "cuda") -> int:
    return max(rank.peak for rank in estimate(cfg, device_type))


def memory_refusal(cfg: RecipeConfig, device_bytes: int) -> Optional[str]:
    """None when the estimated peak of every rank fits `device_bytes` with
    its headroom; else one line: the estimate, the device, and the changes
    (at the same world size) that fit."""
    peak = peak_bytes(cfg)
    if peak <= usable(device_bytes):
        return None
    fits = fitting_changes(cfg, usable(device_bytes))
    advice = ("; fits with: " + " | ".join(fits)) if fits else \
        "; no tp/pp/dp split, recomputation, ZeRO-1 or micro-batch size at this world size fits"
    return (f"{layout_line(cfg)} needs an estimated {mib(peak)} on its fullest rank, above "
            f"{HEADROOM:.0%} of the device's {mib(device_bytes)} "
            f"({mib(usable(device_bytes))}){advice} (megaresil plan --memory shows each rank)")


def fitting_changes(cfg: RecipeConfig, limit: int) -> list[str]:
    """The first alternatives whose peak fits `limit`, as override lists;
    one that changes every key of an alternative already named is skipped."""
    found: list[Change] = []
    for tried, change in enumerate(candidates(cfg)):
        if tried >= MAX_TRIED or len(found) >= MAX_NAMED:
            break
        if any(fit.keys() <= change.keys() for fit in found):
            continue
        changed = apply(cfg, change)
        if changed is not None and peak_bytes(changed) <= limit:
            found.append(change)
    return [" ".join(f"{key}={value}" for key, value in change.items()) for change in found]


def candidates(cfg: RecipeConfig) -> Iterator[Change]:
    """Less memory, one knob first: more recomputation, ZeRO-1, full
    sharding (parallel.dp_shard), smaller micro-batches; then every other tp x pp x dp split of the same world,
    alone and with full recomputation and ZeRO-1."""
    p = cfg.parallel
    savings: Change = {}
    now = list(Recompute).index(cfg.model.recompute)
    for level in list(Recompute)[now + 1:]:
        yield {"model.recompute": level.value}
    if cfg.model.recompute != Recompute.full:
        savings["model.recompute"] = Recompute.full.value
    if p.dp > 1 and not cfg.optimizer.distributed:
        yield {"optimizer.distributed": "true"}
        savings["optimizer.distributed"] = "true"
    if p.dp > 1 and p.dp_shard < p.dp:  # FSDP2 over every data-parallel rank (refused where
        yield {"parallel.dp_shard": p.dp, "optimizer.distributed": "false"}  # it does not compose)
    mbs = cfg.train.micro_batch_size // 2
    while mbs >= 1:
        yield {"train.micro_batch_size": mbs}
        mbs //= 2
    world = p.tp * p.pp * p.dp
    splits = [{"parallel.tp": tp, "parallel.pp": pp, "parallel.dp": world // tp // pp}
              for tp in divisors(world) for pp in divisors(world // tp) if (tp, pp) != (p.tp, p.pp)]
    yield from splits
    for split in splits:
        yield dict(split, **savings)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def apply(cfg: RecipeConfig, change: Change) -> Optional[RecipeConfig]:
    """`cfg` with `change`, or None where the recipe's rules refuse it."""
    for key, value in change.items():
        cfg = _replaced(cfg, key.split("."), value)
    try:
        validate(cfg)
    except ConfigError:
        return None
    return cfg


def _replaced(node: Any, path: list[str], value: Any) -> Any:
    field = path[0]
    if len(path) > 1:
        value = _replaced(getattr(node, field), path[1:], value)
    else:
        kind = type(getattr(node, field))
        value = value == "true" if kind is bool else kind(value)
    return dataclasses.replace(node, **{field: value})
