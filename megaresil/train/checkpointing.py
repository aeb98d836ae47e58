"""What the training loop saves and restores, which checkpoint it resumes
from (restart-from-latest), and the weights a new run starts from
(checkpoint.init_from): `TrainCheckpointing` is the trainer's one face onto
checkpointing, owning the global tier and the local tier as peers.
docs/architecture.md ("The checkpoint face")."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.hf.io import hf_model_keys, hf_source, is_hf_directory
from megaresil.checkpoint.hf.mapping import model_differences
from megaresil.checkpoint.local.replication import Choice, Topology, ranks_per_node
from megaresil.checkpoint.local.tier import LocalTier
from megaresil.checkpoint.location import NoValidCheckpoint
from megaresil.checkpoint.manager import Checkpointer
from megaresil.checkpoint.megatron.arguments import model_keys as megatron_model_keys
from megaresil.checkpoint.megatron.directory import is_megatron_checkpoint
from megaresil.checkpoint.megatron.reading import MegatronTensorSource, open_megatron
from megaresil.checkpoint.paths import RunPaths
from megaresil.checkpoint.sources import CheckpointSource
from megaresil.checkpoint.state import TrainingState
from megaresil.checkpoint.validation import read_manifest
from megaresil.config import ModelConfig, RecipeConfig, model_from_dict
from megaresil.fencing import Fence
from megaresil.parallel.layout import ParallelLayout
from megaresil.run_identity import run_id
from megaresil.train.handover import Carried, LivePlan, recover_live


def build_tiers(cfg: RecipeConfig, paths: RunPaths, events, watchdog=None, *,
                device: torch.device, fence: Optional[Fence] = None,
                local_world: Optional[int] = None) -> tuple[Checkpointer, Optional[LocalTier]]:
    """The global tier and, if enabled, the local tier of a recipe, each on
    a process group of its own (made in this order on every rank)."""
    group = checkpoint_group(cfg, watchdog)
    local = None
    if cfg.checkpoint.local.enabled:  # its own group too: it saves beside the global tier
        local = build_local_tier(cfg, paths, events, checkpoint_group(cfg, watchdog), device,
                                 fence, local_world)
    return Checkpointer(paths.checkpoint_root, cfg.checkpoint.backend.value, group=group,
                        asynchronous=cfg.checkpoint.async_, keep=cfg.checkpoint.keep,
                        events=events, device=device, fence=fence), local


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


def build_local_tier(cfg: RecipeConfig, paths: RunPaths, events,
                     group: Optional[dist.ProcessGroup], device: torch.device,
                     fence: Optional[Fence] = None,
                     local_world: Optional[int] = None) -> LocalTier:
    """The local tier over the recipe's nodes: `local_world` ranks a node
    (the launcher's LOCAL_WORLD_SIZE, None outside one) unless the recipe
    says (checkpoint.local.ranks_per_node)."""
    local = cfg.checkpoint.local
    world = dist.get_world_size() if group is not None else 1
    per_node = ranks_per_node(local.ranks_per_node, world, local_world)
    paths.check()
    # The run's id is drawn here at its first start (ranks racing agree on one).
    return LocalTier(paths.local_root, run_id(paths.run_dir),
                     Topology(world, per_node, local.replicas), group=group,
                     interval=local.interval, keep=local.keep, events=events, device=device,
                     fence=fence)


def candidates(load: str, root: Path, job_started: float) -> list[Path]:
    """Checkpoints to try, newest first, per checkpoint.load (`load`) under
    the checkpoint root. `none` and a PATH say where the job starts: once it
    has saved, its restarts resume from what it saved since `job_started`
    (a restart that went back to PATH, or to nothing, would lose those steps)."""
    if load == "auto":
        return fmt.committed_checkpoints(root)
    return [*saved_since(root, job_started), *([] if load == "none" else [Path(load)])]


def saved_since(root: Path, started: float) -> list[Path]:
    """The checkpoints committed under `root` since `started`, newest first."""
    return [path for path in fmt.committed_checkpoints(root)
            if (path / fmt.MARKER).is_file() and (path / fmt.MARKER).stat().st_mtime >= started]


def step_of(path: Path) -> Optional[int]:
    found = fmt.STEP_DIR.match(path.name)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class Loaded:
    """What resume read, for the start-up line: its phase name and, for a
    global checkpoint, its bytes (of a local step rank 0 knows only its own
    shard, so a rate from it would mislead)."""
    phase: str
    nbytes: Optional[int]


class TrainCheckpointing:
    """One trainer's checkpoints: saving its `state` through the global tier
    and the local tier (None: off), held as peers, resuming from the newest
    state every rank can recover, and starting a new run from other weights.
    Events go out from rank 0."""

    def __init__(self, cfg: RecipeConfig, global_tier: Checkpointer,
                 local_tier: Optional[LocalTier], state: TrainingState, events, rank: int,
                 job_started: float):
        self.cfg, self.global_tier, self.local_tier = cfg, global_tier, local_tier
        self.state, self.events, self.rank = state, events, rank
        self.job_started = job_started  # when the launcher (or torchrun) started the job

    @classmethod
    def build(cls, cfg: RecipeConfig, state: TrainingState, events, *, watchdog,
              device: torch.device, fence: Optional[Fence], rank: int,
              job_started: float, local_world: Optional[int] = None) -> TrainCheckpointing:
        """Both tiers of a recipe (build_tiers) over a trainer's `state`."""
        global_tier, local_tier = build_tiers(cfg, RunPaths.of(cfg), events, watchdog,
                                              device=device, fence=fence,
                                              local_world=local_world)
        return cls(cfg, global_tier, local_tier, state, events, rank, job_started)

    @property
    def root(self) -> Path:
        """The global checkpoint root."""
        return self.global_tier.root

    def emit(self, event: str, **fields) -> None:
        if self.rank == 0:
            self.events.emit(event, **fields)

    # --- saving -----------------------------------------------------------------

    def save(self) -> None:
        """Checkpoint the trainer's state at its current step (global tier)."""
        self.global_tier.save_training(self.state)

    def local_due(self, step: int) -> bool:
        """Called once after each step: whether the local tier saves now."""
        return self.local_tier is not None and self.local_tier.due(step)

    def save_local(self, step: int) -> None:
        """Save to the local tier (when local_due says so: never without one)."""
        assert self.local_tier is not None
        self.local_tier.save(self.state, step)

    def before_update(self) -> None:
        """Call before the optimizer step changes the saved tensors: each
        tier's save in flight releases the loop first (local, then global)."""
        if self.local_tier is not None:
            self.local_tier.before_update()
        self.global_tier.before_update()

    def wait(self) -> None:
        """Wait for both tiers' saves in flight (global, then local)."""
        self.global_tier.wait()
        if self.local_tier is not None:
            self.local_tier.wait()

    def finish(self) -> None:
        """The run finished: with a global checkpoint of its last step
        (checkpoint.interval not 0), the local shards are released."""
        if self.local_tier is not None and self.cfg.checkpoint.interval != 0:
            self.local_tier.remove_all()

    def close(self) -> None:
        """Finish the saves in flight (local, then global) and stop both tiers."""
        if self.local_tier is not None:
            self.local_tier.close()
        self.global_tier.close()

    def abandon(self) -> None:
        """The job failed (see BackgroundSaves.abandon): the newest committed
        checkpoint stands, and the partial directory of the save in flight is
        cleaned at the next start. Global tier first, then local."""
        self.global_tier.abandon()
        if self.local_tier is not None:
            self.local_tier.abandon()

    # --- resuming ---------------------------------------------------------------

    def candidates(self) -> list[Path]:
        return candidates(self.cfg.checkpoint.load, self.root, self.job_started)

    def choose(self, newer_than: Optional[int] = None,
               skipped: Optional[list] = None) -> Optional[tuple[Path, dict]]:
        """The newest global checkpoint that passes (marker, manifest,
        checksums); each one skipped is reported with its reason (and added to
        `skipped`). With `newer_than` (a recoverable local step) only newer ones
        are tried, and finding none valid is no error: the local step serves."""
        skipped = [] if skipped is None else skipped
        for path in self.candidates():
            if newer_than is not None and (step_of(path) or 0) <= newer_than:
                break
            try:
                manifest = read_manifest(path)
                reason = self.global_tier.verify(path, manifest)
            except fmt.CheckpointError as err:
                reason = str(err)
            if reason is None:
                return path, manifest
            skipped.append((path, reason))
            self.emit("checkpoint_skipped", path=str(path), reason=reason)
        if newer_than is not None:
            return None
        load = self.cfg.checkpoint.load
        if load not in ("auto", "none"):
            raise NoValidCheckpoint(f"checkpoint.load={load}: {skipped[0][1]}")
        if skipped:
            listing = "; ".join(f"{p.name}: {r}" for p, r in skipped)
            raise NoValidCheckpoint(
                f"checkpoints exist under {self.root} but none is valid ({listing}). "
                "Fix: move the bad ones away, or set checkpoint.load=none to start from scratch.")
        return None

    def find_local(self) -> tuple[Optional[Choice], str]:
        """Collective over the local tier: the newest local step every rank can
        recover (None when there is none, or the tier is not consulted) and, if
        none, why."""
        load = self.cfg.checkpoint.load
        if self.local_tier is None:
            return None, "the local tier is off (checkpoint.local.enabled=false)"
        if load != "auto":
            return None, f"checkpoint.load={load} names what to load"
        choice = self.local_tier.find(self.state.layout_record())
        if choice.step is None:
            return None, "; ".join(choice.skipped) or "no local step is held"
        return choice, ""

    def start(self, carried: Optional[Carried], live: Optional[LivePlan],
              layout: ParallelLayout) -> Optional[Loaded]:
        """A generation's state: with live replacement on (`live`: the plan
        the ranks gathered), from the ranks' memory when it holds the newest
        step the job completed (the generation after a lost process), else
        restart-from-latest."""
        if live is None:
            return self.resume()
        if live.corrupted:
            self.emit("silent_corruption_detected", step=live.newest, culprit=live.corrupted,
                      how="hand-over", next="a proven replica's state replaces it" if live.serves
                      else "the job resumes from the checkpoints")
        if not live.serves:
            return self.resume(why_not_live=live.why_not)
        self.clean_partials()
        saved = recover_live(self.state, carried, live, self.rank, layout.device)
        self._loaded(saved, None, "live", {"checkpoints": f"the ranks' memory holds step "
                                           f"{saved.step}; no checkpoint is newer"},
                     from_peers={o: h for o, h in live.sources.items() if o != h},
                     bytes_moved=live.bytes_moved)
        if self.local_tier is not None:
            self.local_tier.discard_after(saved.step)
            self.local_tier.check_space(self.state)
        return Loaded("state from live peers", None)

    def newest_saved_step(self) -> int:
        """Collective: the step of the newest global checkpoint committed
        under the root (0: none), the oldest any rank sees."""
        newest = next((step_of(path) or 0 for path in fmt.committed_checkpoints(
            self.root) if (path / fmt.MARKER).is_file()), 0)
        return min(self.global_tier.coll.all_gather(newest))

    def clean_partials(self) -> None:
        """Saves left half-written by a failure are removed (rank 0), before
        any rank saves again."""
        if self.rank == 0:
            root = self.root
            for name in fmt.clean_partials(root):
                self.emit("checkpoint_skipped", path=str(root / name),
                          reason="incomplete save removed at start-up")
        self.global_tier.barrier()

    def resume(self, why_not_live: str = "") -> Optional[Loaded]:
        """Restart-from-latest across both tiers: the newest state every rank
        can recover, a global checkpoint (at whatever layout it was saved from:
        the rects reshard it) or a local step (same layout only), logged with
        the tier and why the others were not used. Returns what was loaded,
        or None."""
        self.clean_partials()
        live = {"live": why_not_live} if why_not_live else {}
        local, why_not_local = self.find_local()
        skipped_global: list = []
        chosen = self.choose(newer_than=local.step if local else None, skipped=skipped_global)
        if chosen is not None:
            path, manifest = chosen
            saved = self.global_tier.load_training(path, manifest, self.state)
            if local is not None:
                why_not_local = f"local step {local.step} is older than global step {saved.step}"
            self._loaded(saved, path, "global", {"local": why_not_local, **live})
            found = Loaded("checkpoint load", fmt.data_bytes(manifest))
        elif local is not None and self.local_tier is not None:  # a choice is the tier's
            saved = self.local_tier.recover(local, self.state)
            path = self.local_tier.store.shard_dir(saved.step, self.rank)
            self._loaded(saved, path, "local",
                         {"global": self.why_not_global(skipped_global, saved.step), **live},
                         from_replicas=sorted(o for o, h in local.sources.items() if o != h))
            found = Loaded("checkpoint load from the local tier", None)
        else:
            saved, found = None, None
            # Nothing of this run's own to resume: a new run, from other weights if asked.
            if self.cfg.checkpoint.init_from:
                self.initialize_from(Path(self.cfg.checkpoint.init_from))
        if self.local_tier is not None:
            self.local_tier.discard_after(saved.step if saved else None)
            self.local_tier.check_space(self.state)
        return found

    def why_not_global(self, skipped: list, local_step: int) -> str:
        reasons = [f"{p.name}: {r}" for p, r in skipped]
        newest = next((s for p in self.candidates() if (s := step_of(p)) is not None), None)
        if newest is None:
            reasons.append("no global checkpoint")
        elif newest <= local_step:
            reasons.append(f"newest global step {newest} is not newer than local step "
                           f"{local_step}")
        return "; ".join(reasons)

    def _loaded(self, saved, path: Optional[Path], tier: str, skipped: dict, **extra) -> None:
        self.emit("checkpoint_loaded", step=saved.step, path=str(path) if path else None,
                  saved_layout=saved.layout, layout=self.state.layout_record(), tier=tier,
                  skipped=skipped, **extra)

    # --- checkpoint.init_from: a new run from other weights ---------------------

    def initialize_from(self, path: Path) -> None:
        """Start a new run from the weights at `path` (any layout): step 0, a
        fresh optimizer and data from the start, unless init_from_optimizer
        takes a full checkpoint's optimizer state, step and data position too."""
        source, manifest = self._init_source(path)
        with_optimizer = self.cfg.checkpoint.init_from_optimizer
        saved_layout: Optional[dict]
        if with_optimizer:
            saved = self.global_tier.load_training(path, manifest, self.state)
            step, saved_layout = saved.step, saved.layout
        else:
            self.global_tier.load_weights(source, self.state)
            step, saved_layout = 0, manifest["layout"] if manifest else None
        self.emit("initialized_from", path=str(path), step=step,
                  source=("checkpoint" if manifest else
                          "megatron" if is_megatron_checkpoint(path) else "hugging_face"),
                  optimizer=with_optimizer, saved_layout=saved_layout,
                  layout=self.state.layout_record())

    def _init_source(self, path: Path):
        """The weights to start from, checked against this run's model."""
        ours = self.cfg.model
        if is_hf_directory(path):
            if self.cfg.checkpoint.init_from_optimizer:
                raise fmt.CheckpointError(f"checkpoint.init_from={path} is a Hugging Face model, "
                                          "which has no optimizer state. Fix: drop "
                                          "checkpoint.init_from_optimizer.")
            model_keys, _ = hf_model_keys(path)
            _require_same_model(path, model_from_dict(model_keys), ours)
            return hf_source(path, ours), None
        if is_megatron_checkpoint(path):
            return _megatron_source(path, ours, self.cfg.checkpoint.init_from_optimizer), None
        try:
            source = CheckpointSource(path)
        except fmt.CheckpointError as err:
            raise fmt.CheckpointError(f"checkpoint.init_from={path}: {err}. Fix: give a "
                                      "committed checkpoint (RUN/checkpoints/step_N) or a Hugging "
                                      "Face model directory.") from None
        reason = self.global_tier.verify(path, source.manifest)
        if reason:
            raise fmt.CheckpointError(f"checkpoint.init_from={path} is corrupt: {reason}. Fix: "
                                      "start from an earlier checkpoint.")
        _require_same_model(path, model_from_dict(source.manifest["recipe"]["model"]), ours)
        if self.cfg.checkpoint.init_from_optimizer and source.manifest.get("weights_only"):
            raise fmt.CheckpointError(f"checkpoint.init_from={path} holds weights only, so "
                                      "checkpoint.init_from_optimizer has no optimizer state to "
                                      "take. Fix: drop init_from_optimizer, or give a full "
                                      "checkpoint.")
        return source, source.manifest


def _megatron_source(path: Path, ours: ModelConfig, with_optimizer: bool):
    """A Megatron checkpoint's weights, checked against this run's model."""
    ckpt = open_megatron(path)
    if with_optimizer:
        carried = ckpt.carried()
        fix = (f"convert it first (megaresil convert --from-megatron {path} DST) and start "
               "from DST" if carried.moments else
               f"drop checkpoint.init_from_optimizer ({carried.note})")
        raise fmt.CheckpointError(f"checkpoint.init_from={path} is a Megatron checkpoint, "
                                  "whose optimizer state a run takes from its import only. "
                                  f"Fix: {fix}.")
    if ckpt.args is not None:
        saved = megatron_model_keys(ckpt.args, [])
        saved["vocab_size"] = ours.vocab_size  # the run's real vocabulary cuts Megatron's padding
        _require_same_model(path, model_from_dict(saved), ours)
    return MegatronTensorSource(ckpt, ours)


def _require_same_model(path: Path, saved: ModelConfig, ours: ModelConfig) -> None:
    differences = model_differences(saved, ours)
    if differences:
        raise fmt.CheckpointError(
            f"checkpoint.init_from={path} holds a different model: {'; '.join(differences)}. "
            "Fix: set model.* as the source has it (megaresil train --from-hf DIR takes them "
            "from a Hugging Face config.json).")
