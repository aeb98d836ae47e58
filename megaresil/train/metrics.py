"""Per-step metrics: `metrics.jsonl` (the contract), TensorBoard scalars and a
console progress bar. Only the logging rank writes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from megaresil.config import LoggingConfig


class MetricsLog:
    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, *, total_steps: int,
                 start_step: int):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a")
        self.tb = self._tensorboard(Path(run_dir) / "tb") if cfg.tensorboard else None
        self.bar: Optional[tqdm] = (tqdm(total=total_steps, initial=start_step, unit="step",
                                         dynamic_ncols=True) if cfg.progress else None)

    @staticmethod
    def _tensorboard(path: Path):
        # Imported here: tensorboard costs ~1 s and only the logging rank needs it.
        from torch.utils.tensorboard import SummaryWriter
        return SummaryWriter(str(path))

    def write(self, record: dict[str, Any]) -> None:
        """One JSON line per record; floats keep full precision (json uses repr)."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        if self.tb is not None:
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(name, value, step)
        if self.bar is not None and "loss" in record:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            self.bar.update(step - self.bar.n)
        elif self.bar is not None and "eval_loss" in record:
            self.bar.write(f"step {step}: eval_loss {record['eval_loss']:.4f}")

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()
