"""The run sections of the recipe schema: checkpointing (global and local
tier), logging and profiling, resilience (restarts, the watchdog) and the run
directory; see `config.schema` for the training sections and the root."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Union

from megaresil.config.fields import NON_NEGATIVE, POSITIVE, Bounds, doc, section


class CheckpointBackend(str, enum.Enum):
    torch_dist = "torch_dist"
    zarr = "zarr"


class SpikePolicy(str, enum.Enum):
    """What a loss spike does (resilience.numerics.on_spike; docs/numerics.md)."""
    none = "none"  # no detector
    warn = "warn"  # reported, the update applied
    skip = "skip"  # the update not applied, the step's batch skipped
    rollback = "rollback"  # back to the newest checkpoint, the spike's data window skipped



@dataclass
class LocalCheckpointConfig:
    enabled: bool = doc(False, "Keep a fast tier of checkpoints in node-local storage, each "
                        "rank's shard copied to `replicas` ranks on other nodes; restarts "
                        "resume from the newest step every rank can recover (local or global).")
    interval: int = doc(0, "Local save every this many steps; 0 chooses it: every step while a "
                        "save holds the loop for at most 5% of a step, else the smallest "
                        "interval that keeps it there (measured at each save).",
                        bounds=NON_NEGATIVE)
    dir: Optional[str] = doc(None, "Node-local root; null means /dev/shm/megaresil/<run dir "
                             "name>-<digest of its path> (the temp dir when there is no "
                             "/dev/shm). Each run keeps its shards in its own run-<run id> "
                             "directory there, one node_<k> directory per node (simulated ones "
                             "too); runs may share a root, one job at a time. Must lie outside "
                             "the global checkpoint root.")
    replicas: int = doc(1, "Peers on other nodes that hold a copy of each rank's shard (at most "
                        "nodes - 1 are used).", bounds=NON_NEGATIVE)
    keep: int = doc(2, "Local steps kept per rank; at least 2, so a save cut short by a failure "
                    "still leaves a step every rank holds.", bounds=Bounds(2))
    ranks_per_node: int = doc(0, "Ranks per node; 0 reads LOCAL_WORLD_SIZE (the ranks of one "
                              "launcher agent). Smaller values simulate several nodes on one "
                              "machine.", bounds=NON_NEGATIVE)


@dataclass
class CheckpointConfig:
    interval: Union[int, str] = doc("auto", "auto: chosen from the run's measured save and "
                                    "step cost and resilience.mtbf_hours (Young/Daly), at most "
                                    "checkpoint.max_minutes_at_risk and a quarter of train.steps "
                                    "apart, re-chosen when a cost "
                                    "moves by more than 2x; N: every N steps; 0: never (a warning "
                                    "at start; only train.exit_at_step and a preemption or "
                                    "Ctrl-C save). Except with 0 the last step is always saved.",
                                    bounds=NON_NEGATIVE)
    max_minutes_at_risk: float = doc(30.0, "checkpoint.interval=auto: at most this many minutes "
                                     "of training between saves.", bounds=POSITIVE)
    backend: CheckpointBackend = doc(CheckpointBackend.torch_dist, "torch_dist (PyTorch "
                                     "Distributed Checkpoint files) or zarr (one zarr v3 array per "
                                     "tensor).")
    async_: bool = doc(False, "checkpoint.async: block training only to copy the state into "
                       "staging memory; write, fsync and commit in the background.")
    keep: int = doc(3, "Keep the newest N checkpoints (0 keeps all); older ones are deleted only "
                    "after a newer one is committed. 3: the newest, and two to walk back to when "
                    "it fails its checks, at three checkpoints' disk.", bounds=NON_NEGATIVE)
    dir: Optional[str] = doc(None, "Checkpoint root; null means run.dir/checkpoints.")
    load: str = doc("auto", "auto: resume from the newest valid checkpoint under the root (error "
                    "if checkpoints exist but none is valid); none: start from scratch; or a "
                    "checkpoint directory to load. With none or a directory, the job's restarts "
                    "go on from what it saved since it started.")
    init_from: Optional[str] = doc(None, "Start a new run from these weights: a megaresil "
                                   "checkpoint (weights-only or full, any layout) or a Hugging "
                                   "Face model directory (config.json + safetensors). Fresh "
                                   "optimizer, step 0, data from the start. Used only when "
                                   "checkpoint.load finds nothing to resume: a restarted run "
                                   "resumes from its own newest checkpoint.")
    init_from_optimizer: bool = doc(False, "With init_from a full megaresil checkpoint: also "
                                    "take its optimizer state, step and data position (and its "
                                    "RNG at the same layout), i.e. continue that run in this "
                                    "run directory.")
    local: LocalCheckpointConfig = section(LocalCheckpointConfig, "The node-local tier with "
                                           "peer replication.")
    allow_recipe_change: list[str] = doc([], "On resume, recipe keys (e.g. [optimizer.lr]) "
                                         "that may differ from the checkpoint's recipe beyond "
                                         "those that always may (docs/fault-tolerance.md).")


@dataclass
class WandbConfig:
    enabled: bool = doc(False, "Log every metrics.jsonl figure to Weights & Biases (rank 0; "
                        "needs `pip install wandb`). A restart continues the same W&B run: its "
                        "id is kept in run.dir/wandb_run_id.")
    project: Optional[str] = doc(None, "W&B project (null: W&B's default).")
    entity: Optional[str] = doc(None, "W&B entity (user or team; null: your default).")
    name: Optional[str] = doc(None, "W&B run name (null: the run directory's name).")
    mode: str = doc("online", "online, offline (write under run.dir/wandb, `wandb sync` later) "
                    "or disabled.")


@dataclass
class MlflowConfig:
    enabled: bool = doc(False, "Log every metrics.jsonl figure to MLflow (rank 0; needs `pip "
                        "install mlflow-skinny` or mlflow). A restart continues the same MLflow "
                        "run: its id is kept in run.dir/mlflow_run_id.")
    tracking_uri: Optional[str] = doc(None, "MLflow tracking URI, e.g. http://host:5000 or "
                                      "file:///path/mlruns (null: MLflow's default).")
    experiment: Optional[str] = doc(None, "MLflow experiment name (null: MLflow's default).")


@dataclass
class LoggingConfig:
    progress: bool = doc(True, "Progress bar on the console (rank 0); when false, or when the "
                         "console is not a terminal, a plain line every log_interval steps.")
    log_interval: int = doc(10, "Steps between plain console lines (step, loss, lr, grad norm, "
                            "tok/s, MFU, step time).", bounds=POSITIVE)
    tensorboard: bool = doc(True, "Write TensorBoard scalars to run.dir/tb/.")
    peak_tflops: Optional[float] = doc(None, "Peak TFLOP/s of one device (one rank) that MFU is "
                                       "measured against, e.g. 989 for an H100/H200 in bf16; "
                                       "null: measured once by a short matmul probe and cached "
                                       "in data.cache_dir/peak_tflops.json.", bounds=POSITIVE)
    straggler_interval: int = doc(10, "Every this many steps the ranks exchange their section "
                                  "times (one small all-gather) and rank 0 scores them "
                                  "(run.dir/stragglers.jsonl); 0 disables straggler detection.",
                                  bounds=NON_NEGATIVE)
    straggler_threshold: float = doc(1.5, "A rank whose training thread spends this many times "
                                     "the median rank's time in a section is slow there.",
                                     bounds=Bounds(1, low_open=True))
    straggler_windows: int = doc(2, "Consecutive slow windows before `straggler_detected` is "
                                 "written (once per rank and section while it lasts).",
                                 bounds=POSITIVE)
    wandb: WandbConfig = section(WandbConfig, "Weights & Biases.")
    mlflow: MlflowConfig = section(MlflowConfig, "MLflow.")


@dataclass
class ProfileConfig:
    enabled: bool = doc(False, "Run torch.profiler over steps start_step .. start_step+steps-1 "
                        "and write a trace per rank to run.dir/profile/ (open it in "
                        "https://ui.perfetto.dev or TensorBoard's profiler plugin).")
    start_step: int = doc(3, "First profiled step (after warm-up).", bounds=POSITIVE)
    steps: int = doc(2, "Steps profiled.", bounds=POSITIVE)
    ranks: list[int] = doc([0], "Ranks that profile (a trace per rank).")


@dataclass
class WatchdogConfig:
    enabled: bool = doc(True, "Run the hang detector (a monitor thread per rank).")
    initial_timeout_s: float = doc(120.0, "Section budget before calibration (the first "
                                   "calibration_steps steps, which include warm-up).")
    setup_timeout_s: float = doc(600.0, "Budget of the setup section (build, load checkpoint).")
    checkpoint_timeout_s: float = doc(300.0, "Budget of the checkpoint section, kept apart so "
                                      "long saves are not false alarms.")
    calibration_steps: int = doc(3, "Steps observed before budgets are calibrated.")
    factor: float = doc(5.0, "Calibrated budget = max(floor_s, factor * slowest observed "
                        "duration of that section).")
    floor_s: float = doc(2.0, "Smallest calibrated budget, against a noisy machine.")
    poll_s: float = doc(0.1, "How often the monitor samples its training thread and checks "
                        "its budget (local only: no store traffic).")
    stall_s: float = doc(0.5, "A rank past its budget is declared hung only when its culprits' "
                         "training threads used (almost) no CPU for this long (and their "
                         "connections to their peers moved no byte for the section's budget); "
                         "a culprit still computing or moving data is slow, not stuck (a "
                         "hang_suspected warning, no abort).")
    slow_limit_factor: float = doc(5.0, "Hard limit of a section, as a multiple of its budget: "
                                   "past it a culprit is declared hung even while it computes "
                                   "(an endless loop), and it is the timeout of gloo collectives "
                                   "started in that section, so a rank waiting for a slow peer "
                                   "is not failed before.")
    heartbeat_s: float = doc(0.5, "How often a rank writes its heartbeat to the store.")
    abort_poll_s: float = doc(1.0, "How often a rank reads the store for an abort announced by "
                              "another rank.")
    store_ops_limit: float = doc(2000.0, "Most watchdog operations per second on the store, all "
                                 "ranks together: with many ranks the heartbeat and abort-poll "
                                 "intervals grow so the total stays under it.")
    gil_timeout_s: float = doc(30.0, "A side process kills the rank when its monitor thread has "
                               "not run for this long (a hang holding the GIL).")


@dataclass
class NumericsConfig:
    enabled: bool = doc(True, "Check the loss and the global grad norm for non-finite values "
                        "(NaN, inf) at every step before the update, inside the grad norm's own "
                        "all-reduce (no extra collective). A non-finite step is not applied; it "
                        "is replayed once from the same samples and RNG state: finite then, it "
                        "was a transient fault and training goes on with the replay; non-finite "
                        "again, the run rolls back to the newest checkpoint and skips that "
                        "step's global batch (docs/numerics.md).")
    max_rollbacks: int = doc(3, "Rollbacks (each skips one global batch) the run may make over "
                             "its life, counted by the batches its checkpoints record as "
                             "skipped; the next persistent non-finite step stops the run with "
                             "exit 1. 0: stop at the first.", bounds=NON_NEGATIVE)
    skip_batches: list[Any] = doc([], "Global batches to pass over, by hand: [[first_sample, "
                                  "samples], ...], each first_sample where a global batch starts "
                                  "(train.global_batch_size times a step; during a batch ramp "
                                  "where the ramp's batches start) and samples whole batches "
                                  "from there; an entry that could never match "
                                  "(elsewhere, or inside another) is refused. What a rollback "
                                  "records in its checkpoints, given up front: to skip a bad data "
                                  "window, or for a reference run that skips what a faulted one "
                                  "did.", recipe_type="list[[int, int]]")
    on_spike: SpikePolicy = doc(SpikePolicy.warn, "What a loss spike does (the step's loss "
                                "more than spike_threshold robust deviations above the median "
                                "of the last spike_window steps; off during the LR warmup and "
                                "until the window is full): warn (an event and a console line, "
                                "the update applied); skip (the update not applied, the step "
                                "trains on the next global batch); rollback (back to the "
                                "newest checkpoint, the spike's data window skipped); none (no "
                                "detector).")
    spike_window: int = doc(50, "Steps of loss history the spike detector compares with (their "
                            "median and median absolute deviation).", bounds=Bounds(5))
    spike_threshold: float = doc(6.0, "Robust deviations (the larger of 1.4826 x the median "
                                 "absolute deviation and 1.2533 x the mean one, at least 1% of "
                                 "the median) above the median that make a spike.",
                                 bounds=POSITIVE)
    spike_skip_window: int = doc(1, "on_spike=rollback: global batches skipped, the spike's own "
                                 "and those of the steps just before it (never before the "
                                 "checkpoint rolled back to). Each skip counts against "
                                 "max_rollbacks.", bounds=Bounds(1))
    spike_level_shift: int = doc(5, "Spikes applied in a row (under warn, or caused by the "
                                 "state: one that comes back at its step after its batch was "
                                 "skipped) that make a new loss level, not a spike: the window "
                                 "starts again from their losses.", bounds=Bounds(2))
    check_interval: int = doc(1, "Compare a checksum of every data-parallel replica's "
                              "parameters (and their optimizer state, unless "
                              "optimizer.distributed) every this many steps and before every "
                              "save: a replica that differs (silent data corruption) is named "
                              "and restored from a healthy one (dp >= 3), or found by a replay "
                              "from the newest checkpoint (dp = 2). 0: off. No effect at dp=1.",
                              bounds=NON_NEGATIVE)


@dataclass
class HealthConfig:
    command: str = doc("", "A shell command each node's agent runs before the node joins the "
                       "job: exit 0 admits the node; any other exit (or a run past timeout_s) "
                       "excludes it from the run, its last line of output the reason. Empty: "
                       "none (docs/clusters.md#health-checks).")
    gpu: bool = doc(True, "On a node with GPUs, check every visible device through NVML "
                    "(nvidia-ml-py) before joining: uncorrectable ECC errors, pages waiting "
                    "to be retired, failed row remaps, temperature, and that the node has the "
                    "GPUs it is to use.")
    max_temperature_c: float = doc(85.0, "A GPU this hot (Celsius) or hotter fails the check.",
                                   bounds=POSITIVE)
    timeout_s: float = doc(120.0, "The command's time limit; past it the check fails.",
                           bounds=POSITIVE)
    interval_s: float = doc(60.0, "With hot spares or live replacement: a node waiting in the "
                            "rendezvous (a spare, or a node waiting for the job to re-form) "
                            "runs its checks again this often, and once more when admitted "
                            "after a longer wait; failing, it is excluded and leaves before "
                            "its workers start (docs/clusters.md#health-checks).",
                            bounds=POSITIVE)


@dataclass
class ReplacementConfig:
    enabled: bool = doc(False, "A worker process that dies (killed, crashed, or exited by the "
                        "watchdog) is started again alone by its node's agent while the other "
                        "ranks wait in their processes; it takes its state from a data-parallel "
                        "peer's memory at the step the job reached, so no completed step is "
                        "lost (docs/fault-tolerance.md#live-replacement). Off: the launcher "
                        "relaunches every worker and the job resumes from the newest checkpoint.")
    join_timeout_s: float = doc(120.0, "How long the waiting ranks give a started replacement "
                                "to join; past it they hand over to the launcher (relaunch).",
                                bounds=POSITIVE)
    max_replacements: int = doc(3, "Replacements per launch attempt; the next lost process "
                                "relaunches the workers.", bounds=NON_NEGATIVE)
    standby: bool = doc(True, "Each node's agent keeps one warm process (torch and the trainer "
                        "imported, ~0.3 GB of host memory, no GPU memory) that takes a lost "
                        "worker's place at once; without it a replacement first starts and "
                        "imports (seconds).")


@dataclass
class ResilienceConfig:
    in_process: bool = doc(True, "On an exception or a detected hang, every rank tears down, "
                           "re-rendezvouses and reloads the newest checkpoint without exiting "
                           "(a lost process is relaunched by the launcher instead).")
    max_in_process_restarts: int = doc(3, "In-process restarts in a row without progress (a "
                                       "generation that completes a step resets the count) "
                                       "before handing over to the launcher.")
    max_restarts: int = doc(5, "Worker-group relaunches by the TorchElastic agent over the "
                            "job's life (a process died, or in-process restarts ran out); 0 "
                            "ends the run at the first such failure.")
    restart_backoff_s: float = doc(1.0, "Back-off before a restart that follows another "
                                   "without progress: none for the first, then this, doubling "
                                   "(at most 30 s).")
    preemption_grace_s: float = doc(60.0, "After SIGTERM/SIGUSR1, or Ctrl-C (SIGINT: exit "
                                    "130; a second Ctrl-C stops at once without saving): "
                                    "finish the step, save, and exit within this many seconds.")
    mtbf_hours: Optional[float] = doc(None, "Expected hours between failures of this job, "
                                      "for checkpoint.interval=auto; null: the planner's cluster "
                                      "profile (megaresil/plan/profiles) scaled to the job's GPUs.",
                                      bounds=POSITIVE)
    watchdog: WatchdogConfig = section(WatchdogConfig, "Hang detection.")
    numerics: NumericsConfig = section(NumericsConfig, "Numerical faults: non-finite "
                                       "values, loss spikes, replicas that differ.")
    health: HealthConfig = section(HealthConfig, "Checks a node passes before it joins the job.")
    replacement: ReplacementConfig = section(ReplacementConfig, "Live replacement of a lost "
                                             "worker process, the healthy ranks kept running.")


@dataclass
class RunConfig:
    dir: str = doc("runs/default", "Run directory: metrics.jsonl, events.jsonl, tb/, checkpoints/.")


# The watchdog's and resilience's numbers, which their sections do not carry
# as field bounds.
SUPERVISION_BOUNDS = {
    "resilience.max_in_process_restarts": NON_NEGATIVE,
    "resilience.max_restarts": NON_NEGATIVE,
    "resilience.restart_backoff_s": NON_NEGATIVE,
    "resilience.preemption_grace_s": POSITIVE,
    "resilience.watchdog.initial_timeout_s": POSITIVE,
    "resilience.watchdog.setup_timeout_s": POSITIVE,
    "resilience.watchdog.checkpoint_timeout_s": POSITIVE,
    "resilience.watchdog.calibration_steps": POSITIVE,
    # A budget below the slowest observed duration would call normal steps hung.
    "resilience.watchdog.factor": Bounds(1),
    "resilience.watchdog.floor_s": POSITIVE,
    "resilience.watchdog.poll_s": POSITIVE,
    "resilience.watchdog.stall_s": POSITIVE,
    # The hard limit must lie beyond the budget, or every alarm would abort.
    "resilience.watchdog.slow_limit_factor": Bounds(1, low_open=True),
    "resilience.watchdog.heartbeat_s": POSITIVE,
    "resilience.watchdog.abort_poll_s": POSITIVE,
    "resilience.watchdog.store_ops_limit": POSITIVE,
    "resilience.watchdog.gil_timeout_s": POSITIVE,
}
