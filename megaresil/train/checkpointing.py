"""What the training loop saves and restores, which checkpoint it resumes
from (restart-from-latest), and the weights a new run starts from
(checkpoint.init_from)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.local_tier import LocalTier, local_root as local_dir_of
from megaresil.checkpoint.location import NoValidCheckpoint, checkpoint_root
from megaresil.checkpoint.hf import model_differences
from megaresil.checkpoint.hf_io import hf_model_keys, hf_source, is_hf_directory
from megaresil.checkpoint.manager import Checkpointer
from megaresil.checkpoint.replication import Choice, Topology, ranks_per_node
from megaresil.checkpoint.sources import CheckpointSource
from megaresil.config import ConfigError, ModelConfig, RecipeConfig, model_from_dict


def build_checkpointer(cfg: RecipeConfig, events, watchdog=None, *,
                       device: torch.device) -> Checkpointer:
    group = checkpoint_group(cfg, watchdog)
    local = None
    if cfg.checkpoint.local.enabled:  # its own group too: it saves beside the global tier
        local = build_local_tier(cfg, events, checkpoint_group(cfg, watchdog), device)
    return Checkpointer(checkpoint_root(cfg), cfg.checkpoint.backend.value, group=group,
                        asynchronous=cfg.checkpoint.async_, keep=cfg.checkpoint.keep,
                        events=events, device=device, local=local)


def checkpoint_group(cfg: RecipeConfig, watchdog) -> Optional[dist.ProcessGroup]:
    # A group of its own (gloo even under NCCL: checkpoint traffic is small
    # metadata), so async saves never interleave with training collectives,
    # and with the checkpoint budget as its timeout whatever section runs.
    if not dist.is_initialized():
        return None
    group = dist.new_group(backend="gloo", timeout=timedelta(
        seconds=cfg.resilience.watchdog.checkpoint_timeout_s))
    if watchdog is not None:
        watchdog.exempt_group(group)
    return group


def local_root(cfg: RecipeConfig) -> Path:
    """checkpoint.local.dir, refused inside the global checkpoint root: the
    local tier never writes there."""
    root = local_dir_of(cfg.checkpoint.local.dir, cfg.run.dir)
    shared = checkpoint_root(cfg).resolve()
    if root.resolve() == shared or shared in root.resolve().parents:
        raise ConfigError("checkpoint.local.dir", f"{root} lies inside the global checkpoint "
                          f"root {shared}.", "point it at node-local storage (or leave it null "
                          "for /dev/shm/megaresil/<run id>).")
    return root


def build_local_tier(cfg: RecipeConfig, events, group: Optional[dist.ProcessGroup],
                     device: torch.device) -> LocalTier:
    local = cfg.checkpoint.local
    world = dist.get_world_size() if group is not None else 1
    per_node = ranks_per_node(local.ranks_per_node, world, os.environ.get("LOCAL_WORLD_SIZE"))
    return LocalTier(local_root(cfg), Topology(world, per_node, local.replicas), group=group,
                     interval=local.interval, keep=local.keep, events=events, device=device)


def save(trainer) -> None:
    """Checkpoint the trainer's state at its current step."""
    trainer.checkpointer.save_training(trainer.checkpoint_state)


def save_local(trainer) -> None:
    trainer.checkpointer.save_local(trainer.checkpoint_state, trainer.state.step)


def candidates(trainer) -> list[Path]:
    """Checkpoints to try, newest first, per checkpoint.load."""
    load = trainer.cfg.checkpoint.load
    root = trainer.checkpointer.root
    if load == "none":
        return []
    if load != "auto":
        return [Path(load)]
    return fmt.committed_checkpoints(root)


def step_of(path: Path) -> Optional[int]:
    found = fmt.STEP_DIR.match(path.name)
    return int(found.group(1)) if found else None


