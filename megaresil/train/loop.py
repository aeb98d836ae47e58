"""The training loop: `Trainer` builds one rank's part of the job (data,
model chunks, optimizer, grad buffers, checkpointer) and `run` trains it to
train.steps, one method per part of a step (data, forward_backward,
optimizer), saving and evaluating between steps."""
# mypy: ignore-errors
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megaresil.config import FP8, Precision, RecipeConfig, microbatches_per_step, resolved_schedule, to_yaml
from megaresil.data import build_datasets
from megaresil.data.sampler import collate, micro_batches, skip_past
from megaresil.events import EventLog
from megaresil.parallel.data_parallel import all_reduce_sequence_parallel_grads
from megaresil.parallel.grad_groups import GroupedGrads, Held, grad_groups, shards_over_dp
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.pipeline import Pipeline, sync_tied_embedding_grads
from megaresil.resilience.supervision import Supervision
from megaresil.safe_files import write_atomic
from megaresil.train import checkpointing, story
from megaresil.observe.goodput import write_goodput
from megaresil.observe.startup import StartupPhases, process_times
from megaresil.observe.profiler import StepProfiler
from megaresil.observe.sections import record_fields
from megaresil.train.metrics import MetricsLog, StepFigures
from megaresil.train.numerics import NumericsGuard, StepResult
from megaresil.train.replicas import ReplicaCheck
from megaresil.train.optim import (build_optimizer, clip_gradients, counted_here, group_parts,
                                   local_grad_norm_squared, lr_at, reduce_grad_norm, set_lr,
                                   shards_state)
from megaresil.train.precision import (ComputeContext, MainParams, logits_dtype,
                                       optimizer_params, resolve,
                                       shard_main_params)
from megaresil.train.progress import Progress
from megaresil.train.save_schedule import SaveSchedule
from megaresil.train.state import LiveTrainingState, configured_skips
from megaresil.train.handover import (Carried, carried_state, donated_tensors,
                                      plan_live_start)
from megaresil.train.model_build import build_model, checkpoint_key_map, make_deterministic


def dp_mean(value: torch.Tensor, layout: ParallelLayout) -> float:
    """Mean of a scalar over data-parallel ranks, as a Python float."""
    if layout.dp > 1:
        value = value.clone()
        dist.all_reduce(value, group=layout.group("dp"))
        value /= layout.dp
    return value.item()


