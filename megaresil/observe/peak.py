"""Peak TFLOP/s of one device, the denominator of MFU: given by the user
(`logging.peak_tflops`, e.g. a datasheet figure) or measured once by a short
matmul probe and cached per kind of device, dtype and thread count.

A measured peak is what dense matmuls reach on this device with this rank's
threads: a fair ceiling on a CPU, where no datasheet figure applies, and a
little under the datasheet on a GPU (so MFU reads a little high there: set
peak_tflops to compare with published MFU figures).
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Optional

import torch

from megaresil.safe_files import write_atomic

PROBE_SECONDS = 0.5


def device_kind(device: torch.device, dtype: torch.dtype) -> str:
    """What the peak depends on: the device model, the dtype and, on CPU,
    the threads a rank may use."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    return f"{device.type}:{name}:{str(dtype).removeprefix('torch.')}"


def probe_tflops(device: torch.device, dtype: torch.dtype, seconds: float = PROBE_SECONDS,
                 size: Optional[int] = None) -> float:
    """Best rate of square matmuls over about `seconds` of trying."""
    n = size or (8192 if device.type == "cuda" else 1024)
    # Random operands, as training's are (constant ones switch fewer bits: a
    # GPU runs them faster, so the peak read high and MFU low), drawn from a
    # generator of their own so the training RNG does not move.
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn((n, n), generator=generator, device=device, dtype=dtype)
            for _ in range(2))
    torch.matmul(a, b)  # warm-up: kernel choice, allocation
    clock = busy_seconds(device)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        sync(device)
        started = clock()
        for _ in range(4):
            torch.matmul(a, b)
        sync(device)
        best = max(best, 4 * 2 * n**3 / max(clock() - started, 1e-9) / 1e12)
    return best


def busy_seconds(device: torch.device):
    """The probe's clock. A GPU: wall time. A CPU: the process's CPU time over
    its threads, so that a machine busy with other work at probe time does not
    lower the peak (the steps' own times do show that load, in MFU)."""
    if device.type == "cuda":
        return time.perf_counter
    threads = torch.get_num_threads()
    return lambda: time.process_time() / threads


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cached_peak_tflops(cache: Path, device: torch.device, dtype: torch.dtype) -> float:
    """The probe's figure for this kind of device, measured at most once per cache."""
    kind = device_kind(device, dtype)
    known = read_cache(cache)
    if kind not in known:
        known[kind] = probe_tflops(device, dtype)
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache, json.dumps(known, indent=1))  # concurrent runs: each writes whole files
    return known[kind]


def read_cache(cache: Path) -> dict:
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