def choose(trainer, newer_than: Optional[int] = None,
           skipped: Optional[list] = None) -> Optional[tuple[Path, dict]]:
    """The newest global checkpoint that passes (marker, manifest,
    checksums); each one skipped is reported with its reason (and added to
    `skipped`). With `newer_than` (a recoverable local step) only newer ones
    are tried, and finding none valid is no error: the local step serves."""
    skipped = [] if skipped is None else skipped
    for path in candidates(trainer):
        if newer_than is not None and (step_of(path) or 0) <= newer_than:
            break
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
    if newer_than is not None:
        return None
    if trainer.cfg.checkpoint.load not in ("auto", "none"):
        raise NoValidCheckpoint(f"checkpoint.load={trainer.cfg.checkpoint.load}: {skipped[0][1]}")
    if skipped:
        listing = "; ".join(f"{p.name}: {r}" for p, r in skipped)
        raise NoValidCheckpoint(
            f"checkpoints exist under {trainer.checkpointer.root} but none is valid ({listing}). "
            "Fix: move the bad ones away, or set checkpoint.load=none to start from scratch.")
    return None


def find_local(trainer) -> tuple[Optional[Choice], str]:
    """Collective over the local tier: the newest local step every rank can
    recover (None when there is none, or the tier is not consulted) and, if
    none, why."""
    local, load = trainer.checkpointer.local, trainer.cfg.checkpoint.load
    if local is None:
        return None, "the local tier is off (checkpoint.local.enabled=false)"
    if load != "auto":
        return None, f"checkpoint.load={load} names what to load"
    choice = local.find(trainer.checkpoint_state.layout_record())
    if choice.step is None:
        return None, "; ".join(choice.skipped) or "no local step is held"
    return choice, ""


@dataclass(frozen=True)
class Loaded:
    """What resume read, for the start-up line: its phase name and, for a
    global checkpoint, its bytes (of a local step rank 0 knows only its own
    shard, so a rate from it would mislead)."""
    phase: str
    nbytes: Optional[int]


def resume(trainer) -> Optional[Loaded]:
    """Restart-from-latest across both tiers: the newest state every rank
    can recover, a global checkpoint (at whatever layout it was saved from:
    the rects reshard it) or a local step (same layout only), logged with the
    tier and why the other was not used. Returns what was loaded, or None."""
    if trainer.layout.rank == 0:
        removed = fmt.clean_partials(trainer.checkpointer.root)
        for name in removed:
            trainer.events.emit("checkpoint_skipped", path=str(trainer.checkpointer.root / name),
                                reason="incomplete save removed at start-up")
    trainer.checkpointer.barrier()
    local, why_not_local = find_local(trainer)
    skipped_global: list = []
    chosen = choose(trainer, newer_than=local.step if local else None, skipped=skipped_global)
    if chosen is not None:
        path, manifest = chosen
        saved = trainer.checkpointer.load_training(path, manifest, trainer.checkpoint_state)
        if local is not None:
            why_not_local = f"local step {local.step} is older than global step {saved.step}"
        loaded(trainer, saved, path, "global", {"local": why_not_local})
        found = Loaded("checkpoint load", fmt.data_bytes(manifest))
    elif local is not None:
        saved = trainer.checkpointer.local.recover(local, trainer.checkpoint_state)
        path = trainer.checkpointer.local.store.shard_dir(saved.step, trainer.layout.rank)
        loaded(trainer, saved, path, "local", {"global": why_not_global(trainer, skipped_global,
                                                                        saved.step)},
               from_replicas=sorted(o for o, h in local.sources.items() if o != h))
        found = Loaded("checkpoint load from the local tier", None)
    else:
        saved, found = None, None
        # Nothing of this run's own to resume: a new run, from other weights if asked.
        if trainer.cfg.checkpoint.init_from:
            initialize_from(trainer, Path(trainer.cfg.checkpoint.init_from))
    if trainer.checkpointer.local is not None:
        trainer.checkpointer.local.discard_after(saved.step if saved else None)
        trainer.checkpointer.local.check_space(trainer.checkpoint_state)
    return found


