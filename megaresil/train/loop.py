"""The training loop: `Trainer` runs one rank's part of the job, its parts
built by train/build.build_parts, and `run` trains it to train.steps, one
method per part of a step (data, forward_backward, optimizer: the compute is
train/step.py's, the check and the update are here), then performs what
train/between_steps.decide says follows the step (compare replicas,
evaluate, save, stop)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, Optional, Sequence, cast

import torch

from megaresil.config import RecipeConfig, global_batch_at, to_yaml
from megaresil.data.sampler import SampleDataset, skip_past
from megaresil.events import EventLog
from megaresil.parallel.fsdp import local_part
from megaresil.parallel.grad_groups import Held, zero1
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.sharding import spec_of
from megaresil.resilience.step_faults import StepFaults
from megaresil.resilience.supervision import Supervision
from megaresil.safe_files import write_atomic
from megaresil.train import story
from megaresil.observe.goodput import write_goodput
from megaresil.observe.startup import StartupPhases, process_times
from megaresil.observe.profiler import StepProfiler
from megaresil.observe.sections import record_fields
from megaresil.train.metrics import MetricsLog, StepFigures
from megaresil.train.numerics import NumericsGuard, StepResult
from megaresil.train.replicas import ReplicaCheck
from megaresil.train.routing_figures import RoutingFigures
from megaresil.train.routing_watch import RoutingWatch
from megaresil.train.z_loss_figure import ZLossFigure
from megaresil.train import step as step_compute
from megaresil.train.lr_schedule import lr_at
from megaresil.train.optim import clip_gradients, counted_here, set_lr
from megaresil.train.batches import Batch, held_out_loss, read_batches
from megaresil.train.step import dp_mean
from megaresil.train.save_schedule import SaveSchedule
from megaresil.train.between_steps import EXITED, StepFacts, decide
from megaresil.train.build import build_parts, named_parameters, named_state_parameters
from megaresil.train.handover import (Carried, carried_state, donated_tensors,
                                      plan_live_start)


class Trainer:
    """One rank's run: its parts (train/build.TrainerParts, whose fields it
    takes as its own), each step checked and applied, and what follows it."""

    def __init__(self, cfg: RecipeConfig, layout: ParallelLayout,
                 supervision: Optional[Supervision] = None):
        self.cfg, self.layout = cfg, layout
        self.supervision = supervision or Supervision()
        self.run_dir = Path(cfg.run.dir)
        self.events = EventLog(self.run_dir, layout.rank)
        phases = StartupPhases(self.events, layout.rank)
        # Opaque to resilience/ (it knows no trainer): this trainer's own hand_over.
        carried = cast(Optional[Carried], self.supervision.carried)
        live = plan_live_start(cfg, carried, layout)
        with phases.phase("data, model and optimizer build"):
            # A state taken from the ranks' memory overwrites every value drawn.
            parts = build_parts(cfg, layout, self.supervision, self.events,
                                draw=not (live and live.serves))
        self.parts = parts  # the trainer's fields below are its parts'
        self.train_data, self.valid_data = parts.train_data, parts.valid_data
        self.chunks, self.model, self.checkpoint_key = parts.chunks, parts.model, parts.checkpoint_key
        self.params, self.main, self.opt_params = parts.params, parts.main, parts.opt_params
        self.autocast, self.pipeline, self.grads = parts.autocast, parts.pipeline, parts.grads
        self.optimizer, self.sharded_optimizer = parts.optimizer, parts.sharded_optimizer
        self.state, self.checkpoint_state = parts.state, parts.checkpoint_state
        self.checkpointing = parts.checkpointing
        self.routing = RoutingFigures.of(cfg, layout, self.chunks)
        self.z_loss = ZLossFigure.of(layout, self.chunks, cfg.train.z_loss)
        started = phases.clock.monotonic()
        loaded = self.checkpointing.start(carried, live, layout)
        self.supervision.carried = None  # loaded: its memory goes back
        if loaded is not None:
            phases.finished(loaded.phase, phases.clock.monotonic() - started, loaded.nbytes)
        self.saves = SaveSchedule(cfg, self.state.step, events=self.events, rank=layout.rank,
                                  last_saved=self.checkpointing.newest_saved_step()
                                  if live and live.serves else None)
        # On every rank of a model with experts (the guard's gather is collective).
        self.routing_watch = (RoutingWatch(self.chunks, self.checkpoint_key)
                              if cfg.model.moe.num_experts else None)
        self.numerics = NumericsGuard(cfg, layout, self.state, self.checkpointing, self.events,
                                      self.supervision.section, self.routing_watch)
        self.replicas = ReplicaCheck(cfg.resilience.numerics.check_interval, layout,
                                     self.replicated_state, self.events,
                                     lambda step, reason: self.numerics.rollback(step, reason, []),
                                     self.supervision.section,
                                     donated=(lambda: donated_tensors(self.checkpoint_state))
                                     if live and live.replicated else None,
                                     agreement=live.agreement(layout.rank) if live else None)

    def named_state_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(layout-free key, what the checkpoint holds for it): the fp32 main
        copy under bf16, else the parameter."""
        return named_state_parameters(self.chunks, self.checkpoint_key, self.opt_params)

    def batches(self, dataset: SampleDataset, consumed: int,
                global_batch: Optional[int] = None) -> list[Batch]:
        """This DP rank's micro-batches of the `global_batch` samples from
        `consumed` (by default the batch a training step there takes): train/batches.py."""
        if global_batch is None:
            global_batch = global_batch_at(self.cfg.train, consumed)
        return read_batches(dataset, consumed, global_batch, self.cfg.train.micro_batch_size,
                            self.layout, self.parts.masking)

    def replicated_state(self, full: bool) -> dict[tuple[str, ...], list[tuple[str, torch.Tensor]]]:
        """What the data-parallel replicas hold alike, named, by the axes
        they are replicated over (ShardSpec.replicated_over: dp, experts edp):
        the model's parameters and, with `full` unless their group's
        optimizer shards them (ZeRO-1), their fp32 main copies and optimizer
        state. Under sharded data parallelism each tensor's local shard
        (fsdp.local_part): what the replicas over dp_replicate hold alike
        (the DTensor itself is the whole parameter, which no rank holds, and
        its sums would be collectives over the shards)."""
        params = list(self.named_parameters())
        model = dict(params)
        by_axes: dict[tuple[str, ...], list[tuple[str, torch.Tensor]]] = {}
        for key, p in params:
            by_axes.setdefault(spec_of(p).replicated_over, []).append((key, local_part(p)))
        if not full:
            return by_axes
        for key, held in self.named_state_parameters():
            axes = spec_of(model[key]).replicated_over
            if zero1(self.cfg.optimizer, self.layout.size(*axes)):
                continue
            named = by_axes[axes]
            if held is not model[key]:
                named.append((f"{key}.main", local_part(held)))
            named += [(f"{key}.{k}", local_part(v))
                      for k, v in self.optimizer.state.get(held, {}).items() if torch.is_tensor(v)]
        return by_axes

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(layout-free key, parameter) over this rank's chunks."""
        return named_parameters(self.chunks, self.checkpoint_key)

    def forward_backward(self, batches: Sequence[Batch]) -> torch.Tensor:
        """Accumulate grads over micro-batches (train/step.py)."""
        return step_compute.forward_backward(self.parts, batches, self.layout.device)

    def sync_grads(self) -> list[Held]:
        """Finish the grad reductions; per gradient group (param, grad this rank steps on)."""
        return step_compute.sync_grads(self.grads, self.layout)

    def optimizer_step(self, step: int, loss: torch.Tensor,
                       faults: Optional[StepFaults] = None) -> StepResult:
        """Check the step (resilience.numerics) and, when finite or unchecked,
        apply its update; the grads are zeroed either way. `faults`: the
        attempt's injected faults (none by default)."""
        faults = faults or StepFaults()
        held = self.sync_grads()
        entries = [entry for group in held for entry in group]
        if faults.due:
            # A NaN into a grad the norm counts (not a tied embedding's copy,
            # nor a TP replica's): a real fault lands there before the syncs.
            names = {id(p): key for key, p in self.named_state_parameters()}
            faults.before_update([g for p, g in entries if counted_here(p, self.layout)],
                                 [(names.get(id(p), "?"), g) for p, g in entries])
        result = step_compute.step_figures(held, self.grads, self.layout, loss,
                                           loss_factor=faults.loss_factor())
        self.routing.reduce()
        self.z_loss.reduce()
        if not self.numerics.holds_back(step, result):
            clip_gradients([g for _, g in entries], result.norm, self.cfg.optimizer.grad_clip)
            set_lr(self.optimizer, lr_at(step, self.cfg.optimizer, self.cfg.train.steps))
            self.state.settled = False  # until the step is counted (train_step)
            self.checkpointing.before_update()  # an async save may still be copying the weights
            self.optimizer.step()
            if self.main is not None:
                self.main.copy_to_model()
            self.routing.after_step()
            result.applied = True
            # Each rank flips a bit of what it holds: a sharded parameter's local shard.
            faults.after_update([(key, local_part(p)) for key, p in self.named_parameters()])
        step_compute.zero_grads(self.parts)
        return result

    def attempt_step(self, step: int) -> StepResult:
        """One attempt of a step from the current data position."""
        section = self.supervision.section
        self.supervision.batch_share(self.global_batch() / self.cfg.train.global_batch_size)
        with section("data", step):
            batches = self.batches(self.train_data, self.state.consumed_samples)
        self.routing.begin_step()
        self.z_loss.begin_step()
        faults = self.supervision.step_faults(step, self.state.consumed_samples)
        if self.routing_watch is not None:
            self.routing_watch.begin_attempt(faults.routing_poison())
        with section("forward_backward", step):
            loss = self.forward_backward(batches)
        with section("optimizer", step):
            return self.optimizer_step(step, loss, faults)

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
        global_batch = self.global_batch()  # the step's, at the position it started from
        self.state.step = step
        self.state.consumed_samples += global_batch
        self.state.settled = True
        seconds = time.perf_counter() - started
        tokens = global_batch * self.cfg.data.seq_len
        record = {"step": step, "loss": result.loss, "global_batch_size": global_batch,
                  "lr": lr_at(step, self.cfg.optimizer, self.cfg.train.steps),
                  "grad_norm": result.grad_norm,
                  "tokens": self.state.consumed_samples * self.cfg.data.seq_len,
                  "tokens_per_s": tokens / seconds, "step_time_s": seconds,
                  **record_fields(self.supervision.step_times), **self.routing.fields(step),
                  **self.z_loss.fields(),
                  "time": time.time()}
        if self.supervision.generation:
            record["restart"] = self.supervision.generation
        if self.numerics.rollbacks:  # steps trained again after a rollback
            record["rollback"] = self.numerics.rollbacks
        return record

    def global_batch(self) -> int:
        """The global batch of the step at the current data position
        (train.rampup_batch_size's ramp, else train.global_batch_size)."""
        return global_batch_at(self.cfg.train, self.state.consumed_samples)

    @torch.no_grad()
    def evaluate(self, dataset: Optional[SampleDataset] = None) -> float:
        """Mean loss over a fixed held-out set (the first eval_batches global
        batches of `dataset`, by default the valid split): full batches of
        train.global_batch_size, during a batch ramp too."""
        self.model.eval()
        # valid_data is None only without eval (train.eval_batches 0): no batch is read then.
        held_out = cast(SampleDataset, self.valid_data if dataset is None else dataset)
        loss = held_out_loss(held_out, self.cfg.train, self.layout, self.parts.masking,
                             lambda batches: step_compute.forward_eval(self.parts, batches))
        return dp_mean(loss, self.layout)

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
                return self.stop(EXITED)
            while self.state.step < t.steps:
                with profiler.step(self.state.step + 1):
                    record = self.train_step()
                record["elapsed_s"] = time.perf_counter() - started
                last_record = record
                if log:
                    log.write(record)
                step = record["step"]
                self.saves.step_done(step, record["step_time_s"], record["global_batch_size"],
                                     first_of_process=self.supervision.steps == 1)
                # The preemption flag on the training thread's own (world)
                # group: the checkpoint group belongs to the save thread
                # while a save is in flight.
                facts = StepFacts(step, self.saves.due(step), self.checkpointing.local_due(step),
                                  self.supervision.preempted(None))
                after = decide(facts, replicas_due=self.replicas.due(step, facts.about_to_save),
                               train=t)
                if after.check_replicas:
                    with self.state.changing():  # an outvoted replica is restored in place
                        rolled_back = self.replicas.check(step, facts.about_to_save)
                    if rolled_back:
                        continue  # on from the checkpoint's step
                if after.evaluate:
                    self.evaluate_logged(step, log)
                if after.save:
                    self.save()
                if after.save_local:
                    with self.supervision.section("checkpoint", step):
                        self.checkpointing.save_local(self.state.step)
                if after.stop:
                    return self.stop(after.stop, last_record)
        except BaseException:
            self.checkpointing.abandon()  # a failed job does not wait for its save
            raise
        finally:
            profiler.finish()
            self.close()
            if log:
                log.close()
        return self.stop("finished", last_record)

    def evaluate_logged(self, step: int, log: Optional[MetricsLog]) -> None:
        started = time.perf_counter()
        with self.supervision.section("eval", step):
            eval_loss = self.evaluate()
        if log:
            log.write({"step": step, "eval_loss": eval_loss, "time": time.time(),
                       "eval_time_s": time.perf_counter() - started})

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
        return EXITED if step == self.cfg.train.exit_at_step else None

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
                                     self.state.consumed_samples, last_record, goodput)
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
        compiled = self.parts.compiled
        banner = story.banner(self.cfg, self.state.step, compiled.words() if compiled else "")
        self.events.emit("generation_started", generation=self.supervision.generation,
                         step=self.state.step, world_size=self.layout.world_size, line=banner,
                         **process_times())
        story.tell(banner)
        return MetricsLog(self.run_dir, self.cfg, StepFigures.for_recipe(self.cfg, self.layout.device),
                          start_step=self.state.step, generation=self.supervision.generation,
                          fence=self.supervision.fence)
