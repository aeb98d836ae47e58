"""`megaresil ckpt diff A B`: two checkpoints compared tensor by tensor,
whatever their layouts and backends.

Each key is read from both as its full global tensor (a batch of keys in
memory at a time, through each backend's resharding read) and compared bit
for bit, and as max absolute / max relative difference.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from megaresil.checkpoint.sources import CheckpointSource, full_tensors


@dataclass
class KeyDiff:
    key: str
    identical: bool  # same dtype, shape and bytes
    within: bool  # within the tolerances (identical when none are given)
    max_abs: float = float("nan")
    max_rel: float = float("nan")
    problem: str = ""  # why the values could not be compared


@dataclass
class DiffReport:
    keys: list[KeyDiff] = field(default_factory=list)
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b) and all(k.identical for k in self.keys)

    @property
    def within(self) -> bool:
        return not (self.only_in_a or self.only_in_b) and all(k.within for k in self.keys)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def compare(key: str, a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> KeyDiff:
    """How `a` differs from `b`; `within` as torch.allclose(a, b, rtol, atol)."""
    if a.shape != b.shape:
        return KeyDiff(key, False, False, problem=f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)):
        return KeyDiff(key, True, True, 0.0, 0.0)
    problem = "" if a.dtype == b.dtype else f"dtype {a.dtype} vs {b.dtype}"
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    a, b = a.to(dtype), b.to(dtype)
    delta = (a - b).abs()
    within = bool(torch.all(delta <= atol + rtol * b.abs()))
    rel = (delta / torch.maximum(a.abs(), b.abs())).nan_to_num(nan=0.0)  # 0/0: both zero
    return KeyDiff(key, False, within, delta.max().item(), rel.max().item(), problem)


def diff_checkpoints(a: Path, b: Path, *, atol: float = 0.0, rtol: float = 0.0) -> DiffReport:
    """Compare every tensor key of checkpoints `a` and `b` (CheckpointError
    when either is not a committed checkpoint)."""
    source_a, source_b = CheckpointSource(a), CheckpointSource(b)
    keys_a, keys_b = set(source_a.tensors), set(source_b.tensors)
    report = DiffReport(only_in_a=sorted(keys_a - keys_b), only_in_b=sorted(keys_b - keys_a))
    common = sorted(keys_a & keys_b)
    for (key, tensor_a), (_, tensor_b) in zip(full_tensors(source_a, common),
                                              full_tensors(source_b, common)):
        report.keys.append(compare(key, tensor_a, tensor_b, atol, rtol))
    return report


def format_report(report: DiffReport, tolerances: Optional[tuple[float, float]] = None) -> str:
    """The tensors that are not identical (and the keys one side lacks), then
    a summary line; identical tensors are counted, not listed."""
    differing = [k for k in report.keys if not k.identical]
    width = max((len(k.key) for k in differing), default=0)
    lines = []
    for k in differing:
        verdict = "within" if k.within else "DIFFERENT"
        detail = f"  {k.problem}" if k.problem else ""
        lines.append(f"{k.key:<{width}}  max_abs={k.max_abs:.3e}  max_rel={k.max_rel:.3e}  "
                     f"{verdict}{detail}")
    lines += [f"only in A: {key}" for key in report.only_in_a]
    lines += [f"only in B: {key}" for key in report.only_in_b]
    summary = (f"{len(report.keys)} common tensors, {len(report.keys) - len(differing)} "
               f"identical, {len(differing)} not identical, "
               f"{len(report.only_in_a)} only in A, {len(report.only_in_b)} only in B")
    if tolerances is not None:
        summary += f"; within atol={tolerances[0]:g} rtol={tolerances[1]:g}: {report.within}"
    return "\n".join(lines + [summary])
