"""Every numeric recipe key is checked where the schema defines it: a value
outside its range is a recipe error (exit 2, one line naming the key and the
fix), never a crash in every worker or a silently wrong run."""
import dataclasses
import re
import subprocess
import sys

import pytest

from tests.harness.cli import ROOT
from megaresil.config import (SUPERVISION_BOUNDS, ConfigError, RecipeConfig, load_recipe,
                              numeric_fields)

TINY = ROOT / "recipes" / "gpt-tiny.yaml"

# (override, key named in the error); each value is just outside its range.
BAD = [
    ("optimizer.lr=-1", "optimizer.lr"),
    ("optimizer.lr=0", "optimizer.lr"),
    ("optimizer.lr=.inf", "optimizer.lr"),
    ("optimizer.min_lr=-0.003", "optimizer.min_lr"),
    ("optimizer.min_lr=0.5", "optimizer.min_lr"),  # above the recipe's lr (3e-3)
    ("optimizer.warmup_steps=-3", "optimizer.warmup_steps"),
    ("optimizer.decay_steps=0", "optimizer.decay_steps"),
    ("optimizer.beta1=-0.1", "optimizer.beta1"),
    ("optimizer.beta2=1.5", "optimizer.beta2"),
    ("optimizer.beta2=1.0", "optimizer.beta2"),
    ("optimizer.eps=0", "optimizer.eps"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay"),
    ("optimizer.grad_clip=-1", "optimizer.grad_clip"),
    ("optimizer.grad_clip=.nan", "optimizer.grad_clip"),
    ("model.dropout=1.0", "model.dropout"),
    ("model.attention_dropout=-0.1", "model.attention_dropout"),
    ("model.norm_eps=0", "model.norm_eps"),
    ("model.init_std=-0.02", "model.init_std"),
    ("model.rope_theta=0", "model.rope_theta"),
    ("model.num_kv_heads=-2", "model.num_kv_heads"),
    ("model.ffn_hidden_size=0", "model.ffn_hidden_size"),
    ("model.moe.num_experts=-1", "model.moe.num_experts"),
    ("model.moe.top_k=0", "model.moe.top_k"),
    ("model.moe.capacity_factor=0", "model.moe.capacity_factor"),
    ("model.moe.every_n_layers=0", "model.moe.every_n_layers"),
    ("data.valid_fraction=1.0", "data.valid_fraction"),
    ("train.seed=-1", "train.seed"),
    ("train.micro_batch_size=-4", "train.micro_batch_size"),
    ("train.eval_interval=-1", "train.eval_interval"),
    ("train.eval_batches=-2", "train.eval_batches"),
    ("train.exit_at_step=0", "train.exit_at_step"),
    ("checkpoint.interval=-5", "checkpoint.interval"),
    ("checkpoint.keep=-1", "checkpoint.keep"),
    ("resilience.max_restarts=-1", "resilience.max_restarts"),
    ("resilience.max_in_process_restarts=-1", "resilience.max_in_process_restarts"),
    ("resilience.preemption_grace_s=0", "resilience.preemption_grace_s"),
    ("resilience.watchdog.poll_s=0", "resilience.watchdog.poll_s"),
    ("resilience.watchdog.factor=0.5", "resilience.watchdog.factor"),
    ("resilience.watchdog.floor_s=-2", "resilience.watchdog.floor_s"),
    ("resilience.watchdog.calibration_steps=0", "resilience.watchdog.calibration_steps"),
    ("resilience.watchdog.gil_timeout_s=-1", "resilience.watchdog.gil_timeout_s"),
    ("faults=[{kind: slow, rank: 0, step: 1, seconds: -1}]", "faults[0].seconds"),
    ("model.head_dim=0", "model.head_dim"),
]


@pytest.mark.parametrize("override,key", BAD, ids=[b[0] for b in BAD])
def test_out_of_range_value_names_the_key_and_the_fix(override, key):
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, [override])
    assert str(err.value).startswith(f"{key}:") and "Fix:" in str(err.value)


