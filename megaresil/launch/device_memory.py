"""The memory of this node's GPUs, read without initialising CUDA in the
launcher (a CUDA context here would hold memory the workers need, and a
forked worker could not use it): NVML through nvidia-ml-py where it is
installed, else `nvidia-smi`, else unknown."""
from __future__ import annotations

import shutil
import subprocess
from typing import Callable, Optional

# The reader the pre-flight takes: the smallest visible GPU's bytes, or None.
DeviceMemoryReader = Callable[[], Optional[int]]


def read_device_memory() -> Optional[int]:
    """The total memory of the smallest GPU this node shows, in bytes; None
    when neither NVML nor nvidia-smi answers (the check is then skipped)."""
    return nvml_memory() or nvidia_smi_memory()


def nvml_memory() -> Optional[int]:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            totals = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
                      for i in range(count)]
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return min(totals) if totals else None


def nvidia_smi_memory() -> Optional[int]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        mib = [int(line) for line in out.split() if line.strip().isdigit()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(mib) * 2**20 if mib else None
