"""Health checks before a node joins the job (docs/clusters.md#health-checks).

Each node's agent checks its own node before it joins the rendezvous: on a
node with GPUs, every visible device through NVML (nvidia-ml-py); anywhere,
the recipe's command (`resilience.health.command`). A node that fails is
excluded from the run: a file of its own under RUN_DIR/excluded_nodes/ says
why and since when, so that a relaunch, a Slurm requeue or a second agent on
that host does not admit it again until a person deletes the file.

NVML cannot tell Xid errors that happened before it was asked (they arrive
only as events to a process that registered for them); what they leave
behind, uncorrectable ECC errors, retired pages and failed row remaps, is
what is read here."""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megaresil.config import ConfigError, HealthConfig
from megaresil.safe_files import own_dir, write_atomic

EXCLUDED_DIR = "excluded_nodes"


@dataclass
class Failure:
    """Why a node failed its check, and which check said so."""
    check: str  # "nvml" or "command"
    reason: str


def nvml_problems(nvml: Any, gpus_needed: int, max_temperature_c: float) -> list[str]:
    """What NVML finds wrong with this node's devices (`nvml`: the pynvml
    module, initialized), each naming the device."""
    count = nvml.nvmlDeviceGetCount()
    problems = [] if count >= gpus_needed else [
        f"{count} GPU(s) visible to NVML, {gpus_needed} needed"]
    for index in range(count):
        device = nvml.nvmlDeviceGetHandleByIndex(index)
        problems += [f"GPU {index}: {problem}" for problem in
                     device_problems(nvml, device, max_temperature_c)]
    return problems


def device_problems(nvml: Any, device: Any, max_temperature_c: float) -> list[str]:
    problems = []
    ecc = optional(nvml, lambda: nvml.nvmlDeviceGetTotalEccErrors(
        device, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))
    if ecc:
        problems.append(f"{ecc} uncorrectable ECC error(s) since the driver loaded")
    if optional(nvml, lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(device)):
        problems.append("memory pages wait to be retired (a reset is due)")
    remap = optional(nvml, lambda: nvml.nvmlDeviceGetRemappedRows(device))
    if remap and remap[3]:  # (corrected, uncorrected, pending, failure occurred)
        problems.append("a memory row could not be remapped")
    temperature = nvml.nvmlDeviceGetTemperature(device, nvml.NVML_TEMPERATURE_GPU)
    if temperature >= max_temperature_c:
        problems.append(f"{temperature} C, at or over resilience.health.max_temperature_c="
                        f"{max_temperature_c:g}")
    return problems


def optional(nvml: Any, read):
    """A reading some devices do not support (no ECC on consumer parts, row
    remapping from Ampere on): None there, not a failure."""
    try:
        return read()
    except nvml.NVMLError_NotSupported:
        return None


def command_problem(command: str, timeout_s: float) -> Optional[str]:
    """The command's verdict: None when it exits 0, else its last line of
    output (or its exit code) as the reason. It runs in a process group of
    its own, killed whole when it returns or runs out of time: nothing it
    started outlives the check (a spare checks every interval)."""
    with subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"`{command}` did not finish within resilience.health.timeout_s={timeout_s:g}"
        finally:
            with contextlib.suppress(ProcessLookupError):  # none of the group is left
                os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode == 0:
        return None
    # Whatever bytes it printed (a locale's, a binary's): the reason is for a person.
    lines = (out + err).decode(errors="replace").strip().splitlines()
    said = f": {lines[-1][:300]}" if lines else ""
    return f"`{command}` exited with {proc.returncode}{said}"


def check_node(cfg: HealthConfig, gpus: int, gpus_needed: int) -> Optional[Failure]:
    """This node's first failed check, or None when it is fit to join."""
    if cfg.gpu and gpus > 0:
        import pynvml  # nvidia-ml-py: only where there are GPUs to ask about

        pynvml.nvmlInit()
        try:
            problems = nvml_problems(pynvml, gpus_needed, cfg.max_temperature_c)
        finally:
            pynvml.nvmlShutdown()
        if problems:
            return Failure("nvml", "; ".join(problems))
    if cfg.command:
        problem = command_problem(cfg.command, cfg.timeout_s)
        if problem:
            return Failure("command", problem)
    return None


