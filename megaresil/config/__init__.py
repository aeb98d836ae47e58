"""The recipe: its typed schema (`schema`, `run`, `faults`, `fields`), how a recipe is
composed from configs/ and overrides (`loading`), and the rules that span
fields (`validation`). Everything a caller needs is importable from here."""
from megaresil.config.batch import BatchRamp, batch_start_at_or_below, global_batch_at
from megaresil.config.faults import (
                                     FAULT_KINDS,
                                     HANG_MODES,
                                     SECTIONS,
                                     STEP_FAULT_KINDS,
                                     FaultKind,
                                     FaultSpec,
                                     FlipTarget,
                                     HangMode,
                                     parse_fault,
                                     parse_faults,
)
from megaresil.config.fields import (
                                     FRACTION,
                                     KEY_ALIASES,
                                     NON_NEGATIVE,
                                     POSITIVE,
                                     SEED,
                                     Bounds,
                                     ConfigError,
)
from megaresil.config.loading import (
                                     PACKAGED_RECIPES,
                                     REPO_CONFIGS,
                                     find_recipe,
                                     from_dict,
                                     load_recipe,
                                     model_from_dict,
                                     packaged_recipes,
                                     parse_override,
                                     to_dict,
                                     to_yaml,
)
from megaresil.config.optimizer import DecayStyle, OptimizerConfig, WSDDecayStyle
from megaresil.config.run import (
                                     SUPERVISION_BOUNDS,
                                     CheckpointBackend,
                                     CheckpointConfig,
                                     HealthConfig,
                                     LocalCheckpointConfig,
                                     LoggingConfig,
                                     MlflowConfig,
                                     ProfileConfig,
                                     ReplacementConfig,
                                     ResilienceConfig,
                                     RunConfig,
                                     SpikePolicy,
                                     WandbConfig,
                                     WatchdogConfig,
)
from megaresil.config.schema import (
                                     FP8,
                                     ActivationOffload,
                                     Backend,
                                     ContextComm,
                                     DataConfig,
                                     Flavour,
                                     ModelConfig,
                                     MoEConfig,
                                     ParallelConfig,
                                     PipelineSchedule,
                                     Precision,
                                     RecipeConfig,
                                     Recompute,
                                     RecomputePolicy,
                                     RopeScalingConfig,
                                     RopeScalingType,
                                     RouterScore,
                                     TrainConfig,
                                     attention_head_dim,
                                     field_docs,
                                     microbatches_per_step,
                                     resolved_schedule,
)
from megaresil.config.validation import (
    NoLiveCopy,
    no_live_copy,
    numeric_fields,
    validate,
    validate_world_size,
)

__all__ = [
    "FAULT_KINDS", "HANG_MODES", "SECTIONS", "STEP_FAULT_KINDS", "FaultKind", "FaultSpec",
    "FlipTarget", "HangMode", "parse_fault", "parse_faults",
    "FRACTION", "KEY_ALIASES", "NON_NEGATIVE", "POSITIVE", "SEED", "Bounds", "ConfigError",
    "PACKAGED_RECIPES", "REPO_CONFIGS", "find_recipe", "from_dict", "load_recipe",
    "model_from_dict", "packaged_recipes", "parse_override", "to_dict", "to_yaml",
    "SUPERVISION_BOUNDS", "CheckpointBackend", "CheckpointConfig", "HealthConfig",
    "LocalCheckpointConfig",
    "LoggingConfig", "MlflowConfig", "ProfileConfig", "ReplacementConfig", "ResilienceConfig", "RunConfig",
    "SpikePolicy", "WandbConfig", "WatchdogConfig",
    "FP8", "ActivationOffload", "Backend", "ContextComm", "DataConfig", "DecayStyle", "Flavour", "ModelConfig",
    "MoEConfig", "OptimizerConfig", "ParallelConfig", "PipelineSchedule", "Precision", "RecipeConfig",
    "Recompute", "RecomputePolicy", "RopeScalingConfig", "RopeScalingType", "RouterScore", "TrainConfig",
    "WSDDecayStyle",
    "attention_head_dim", "field_docs", "microbatches_per_step", "resolved_schedule",
    "BatchRamp", "batch_start_at_or_below", "global_batch_at",
    "NoLiveCopy", "no_live_copy", "numeric_fields", "validate", "validate_world_size",
]