# The four, and one per kind of bound, through the command a user runs.
CLI_BAD = [BAD[i] for i in (0, 3, 5, 8, 14, 22, 28, 33)]


def assert_one_line_refusal(result: subprocess.CompletedProcess, key: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megaresil: error: {key}:"), result.stderr
    assert "Fix:" in lines[0]


@pytest.mark.parametrize("override,key", CLI_BAD, ids=[b[0] for b in CLI_BAD])
def test_config_show_rejects_out_of_range_value_with_one_line(cli_main, override, key):
    assert_one_line_refusal(cli_main("config", "show", str(TINY), override, check=False), key)


@pytest.mark.parametrize("override,fix", [
    ("resilience.numerics.on_spike=off", "write one of the listed names (none turns it off)."),
    ("checkpoint.backend=yes", "write one of the listed names."),
])
def test_a_yaml_boolean_given_for_a_choice_says_how_yaml_read_it(override, fix):
    """`off` arrives as False (YAML 1.1): the fix says so instead of
    leaving the user with "Invalid value 'False'"."""
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, [override])
    assert "YAML reads on/off/yes/no as true/false" in str(err.value)
    assert str(err.value).endswith(fix)


def test_the_refusal_is_all_the_process_prints():
    """As its own process (`python -m megaresil`), with nothing else on stderr."""
    override, key = CLI_BAD[0]
    result = subprocess.run([sys.executable, "-m", "megaresil", "config", "show", str(TINY),
                             override], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert_one_line_refusal(result, key)


def test_edge_values_inside_the_ranges_are_accepted():
    cfg = load_recipe(TINY, ["optimizer.min_lr=0", "optimizer.warmup_steps=0",
                             "optimizer.beta1=0", "optimizer.grad_clip=0",
                             "optimizer.weight_decay=0", "optimizer.min_lr=3e-3",
                             "model.dropout=0.99", "train.seed=0", "checkpoint.keep=0",
                             "resilience.watchdog.factor=1"])
    assert cfg.optimizer.min_lr == cfg.optimizer.lr and cfg.train.seed == 0


def _numeric_keys(cls=RecipeConfig, prefix=""):
    """Every key whose declared type is a number (optional or not)."""
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _numeric_keys(type(default), f"{prefix}{f.name}.")
        elif re.search(r"\b(int|float)\b", str(f.type)) and "list[" not in str(f.type):
            yield f"{prefix}{f.name}"  # lists (profile.ranks) are checked by validate()


def test_every_numeric_key_declares_its_range():
    """A key added without a range would take any number again."""
    bounded = {key for key, _, bounds in numeric_fields(_all_numbers_set()) if bounds}
    assert sorted(set(_numeric_keys()) - bounded) == []
    assert set(SUPERVISION_BOUNDS) <= bounded


def _all_numbers_set() -> RecipeConfig:
    """The schema's defaults with its optional numbers given values, so each
    appears in `numeric_fields`."""
    cfg = RecipeConfig()
    cfg.model.num_kv_heads = cfg.model.ffn_hidden_size = cfg.model.head_dim = 1
    cfg.model.sliding_window = 1
    cfg.model.bos_token_id = cfg.model.eos_token_id = 1
    cfg.optimizer.decay_steps = cfg.optimizer.wsd_decay_steps = cfg.train.exit_at_step = 1
    cfg.logging.peak_tflops = cfg.resilience.mtbf_hours = 1.0
    cfg.checkpoint.interval = 1  # auto by default
    cfg.model.moe.expert_ffn_hidden_size = cfg.model.moe.capacity_factor = 1
    return cfg


def test_a_string_that_yaml_read_as_a_mapping_says_to_quote_it():
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, ['resilience.health.command=grep -q "Mode: On" /etc/x'])
    assert str(err.value).endswith(
        "Fix: YAML read the value as a mapping (`: ` or brackets in it): quote the whole value, "
        "e.g. resilience.health.command=\"'...'\" on a shell command line, or set it in the "
        "recipe file.")
    quoted = load_recipe(TINY, ["resilience.health.command='grep -q \"Mode: On\" /etc/x'"])
    assert quoted.resilience.health.command == 'grep -q "Mode: On" /etc/x'


