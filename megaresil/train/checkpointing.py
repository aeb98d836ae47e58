"""What the training loop saves and restores, and which checkpoint it
resumes from (restart-from-latest)."""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.location import NoValidCheckpoint, checkpoint_root
from megaresil.checkpoint.manager import Checkpointer
from megaresil.checkpoint.sharded import (adam_step_count, set_adam_step_count,
                                          training_rects)
from megaresil.config import RecipeConfig, to_dict
from megaresil.parallel.random import capture_rng_state, restore_rng_state
from megaresil.train.optim import lr_at


def build_checkpointer(cfg: RecipeConfig, events, watchdog=None) -> Checkpointer:
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
                        events=events)


def layout_record(trainer) -> dict:
    return {**trainer.layout.describe(), "distributed_optimizer": trainer.sharded_optimizer}


def save(trainer) -> None:
    """Checkpoint the trainer's state at its current step."""
    state = trainer.state
    manifest_state = {
        "step": state.step,
        "layout": layout_record(trainer),
        "data": {"consumed_samples": state.consumed_samples},
        "optimizer": {"adam_step": adam_step_count(trainer),
                      "hyper": to_dict(trainer.cfg)["optimizer"]},
        "lr_schedule": {"lr": lr_at(max(state.step, 1), trainer.cfg.optimizer,
                                    trainer.cfg.train.steps),
                        "total_steps": trainer.cfg.train.steps},
        "recipe": to_dict(trainer.cfg),
    }
    watchdog = trainer.supervision.watchdog
    if watchdog is not None:  # so a restart does not recalibrate from zero
        manifest_state["watchdog"] = watchdog.calibration()
    trainer.checkpointer.save(state.step, training_rects(trainer), manifest_state,
                              rank_state=capture_rng_state())


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
    trainer.checkpointer.coll.barrier()
    chosen = choose(trainer)
    if chosen is None:
        return
    path, manifest = chosen
    if manifest.get("weights_only"):
        raise fmt.CheckpointError(
            f"{path} holds weights only (no optimizer state), so training cannot resume from "
            "it exactly. Fix: convert it again without --weights-only, or start a new run from "
            "it as initial weights (not supported yet).")
    trainer.checkpointer.load(path, manifest, training_rects(trainer, include_copies=True))
    set_adam_step_count(trainer, manifest["optimizer"]["adam_step"])
    trainer.state.step = manifest["step"]
    trainer.state.consumed_samples = manifest["data"]["consumed_samples"]
    if trainer.supervision.watchdog is not None and "watchdog" in manifest:
        trainer.supervision.watchdog.restore_calibration(manifest["watchdog"])
    same_layout = manifest["layout"] == layout_record(trainer)
    rank_states = manifest.get("rank_states") or []
    if same_layout and len(rank_states) == trainer.layout.world_size:
        # per-rank RNG streams only mean something on the same ranks
        restore_rng_state(rank_states[trainer.layout.rank])
    if trainer.layout.rank == 0:
        trainer.events.emit("checkpoint_loaded", step=manifest["step"], path=str(path),
                            saved_layout=manifest["layout"], layout=layout_record(trainer))