def why_not_global(trainer, skipped: list, local_step: int) -> str:
    reasons = [f"{p.name}: {r}" for p, r in skipped]
    newest = next((s for p in candidates(trainer) if (s := step_of(p)) is not None), None)
    if newest is None:
        reasons.append("no global checkpoint")
    elif newest <= local_step:
        reasons.append(f"newest global step {newest} is not newer than local step {local_step}")
    return "; ".join(reasons)


def loaded(trainer, saved, path: Path, tier: str, skipped: dict, **extra) -> None:
    if trainer.layout.rank == 0:
        trainer.events.emit("checkpoint_loaded", step=saved.step, path=str(path),
                            saved_layout=saved.layout,
                            layout=trainer.checkpoint_state.layout_record(), tier=tier,
                            skipped=skipped, **extra)


def finish(trainer) -> None:
    """The run finished: with a global checkpoint of its last step
    (checkpoint.interval not 0), the local shards are released."""
    if trainer.checkpointer.local is not None and trainer.cfg.checkpoint.interval != 0:
        trainer.checkpointer.local.remove_all()


# --- checkpoint.init_from: a new run from other weights ---------------------------


def _require_same_model(path: Path, saved: ModelConfig, ours: ModelConfig) -> None:
    differences = model_differences(saved, ours)
    if differences:
        raise fmt.CheckpointError(
            f"checkpoint.init_from={path} holds a different model: {'; '.join(differences)}. "
            "Fix: set model.* as the source has it (megaresil train --from-hf DIR takes them "
            "from a Hugging Face config.json).")


def _init_source(trainer, path: Path):
    """The weights to start from, checked against this run's model."""
    ours = trainer.cfg.model
    if is_hf_directory(path):
        if trainer.cfg.checkpoint.init_from_optimizer:
            raise fmt.CheckpointError(f"checkpoint.init_from={path} is a Hugging Face model, "
                                      "which has no optimizer state. Fix: drop "
                                      "checkpoint.init_from_optimizer.")
        model_keys, _ = hf_model_keys(path)
        _require_same_model(path, model_from_dict(model_keys), ours)
        return hf_source(path, ours), None
    try:
        source = CheckpointSource(path)
    except fmt.CheckpointError as err:
        raise fmt.CheckpointError(f"checkpoint.init_from={path}: {err}. Fix: give a committed "
                                  "checkpoint (RUN/checkpoints/step_N) or a Hugging Face model "
                                  "directory.") from None
    reason = trainer.checkpointer.verify(path, source.manifest)
    if reason:
        raise fmt.CheckpointError(f"checkpoint.init_from={path} is corrupt: {reason}. Fix: "
                                  "start from an earlier checkpoint.")
    _require_same_model(path, model_from_dict(source.manifest["recipe"]["model"]), ours)
    if trainer.cfg.checkpoint.init_from_optimizer and source.manifest.get("weights_only"):
        raise fmt.CheckpointError(f"checkpoint.init_from={path} holds weights only, so "
                                  "checkpoint.init_from_optimizer has no optimizer state to take. "
                                  "Fix: drop init_from_optimizer, or give a full checkpoint.")
    return source, source.manifest


def initialize_from(trainer, path: Path) -> None:
    """Start a new run from the weights at `path` (any layout): step 0, a
    fresh optimizer and data from the start, unless init_from_optimizer
    takes a full checkpoint's optimizer state, step and data position too."""
    source, manifest = _init_source(trainer, path)
    with_optimizer = trainer.cfg.checkpoint.init_from_optimizer
    if with_optimizer:
        saved = trainer.checkpointer.load_training(path, manifest, trainer.checkpoint_state)
        step, saved_layout = saved.step, saved.layout
    else:
        trainer.checkpointer.load_weights(source, trainer.checkpoint_state)
        step, saved_layout = 0, manifest["layout"] if manifest else None
    if trainer.layout.rank == 0:
        trainer.events.emit("initialized_from", path=str(path), step=step,
                            source="checkpoint" if manifest else "hugging_face",
                            optimizer=with_optimizer, saved_layout=saved_layout,
                            layout=trainer.checkpoint_state.layout_record())
