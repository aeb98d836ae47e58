"""Experiment trackers behind one interface: TensorBoard, Weights & Biases and
MLflow. Only the logging rank builds them. W&B and MLflow are optional
packages: enabling one that is not installed is an error naming the fix (no
silent fallback). A restart continues the same W&B / MLflow run: the run id
is kept in the run directory."""
from __future__ import annotations

import importlib
import uuid
from pathlib import Path
from typing import Any, Protocol

from megaresil.config import ConfigError, LoggingConfig
from megaresil.safe_files import LinkRefused, own_dir, write_atomic


class Logger(Protocol):
    def log(self, record: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def optional_package(name: str, key: str, install: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(key, f"is on but {name} is not installed.",
                          f"`pip install {install}`, or set {key}=false.") from None


def kept_run_id(run_dir: Path, name: str, new) -> str:
    """The id stored in run_dir/name, or a new one stored there."""
    path = run_dir / name
    if path.is_symlink():  # its content would go to the tracker's server
        raise LinkRefused(path)
    if path.exists():
        return path.read_text().strip()
    run_id = new()
    write_atomic(path, run_id)
    return run_id


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        # Imported here: tensorboard costs ~1 s and only the logging rank needs it.
        from torch.utils.tensorboard import SummaryWriter
        # The library opens its files itself: the directory at least is the run's own.
        self.writer = SummaryWriter(str(own_dir(run_dir / "tb")))

    def log(self, record: dict[str, Any], step: int) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, config: dict):
        wandb = optional_package("wandb", "logging.wandb.enabled", "wandb")
        w = cfg.wandb
        run_id = kept_run_id(run_dir, "wandb_run_id", lambda: uuid.uuid4().hex[:16])
        self.run = wandb.init(project=w.project, entity=w.entity, name=w.name or run_dir.name,
                              id=run_id, resume="allow", dir=str(run_dir), mode=w.mode,
                              config=config, settings=wandb.Settings(console="off"))

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, config: dict):
        mlflow = optional_package("mlflow", "logging.mlflow.enabled", "mlflow-skinny")
        m = cfg.mlflow
        self.client = mlflow.MlflowClient(tracking_uri=m.tracking_uri)
        run_id = kept_run_id(run_dir, "mlflow_run_id", lambda: self._new_run(m.experiment,
                                                                             run_dir, config))
        self.run_id = run_id
        self.client.update_run(run_id, status="RUNNING")  # a restart continues it

    def _new_run(self, experiment: str | None, run_dir: Path, config: dict) -> str:
        name = experiment or "Default"
        found = self.client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found else self.client.create_experiment(name)
        run = self.client.create_run(experiment_id, run_name=run_dir.name)
        for key, value in flatten(config).items():
            self.client.log_param(run.info.run_id, key, str(value)[:500])
        return run.info.run_id

    def log(self, record: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric
        now = int(1000 * record.get("time", 0))
        metrics = [Metric(k, float(v), now, step) for k, v in scalars(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def build_loggers(run_dir: Path, cfg: LoggingConfig, config: dict) -> list[Logger]:
    """The enabled trackers; `config` (the resolved recipe) goes to those that keep one."""
    loggers: list[Logger] = []
    if cfg.tensorboard:
        loggers.append(TensorBoardLogger(run_dir))
    if cfg.wandb.enabled:
        loggers.append(WandbLogger(run_dir, cfg, config))
    if cfg.mlflow.enabled:
        loggers.append(MlflowLogger(run_dir, cfg, config))
    return loggers