class Exclusions:
    """The nodes excluded from a run, one file each under RUN_DIR/excluded_nodes/.
    The file is what excludes its node: one that cannot be read still does."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / EXCLUDED_DIR

    def path(self, host: str) -> Path:
        return self.dir / f"{host}.json"

    def record(self, host: str, failure: Failure) -> None:
        own_dir(self.dir)  # a planted link there would take the record anywhere
        write_atomic(self.path(host), json.dumps({"host": host, "check": failure.check,
                                                  "reason": failure.reason,
                                                  "time": time.time()}))

    def of(self, host: str) -> Optional[str]:
        """Why `host` is excluded ("at TIME (CHECK check: REASON)", or why
        its record cannot be read), or None when it is not."""
        if self.dir.exists() and not self.dir.is_dir():
            raise ConfigError("run.dir", f"{self.dir} is not a directory: megaresil keeps a "
                              "file per excluded node there.", f"remove {self.dir}.")
        try:
            raw = self.path(host).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:  # a directory in its place, no permission
            return f"(its record cannot be read: {err.strerror})"
        return said_by(raw)


def said_by(raw: bytes) -> str:
    """What an exclusion record says, or that it cannot be read and why."""
    try:
        record = json.loads(raw)
    except ValueError:
        return "(its record cannot be read: not JSON)"
    if not isinstance(record, dict):
        return "(its record cannot be read: not a JSON object)"
    check, reason, when = record.get("check"), record.get("reason"), record.get("time")
    if not (isinstance(check, str) and isinstance(reason, str)):
        return "(its record cannot be read: no check and reason)"
    try:
        if not isinstance(when, (int, float)) or isinstance(when, bool) or not math.isfinite(when):
            raise TypeError
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    except (TypeError, ValueError, OverflowError, OSError):  # not a time this host can show
        return f"at an unreadable time ({check} check: {reason[:300]})"
    return f"at {since} ({check} check: {reason[:300]})"


def admission_refusal(cfg: HealthConfig, run_dir: Path, gpus: int, gpus_needed: int,
                      events, host: Optional[str] = None) -> Optional[str]:
    """None when this node may join the run; else the line that says why
    not: excluded before, or failing its check now (then excluded)."""
    host = host or socket.gethostname()
    return (excluded_before(run_dir, host)
            or exclusion_after_check(cfg, run_dir, gpus, gpus_needed, events, host))


def excluded_before(run_dir: Path, host: str) -> Optional[str]:
    """The line that says `host` was excluded from this run, or None."""
    exclusions = Exclusions(run_dir)
    why = exclusions.of(host)
    if why is None:
        return None
    return (f"node {host} was excluded from this run {why}; after repairing it, delete "
            f"{exclusions.path(host)} to admit it again")


def exclusion_after_check(cfg: HealthConfig, run_dir: Path, gpus: int, gpus_needed: int,
                          events, host: Optional[str] = None) -> Optional[str]:
    """Check this node now: None when it is fit; else it is excluded (a
    file of its own, a `node_excluded` event) and the line says why."""
    host = host or socket.gethostname()
    failure = check_node(cfg, gpus, gpus_needed)
    if failure is None:
        return None
    exclusions = Exclusions(run_dir)
    exclusions.record(host, failure)
    events.emit("node_excluded", host=host, check=failure.check, reason=failure.reason)
    return (f"node {host} failed its health check ({failure.check}: {failure.reason}) and is "
            f"excluded from this run: it will not rejoin until {exclusions.path(host)} is "
            "deleted")


def has_checks(cfg: HealthConfig, gpus: int) -> bool:
    """Whether a check would ask anything on this node."""
    return bool(cfg.command) or (cfg.gpu and gpus > 0)
