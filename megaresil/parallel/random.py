"""Layout-independent randomness, and capture/restore of the per-rank RNG state.

Dropout masks are a pure function of (seed, global sample index, site): each
sample's mask is drawn for the full, unsharded activation from a generator
seeded by those three, then this rank keeps its slice (its sequence shard
under sequence parallelism, its heads under tensor parallelism). So dropout is
identical for every tp/dp/pp layout, a recomputed forward redraws the same
mask, and resuming needs no dropout RNG state at all.
"""
from __future__ import annotations

import base64
import random
import zlib
from typing import Callable, Optional, cast

import numpy as np
import torch
import torch.nn as nn

Slicer = Callable[[torch.Tensor], torch.Tensor]


def site_seed(seed: int, sample: int, site: str) -> int:
    return (seed * 0x9E3779B1 + sample * 0x85EBCA77 + zlib.crc32(site.encode())) % (2**63)


class LayoutDropout(nn.Module):
    """Dropout whose mask does not depend on the parallel layout.

    `full_shape` gives the unsharded per-sample shape for a local per-sample
    shape; `local_slice` cuts this rank's part out of a full per-sample mask.
    """

    def __init__(self, p: float, site: str, seed: int,
                 full_shape: Callable[[torch.Size], torch.Size] = lambda s: s,
                 local_slice: Slicer = lambda m: m):
        super().__init__()
        self.p, self.site, self.seed = p, site, seed
        self.full_shape, self.local_slice = full_shape, local_slice

    def mask(self, samples: torch.Tensor, local_shape: torch.Size,
             device: torch.device) -> torch.Tensor:
        shape = self.full_shape(local_shape)
        masks = []
        for sample in samples.tolist():
            generator = torch.Generator().manual_seed(site_seed(self.seed, sample, self.site))
            keep = torch.rand(shape, generator=generator) >= self.p
            masks.append(self.local_slice(keep))
        return torch.stack(masks).to(device)

    def forward(self, x: torch.Tensor, samples: Optional[torch.Tensor]) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if samples is None:
            raise ValueError(f"dropout at {self.site} needs the global sample indices of the batch")
        keep = self.mask(samples, x.shape[1:], x.device)
        return x * keep.to(x.dtype) / (1.0 - self.p)


def _bytes_to_text(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _text_to_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng_state() -> dict:
    """This rank's global RNG states (python, numpy, torch CPU and CUDA), as
    JSON-safe values. Dropout does not draw from them (see LayoutDropout);
    they are kept so that any other use of the global RNGs resumes exactly."""
    version, internal, gauss = random.getstate()
    # numpy's stub types the no-argument call as the new dict form; it returns
    # the legacy tuple (legacy=True is the default).
    name, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float],
                                              np.random.get_state())
    state = {"python": [version, list(internal), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": _bytes_to_text(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_bytes_to_text(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_text_to_bytes(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_text_to_bytes(s) for s in state["cuda"]])