class Trainer:
    def __init__(self, cfg: RecipeConfig, layout: ParallelLayout,
                 supervision: Optional[Supervision] = None):
        self.cfg, self.layout = cfg, layout
        self.supervision = supervision or Supervision()
        self.run_dir = Path(cfg.run.dir)
        self.events = EventLog(self.run_dir, layout.rank)
        phases = StartupPhases(self.events, layout.rank)
        live = plan_live_start(cfg, self.supervision.carried, layout)
        with phases.phase("data, model and optimizer build"):
            # A state taken from the ranks' memory overwrites every value drawn.
            self.build(cfg, layout, draw=not (live and live.serves))
        started = phases.clock.monotonic()
        loaded = self.checkpointing.start(self.supervision.carried, live, layout)
        self.supervision.carried = None  # loaded: its memory goes back
        if loaded is not None:
            phases.finished(loaded.phase, phases.clock.monotonic() - started, loaded.nbytes)
        self.saves = SaveSchedule(cfg, self.state.step, events=self.events, rank=layout.rank,
                                  last_saved=self.checkpointing.newest_saved_step()
                                  if live and live.serves else None)
        self.numerics = NumericsGuard(cfg, layout, self.state, self.checkpointing, self.events,
                                      self.supervision.section)
        self.replicas = ReplicaCheck(cfg.resilience.numerics.check_interval, layout,
                                     self.replicated_state, self.events,
                                     lambda step, reason: self.numerics.rollback(step, reason, []),
                                     self.supervision.section,
                                     donated=(lambda: donated_tensors(self.checkpoint_state))
                                     if live and live.replicated else None,
                                     agreement=live.agreement(layout.rank) if live else None)

    def build(self, cfg: RecipeConfig, layout: ParallelLayout, draw: bool = True) -> None:
        """Data, model chunks, optimizer, grad buffers and checkpoints; the
        model's initial values are drawn unless `draw` is False (a load
        certain to overwrite them follows)."""
        make_deterministic(cfg, layout.device)
        self.train_data, self.valid_data, _ = build_datasets(
            cfg.data, cfg.model.vocab_size, cfg.train.seed, need_valid=cfg.train.eval_batches > 0)
        self.chunks = build_model(cfg, layout, draw=draw)
        self.checkpoint_key = checkpoint_key_map(cfg)
        self.model = torch.nn.ModuleList(self.chunks)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.precision = resolve(cfg.train.precision, layout.device)
        bf16 = self.precision == Precision.bf16
        # The fp32 main weights: whole copies here, or under ZeRO-1 only this
        # DP rank's rows, which the distributed optimizer keeps.
        self.main = MainParams(self.params) if bf16 and not shards_over_dp(cfg.optimizer, layout) \
            else None
        # What the optimizer steps, grads are reduced on and checkpoints hold.
        self.opt_params = optimizer_params(self.params, self.main)
        fp8 = cfg.train.fp8 != FP8.none
        self.autocast = ComputeContext(self.precision, layout.device, fp8=fp8,
                                       amax_group=layout.stage_group() if fp8 else None)
        groups = grad_groups(self.params, self.opt_params, layout)
        self.optimizer = build_optimizer(groups, cfg.optimizer,
                                         separate_main=bf16 and self.main is None)
        self.sharded_optimizer = shards_state(self.optimizer)
        if bf16 and self.sharded_optimizer:
            shard_main_params(self.optimizer)
        # After the bf16 cast (under ZeRO-1, shard_main_params's): a stage's
        # activations take the dtype of its parameters.
        self.pipeline = (Pipeline(self.chunks, layout, resolved_schedule(cfg.parallel),
                                  n_microbatches=microbatches_per_step(cfg),
                                  micro_batch=cfg.train.micro_batch_size,
                                  seq_len=cfg.data.seq_len,
                                  output_dtype=logits_dtype(self.precision),
                                  # The mean is taken in the grad buffers, where
                                  # bf16 grads have already moved to fp32.
                                  scale_grads=False)
                         if layout.pp > 1 else None)
        self.grads = GroupedGrads(groups, group_parts(self.optimizer), grad_dtype=torch.float32)
        self.state = Progress(skipped=configured_skips(cfg))
        self.checkpoint_state = LiveTrainingState(cfg, layout, list(self.named_state_parameters()),
                                             self.optimizer, self.state, self.supervision.watchdog,
                                             after_load=self.main_to_model if bf16 else None)
        self.checkpointing = checkpointing.TrainCheckpointing.build(
            cfg, self.checkpoint_state, self.events, watchdog=self.supervision.watchdog,
            device=layout.device, fence=self.supervision.fence, rank=layout.rank,
            job_started=process_times()["launched_at"], local_world=self.supervision.local_world)

    def main_to_model(self) -> None:
        """bf16 model := fp32 main weights (after a checkpoint load)."""
        if self.main is not None:
            self.main.copy_to_model()
        else:
            self.optimizer.gather_params()

    def named_state_parameters(self):
        """(layout-free key, what the checkpoint holds for it): the fp32 main
        copy under bf16, else the parameter."""
        names = [key for key, p in self.named_parameters() if p.requires_grad]
        return zip(names, self.opt_params)

    def batches(self, dataset, consumed: int) -> list[tuple[torch.Tensor, ...]]:
        """This DP rank's micro-batches: (inputs, targets, global sample indices)."""
        t = self.cfg.train
        indices = micro_batches(consumed, t.global_batch_size, t.micro_batch_size,
                                self.layout.data_rank, self.layout.data_size)
        device = self.layout.device
        return [(*(x.to(device) for x in collate(dataset, idx)), torch.tensor(idx))
                for idx in indices]

    def replicated_state(self, full: bool) -> list[tuple[str, torch.Tensor]]:
        """What every data-parallel replica holds alike, named: the model's
        parameters and, with `full` unless the optimizer shards them over dp,
        their fp32 main copies and optimizer state."""
        named = list(self.named_parameters())
        if self.sharded_optimizer or not full:
            return named
        model = dict(named)
        for key, held in self.named_state_parameters():
            if held is not model[key]:
                named.append((f"{key}.main", held))
            named += [(f"{key}.{k}", v) for k, v in self.optimizer.state.get(held, {}).items()
                      if torch.is_tensor(v)]
        return named

    def named_parameters(self):
        """(layout-free key, parameter) over this rank's chunks: the local
        backend's keys under model.backend=te too (model/te.local_key)."""
        for chunk in self.chunks:
            for name, param in chunk.named_parameters():
                yield self.checkpoint_key(name), param

    def forward_backward(self, batches) -> torch.Tensor:
        """Accumulate grads over micro-batches; returns this rank's mean loss
        (zero on pipeline stages that do not compute it)."""
        if self.pipeline is not None:
            inputs, targets, samples = zip(*batches)
            with self.autocast:
                loss = self.pipeline.train_step(torch.cat(inputs), torch.cat(targets),
                                                list(samples))
            # The schedule sums the micro-batches' grads; make them the mean.
            self.grads.fold_all(divisor=len(batches))
            return loss
        model = self.chunks[0]
        total = torch.zeros((), device=self.layout.device)
        for i, (inputs, targets, samples) in enumerate(batches):
            if i == len(batches) - 1:
                self.grads.arm()  # overlap the DP reduction with the last backward
            with self.autocast:
                loss = model(inputs, targets, samples) / len(batches)
            loss.backward()
            total += loss.detach()
        return total

    def sync_grads(self) -> list[Held]:
        """Finish the grad reductions; returns per gradient group (param, grad
        this rank steps on)."""
        self.grads.finish()  # DP mean, or under the distributed optimizer its row shards
        held = self.grads.held()
        entries = [entry for group in held for entry in group]
        # Linear sums over TP / the embedding group: on whichever grads this
        # rank holds, the same rows on every rank of those groups.
        all_reduce_sequence_parallel_grads(entries, self.layout.group("tp")
                                           if self.layout.tp > 1 else None)
        sync_tied_embedding_grads(entries, self.layout.embedding_group)
        return held

    def optimizer_step(self, step: int, loss: torch.Tensor) -> StepResult:
        """Check the step (resilience.numerics) and, when finite or unchecked,
        apply its update; the grads are zeroed either way."""
        held = self.sync_grads()
        entries = [entry for group in held for entry in group]
        faults = self.supervision.step_faults(step, self.state.consumed_samples)
        if faults.due:
            # A NaN into a grad the norm counts (not a tied embedding's copy,
            # nor a TP replica's): a real fault lands there before the syncs.
            names = {id(p): key for key, p in self.named_state_parameters()}
            faults.before_update([g for p, g in entries if counted_here(p, self.layout)],
                                 [(names.get(id(p), "?"), g) for p, g in entries])
        squares = [local_grad_norm_squared(group, self.layout) for group in held]
        norm, stage_loss = reduce_grad_norm(squares, self.layout,
                                            sharded_over=self.grads.sharded_over(), loss=loss,
                                            loss_factor=faults.loss_factor())
        local = sum(squares[1:], squares[0])
        # The norm rides in the loss's data-parallel mean: every rank sees any
        # rank's non-finite value (the loss rode in the norm's all-reduce).
        result = StepResult(dp_mean(stage_loss + norm.to(stage_loss.dtype) * 0.0, self.layout),
                            norm, loss, local)
        if not self.numerics.holds_back(step, result):
            clip_gradients([g for _, g in entries], norm, self.cfg.optimizer.grad_clip)
            set_lr(self.optimizer, lr_at(step, self.cfg.optimizer, self.cfg.train.steps))
            self.state.settled = False  # until the step is counted (train_step)
            self.checkpointing.before_update()  # an async save may still be copying the weights
            self.optimizer.step()
            if self.main is not None:
                self.main.copy_to_model()
            result.applied = True
            faults.after_update(list(self.named_parameters()))
        self.grads.zero()
        if self.sharded_optimizer:
            self.optimizer.zero_grad()
        return result

    def attempt_step(self, step: int) -> StepResult:
        """One attempt of a step from the current data position."""
        section = self.supervision.section
        with section("data", step):
            batches = self.batches(self.train_data, self.state.consumed_samples)
        with section("forward_backward", step):
            loss = self.forward_backward(batches)
        with section("optimizer", step):
            return self.optimizer_step(step, loss)

    def train_step(self) -> dict:
        result = None
        while result is None:  # None: rolled back, on from the checkpoint's step
            step = self.state.step + 1
            started = time.perf_counter()
            self.model.train()
            # The sampler passes over global batches a rollback skipped.
            self.state.consumed_samples = skip_past(self.state.consumed_samples,
                                                    self.state.skipped)
            result = self.numerics.run(step, lambda: self.attempt_step(step))
            if result is None:
                self.replicas.forget()
        self.supervision.step_done()
        self.state.step = step
        self.state.consumed_samples += self.cfg.train.global_batch_size
        self.state.settled = True
        seconds = time.perf_counter() - started
        tokens = self.cfg.train.global_batch_size * self.cfg.data.seq_len
        record = {"step": step, "loss": result.loss,
                  "lr": lr_at(step, self.cfg.optimizer, self.cfg.train.steps),
                  "grad_norm": result.grad_norm,
                  "tokens": self.state.consumed_samples * self.cfg.data.seq_len,
                  "tokens_per_s": tokens / seconds, "step_time_s": seconds,
                  **record_fields(self.supervision.step_times), "time": time.time()}
        if self.supervision.generation:
            record["restart"] = self.supervision.generation
        if self.numerics.rollbacks:  # steps trained again after a rollback
            record["rollback"] = self.numerics.rollbacks
        return record

    @torch.no_grad()
    def evaluate(self, dataset=None) -> float:
        """Mean loss over a fixed held-out set (the first eval_batches global
        batches of `dataset`, by default the valid split)."""
        self.model.eval()
        g = self.cfg.train.global_batch_size
        dataset = self.valid_data if dataset is None else dataset
        losses = [self.forward_eval(self.batches(dataset, i * g))
                  for i in range(self.cfg.train.eval_batches)]
        return dp_mean(torch.stack(losses).mean(), self.layout)

    def forward_eval(self, batches) -> torch.Tensor:
        inputs, targets, _ = zip(*batches)
        with self.autocast:
            if self.pipeline is not None:
                return self.pipeline.eval_step(torch.cat(inputs), torch.cat(targets))
            return torch.stack([self.chunks[0](x, y) for x, y in zip(inputs, targets)]).mean()

    def should_eval(self, step: int) -> bool:
        t = self.cfg.train
        if t.eval_batches == 0:
            return False
        return step == t.steps or (t.eval_interval > 0 and step % t.eval_interval == 0)

    def run(self) -> str:
        """Train to train.steps. Returns how it ended: "finished", "exited"
        (at train.exit_at_step, after saving), "preempted" or "interrupted"
        (SIGINT; both after saving)."""
        t = self.cfg.train
        log = self.open_metrics()
        last_record = None
        profiler = StepProfiler(self.cfg.profile, self.layout.rank, self.run_dir)
        started = time.perf_counter()
        try:
            if self.saves.missed(self.state.step) and self.save_missed() == "exited":
                return self.stop("exited")
            while self.state.step < t.steps:
                with profiler.step(self.state.step + 1):
                    record = self.train_step()
                record["elapsed_s"] = time.perf_counter() - started
                last_record = record
                if log:
                    log.write(record)
                step = record["step"]
                self.saves.step_done(step, record["step_time_s"],
                                     first_of_process=self.supervision.steps == 1)
                saving, saving_local = self.saves.due(step), self.checkpointing.local_due(step)
                # On the training thread's own (world) group: the checkpoint
                # group belongs to the save thread while a save is in flight.
                stopping = self.supervision.preempted(None)
                # Replicas compared before anything is saved from them.
                about_to_save = saving or saving_local or bool(stopping)
                if self.replicas.due(step, about_to_save):
                    with self.state.changing():  # an outvoted replica is restored in place
                        rolled_back = self.replicas.check(step, about_to_save)
                    if rolled_back:
                        continue  # on from the checkpoint's step
                if self.should_eval(step):
                    eval_started = time.perf_counter()
                    with self.supervision.section("eval", step):
                        eval_loss = self.evaluate()
                    if log:
                        log.write({"step": step, "eval_loss": eval_loss, "time": time.time(),
                                   "eval_time_s": time.perf_counter() - eval_started})
                if stopping:
                    self.save()
                    return self.stop(stopping)
                if saving:
                    self.save()
                if saving_local:
                    with self.supervision.section("checkpoint", step):
                        self.checkpointing.save_local(self.state.step)
                if step == t.exit_at_step:
                    return self.stop("exited", last_record)
        except BaseException:
            self.checkpointing.abandon()  # a failed job does not wait for its save
            raise
        finally:
            profiler.finish()
            self.close()
            if log:
                log.close()
        return self.stop("finished", last_record)

    def save_missed(self) -> Optional[str]:
        """The global save a failure interrupted where the ranks' memory went
        on from its step (SaveSchedule.missed), made now, of the replicas
        compared first; "exited" when it was train.exit_at_step's."""
        step = self.state.step
        if self.replicas.due(step, True):
            with self.state.changing():
                if self.replicas.check(step, True):
                    return None  # rolled back: the loop trains on from the checkpoint's step
        self.save()
        return "exited" if step == self.cfg.train.exit_at_step else None

    def hand_over(self) -> Optional[Carried]:
        """This rank's state for the next generation (live replacement), or
        None when a failure caught it mid-change (an update, a load) or, on a
        GPU, its copy to the host did not land (handover.carried_state)."""
        if not self.state.settled:
            return None
        return carried_state(self.checkpoint_state, self.layout.rank, self.layout.world_size,
                             self.replicas.agreement)

    def close(self) -> None:
        """Finish the save in flight and release what would outlive the trainer."""
        self.checkpointing.close()
        self.grads.close()

    def save(self) -> None:
        started = time.perf_counter()
        with self.supervision.section("checkpoint", self.state.step):
            self.checkpointing.save()
        self.saves.saved(self.state.step, time.perf_counter() - started)

    def stop(self, outcome: str, last_record: Optional[dict] = None) -> str:
        self.checkpointing.close()  # a preemption checkpoint must be committed before exit
        if outcome == "finished":
            self.checkpointing.finish()
        # The rank that writes metrics ends the story: under pipeline
        # parallelism only the last stage knows the loss the summary names.
        if self.layout.is_logging_rank:
            goodput = write_goodput(self.run_dir)
            if outcome == "finished":
                line = story.summary(self.cfg, self.checkpointing.root, self.state.step,
                                     last_record, goodput)
                self.events.emit("run_finished", step=self.state.step, goodput=goodput, line=line)
                story.tell(line)
            else:  # exited (train.exit_at_step), preempted or interrupted
                self.events.emit(outcome, step=self.state.step)
        return outcome

    def open_metrics(self) -> MetricsLog | None:
        if not self.layout.is_logging_rank:
            return None
        write_atomic(self.run_dir / "recipe.yaml", to_yaml(self.cfg))
        # The banner rides in the event: the launcher prints it after the
        # load's line ("resumed from ..."), not racing it.
        banner = story.banner(self.cfg, self.state.step)
        self.events.emit("generation_started", generation=self.supervision.generation,
                         step=self.state.step, line=banner, **process_times())
        story.tell(banner)
        return MetricsLog(self.run_dir, self.cfg, StepFigures.for_recipe(self.cfg, self.layout.device),
                          start_step=self.state.step, generation=self.supervision.generation,
                          fence=self.supervision.fence)