MOE = ["model.flavour=llama", "model.moe.num_experts=4"]


@pytest.mark.parametrize("overrides,key,fix", [
    (["model.moe.num_experts=4"], "model.moe.num_experts", "set model.flavour=llama"),
    (MOE + ["model.moe.top_k=5"], "model.moe.top_k", "choose top_k between 1 and 4"),
    (MOE + ["model.moe.first_dense_layers=4"], "model.moe.first_dense_layers",
     "choose first_dense_layers below 4"),
    (MOE + ["model.moe.expert_ffn_hidden_size=100", "parallel.tp=1"],
     "model.moe.expert_ffn_hidden_size", "choose a multiple of 8"),
    (MOE + ["model.ffn_hidden_size=40"], "model.moe.expert_ffn_hidden_size",
     "choose a multiple of 16"),  # the recipe's tp=2
    (MOE + ["model.moe.shared_expert_hidden_size=24"], "model.moe.shared_expert_hidden_size",
     "choose a multiple of 16"),
    (MOE + ["model.hidden_size=196", "model.num_heads=2", "model.num_kv_heads=2",
            "model.moe.expert_ffn_hidden_size=64"], "model.hidden_size",
     "choose hidden_size a multiple of 8"),
    (MOE + ["model.backend=te"], "model.moe.num_experts", "set model.backend=local"),
    (["parallel.ep=2"], "parallel.ep", "set parallel.ep=1, or model.moe.num_experts > 0"),
    (MOE + ["parallel.ep=4"], "parallel.ep", "choose parallel.ep among the divisors of 2"),
    (MOE + ["parallel.dp=6", "parallel.ep=3"], "parallel.ep", "choose parallel.ep dividing 4"),
    (MOE + ["parallel.ep=2", "resilience.replacement.enabled=true"],
     "resilience.replacement.enabled", "set parallel.ep below 2, or "
     "resilience.replacement.enabled=false and checkpoint.local.enabled=true"),
    (MOE + ["model.moe.bias_update_rate=0.001", "model.recompute=full"],
     "model.moe.bias_update_rate", "set model.recompute=none or selective"),
    (['faults=[{kind: router_nan, rank: 0, step: 2}]'], "faults",
     "give the model experts (model.moe.num_experts), or drop the fault"),
])
def test_a_mixture_of_experts_the_model_cannot_build_is_refused(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, overrides)
    assert err.value.key == key and f"Fix: {fix}" in str(err.value) and "\n" not in str(err.value)


def test_the_default_is_dense_and_a_llama_may_have_experts():
    assert load_recipe(TINY).model.moe.num_experts == 0
    assert load_recipe(TINY, MOE).model.moe.top_k == 2
    assert load_recipe(TINY, MOE + ["parallel.ep=2"]).parallel.ep == 2
    # bf16 under ZeRO-1 at ep = dp: the experts' group of one rank keeps whole main copies.
    assert load_recipe(TINY, MOE + ["parallel.ep=2", "optimizer.distributed=true",
                                    "train.precision=bf16"]).parallel.ep == 2


def test_context_parallel_peers_are_a_live_copy_for_replacement():
    """At dp = 1, cp = 2 the cp peer holds a rank's whole state: live
    replacement is allowed (it was refused as if ep = dp held experts)."""
    from megaresil.config import no_live_copy
    cp2 = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "parallel.cp=2",
           "data.seq_len=32", "resilience.replacement.enabled=true"]
    assert no_live_copy(load_recipe(TINY, cp2)) is None
    alone = no_live_copy(load_recipe(TINY, cp2[:3] + ["resilience.replacement.enabled=true"]))
    assert alone is not None and not alone.refused
