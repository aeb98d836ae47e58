"""Per-step metrics: `metrics.jsonl` (the contract), the trackers (TensorBoard,
W&B, MLflow) and the console (a progress bar, or a plain line every
log_interval steps). Only the logging rank writes.

Each step record gains the figures of observe/flops.py for the batch it
trained (its `global_batch_size`): `tflops` (model TFLOP/s per device) and
`mfu` (tflops / the device's peak)."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from megaresil.config import LoggingConfig, Precision, RecipeConfig, to_dict
from megaresil.events import repair_prefix
from megaresil.fencing import Fence
from megaresil.observe.flops import achieved_tflops, flops_per_sample
from megaresil.observe.loggers import build_loggers
from megaresil.observe.memory import peak_memory_mb
from megaresil.observe.peak import cached_peak_tflops
from megaresil.safe_files import open_nofollow
from megaresil.terminal import draws_bars


@dataclass
class StepFigures:
    """What turns a step's time and global batch into TFLOP/s and MFU."""
    flops_per_sample: int
    devices: int
    peak_tflops: Optional[float]
    device: torch.device

    @classmethod
    def for_recipe(cls, cfg: RecipeConfig, device: torch.device) -> "StepFigures":
        return cls(flops_per_sample(cfg), cfg.parallel.world_size, peak_tflops(cfg, device),
                   device)

    def of(self, step_time_s: float, global_batch: int) -> dict[str, float]:
        tflops = achieved_tflops(self.flops_per_sample * global_batch, step_time_s, self.devices)
        figures = {"tflops": tflops, "mem_peak_mb": peak_memory_mb(self.device)}
        if self.peak_tflops:
            figures["mfu"] = tflops / self.peak_tflops
        return figures


def peak_tflops(cfg: RecipeConfig, device: torch.device) -> float:
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops
    bf16 = cfg.train.precision == Precision.bf16 or (cfg.train.precision == Precision.auto
                                                      and device.type == "cuda")
    return cached_peak_tflops(Path(cfg.data.cache_dir) / "peak_tflops.json", device,
                              torch.bfloat16 if bf16 else torch.float32)


def console_line(record: dict[str, Any], total_steps: int) -> str:
    """step, loss, lr, grad norm, tok/s, MFU, step time; a mixture of
    experts adds its worst layer's busiest expert over the mean load."""
    mfu = f"{100 * record['mfu']:.2f}%" if "mfu" in record else "-"
    moe = f" | moe max/mean {record['moe_imbalance']:.2f}" if "moe_imbalance" in record else ""
    return (f"step {record['step']}/{total_steps} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.2e} | grad norm {record['grad_norm']:.3f} | "
            f"{record['tokens_per_s']:,.0f} tok/s | MFU {mfu} | "
            f"step {record.get('step_time_s', 0.0):.3f} s{moe}")


class Console:
    """A progress bar on a terminal that can draw one (terminal.draws_bars);
    otherwise (or with logging.progress false) a plain line every
    log_interval steps and at the last step."""

    def __init__(self, cfg: LoggingConfig, total_steps: int, start_step: int):
        self.total, self.interval = total_steps, cfg.log_interval
        self.bar: Optional[tqdm] = (tqdm(total=total_steps, initial=start_step, unit="step",
                                         dynamic_ncols=True)
                                    if cfg.progress and draws_bars(sys.stderr) else None)

    def show(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if "eval_loss" in record:
            self._print(f"step {step}: eval_loss {record['eval_loss']:.4f}")
        elif self.bar is not None:
            mfu = f"{100 * record['mfu']:.2f}%" if "mfu" in record else "-"
            postfix = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}",
                       "tok_s": f"{record['tokens_per_s']:.0f}", "mfu": mfu}
            if "moe_imbalance" in record:
                postfix["moe_max_mean"] = f"{record['moe_imbalance']:.2f}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(step - self.bar.n)
        elif step % self.interval == 0 or step == self.total:
            self._print(console_line(record, self.total))

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsLog:
    def __init__(self, run_dir: str | Path, cfg: RecipeConfig, figures: StepFigures, *,
                 start_step: int, generation: int = 0, fence: Optional[Fence] = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.generation = generation  # on every row: a redone step shows in which generation
        self.fence = fence
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open_nofollow(self.path)
        self.file.write(repair_prefix(self.file.fileno()))  # a torn last line stays alone
        self.figures = figures
        self.loggers = build_loggers(Path(run_dir), cfg.logging, to_dict(cfg))
        self.console = Console(cfg.logging, cfg.train.steps, start_step)

    def write(self, record: dict[str, Any]) -> None:
        """One JSON line per record; floats keep full precision (json uses repr)."""
        if "step_time_s" in record:
            record.update(self.figures.of(record["step_time_s"], record["global_batch_size"]))
        record.setdefault("generation", self.generation)
        if self.fence is not None:
            self.fence.check(f"the metrics row of step {record['step']}")
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for logger in self.loggers:
            logger.log(record, record["step"])
        self.console.show(record)

    def close(self) -> None:
        self.file.close()
        for logger in self.loggers:
            logger.close()
        self.console.close()
