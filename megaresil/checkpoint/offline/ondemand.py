"""A tensor whose data is produced when it is serialised, and dropped after.

DCP's FileSystemWriter plans a save from shapes and dtypes, then asks its
planner for each item's data as it writes it (`lookup_object`) and pickles it
with `torch.save`. It also keeps a reference to every tensor it wrote until
the file is closed, and a single-process save is one file: handed plain
tensors, it would hold the whole checkpoint in memory. Handed an
`OnDemandTensor`, it holds only this placeholder; the data exists while
`torch.save` pickles it, which is what keeps an offline DCP save streamed.
"""
from __future__ import annotations

from typing import Callable

import torch

from megaresil.compat import make_wrapper_subclass, tree_map_only

# What DCP does to an item before saving it; none of it needs the data.
_METADATA_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


class OnDemandTensor(torch.Tensor):
    """A CPU tensor of `shape` and `dtype` whose values come from `produce()`
    (a fresh, compact tensor) each time they are needed."""

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, produce: Callable[[], torch.Tensor]):
        return make_wrapper_subclass(cls, shape, dtype, "cpu")

    def __init__(self, shape: torch.Size, dtype: torch.dtype,
                 produce: Callable[[], torch.Tensor]) -> None:
        self.produce = produce

    def __reduce_ex__(self, protocol):
        # Pickled as the plain tensor it stands for, so the file holds
        # ordinary tensor data that any reader (weights_only) loads.
        return self.produce().__reduce_ex__(protocol)

    # torch's stub gives Tensor.__torch_dispatch__ as a plain function; the
    # protocol (and torch's own subclasses) define it as a classmethod.
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is torch.ops.aten.is_pinned.default:
            return False
        if func in _METADATA_OPS:
            return args[0]
        # Anything else computes on the values: produce them. Still correct,
        # only no longer streamed (the streaming test would notice).
        args, kwargs = tree_map_only(OnDemandTensor, lambda t: t.produce(), (args, kwargs or {}))
        return func(*args, **kwargs)
