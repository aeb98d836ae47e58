"""What the training loop saves and restores, and which checkpoint it
resumes from (restart-from-latest)."""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.location import NoValidCheckpoint, checkpoint_root
from megaresil.checkpoint.manager import Checkpointer
from megaresil.config import RecipeConfig


def build_checkpointer(cfg: RecipeConfig, events, watchdog=None, *,
                       device: torch.device) -> Checkpointer:
    # A group of its own (gloo even under NCCL: checkpoint traffic is small
    # metadata), so async saves never interleave with training collectives,
    # and with the checkpoint budget as its timeout whatever section runs.
    group = None
    if dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=timedelta(
            seconds=cfg.resilience.watchdog.checkpoint_timeout_s))
        if watchdog is not None:
            watchdog.exempt_group(group)
    return Checkpointer(checkpoint_root(cfg), cfg.checkpoint.backend.value, group=group,
                        asynchronous=cfg.checkpoint.async_, keep=cfg.checkpoint.keep,
                        events=events, device=device)


def save(trainer) -> None:
    """Checkpoint the trainer's state at its current step."""
    trainer.checkpointer.save_training(trainer.checkpoint_state)


def candidates(trainer) -> list[Path]:
    """Checkpoints to try, newest first, per checkpoint.load."""
    load = trainer.cfg.checkpoint.load
    root = trainer.checkpointer.root
    if load == "none":
        return []
    if load != "auto":
        return [Path(load)]
    return fmt.committed_checkpoints(root)


def choose(trainer) -> Optional[tuple[Path, dict]]:
    """The newest checkpoint that passes (marker, manifest, checksums); each
    one skipped is reported with its reason."""
    skipped = []
    for path in candidates(trainer):
        try:
            manifest = fmt.read_manifest(path)
            reason = trainer.checkpointer.verify(path, manifest)
        except fmt.CheckpointError as err:
            reason = str(err)
        if reason is None:
            return path, manifest
        skipped.append((path, reason))
        if trainer.layout.rank == 0:
            trainer.events.emit("checkpoint_skipped", path=str(path), reason=reason)
    if trainer.cfg.checkpoint.load not in ("auto", "none"):
        raise NoValidCheckpoint(f"checkpoint.load={trainer.cfg.checkpoint.load}: {skipped[0][1]}")
    if skipped:
        listing = "; ".join(f"{p.name}: {r}" for p, r in skipped)
        raise NoValidCheckpoint(
            f"checkpoints exist under {trainer.checkpointer.root} but none is valid ({listing}). "
            "Fix: move the bad ones away, or set checkpoint.load=none to start from scratch.")
    return None


def resume(trainer) -> None:
    """Restart-from-latest: load the chosen checkpoint into the trainer, at
    whatever layout it was saved from (the rects reshard it)."""
    if trainer.layout.rank == 0:
        removed = fmt.clean_partials(trainer.checkpointer.root)
        for name in removed:
            trainer.events.emit("checkpoint_skipped", path=str(trainer.checkpointer.root / name),
                                reason="incomplete save removed at start-up")
    trainer.checkpointer.barrier()
    chosen = choose(trainer)
    if chosen is None:
        return
    path, manifest = chosen
    saved = trainer.checkpointer.load_training(path, manifest, trainer.checkpoint_state)
    if trainer.layout.rank == 0:
        trainer.events.emit("checkpoint_loaded", step=saved.step, path=str(path),
                            saved_layout=saved.layout,
                            layout=trainer.checkpoint_state.layout_record())
