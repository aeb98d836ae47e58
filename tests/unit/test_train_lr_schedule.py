"""The LR schedule (train/lr_schedule.py) against Megatron-Core's
`OptimizerParamScheduler` at every step of each decay style, today's cosine
bit for bit, and the recipe rules of the wsd knobs."""
import importlib.util
import math
import sys
import types
from pathlib import Path
from unittest import mock

import pytest

from megaresil.config import ConfigError, DecayStyle, OptimizerConfig, WSDDecayStyle, load_recipe
from megaresil.train.lr_schedule import lr_at
from tests.harness.cli import ROOT

TINY = ROOT / "recipes" / "gpt-tiny.yaml"
STEPS = 60
# (overrides, a case's name): warmup or none, a decay horizon of its own
# (min_lr after it) or train.steps', each style and wsd shape.
CASES = [
    ({"decay_style": "cosine"}, "cosine"),
    ({"decay_style": "cosine", "decay_steps": 30}, "cosine-short"),
    ({"decay_style": "linear"}, "linear"),
    ({"decay_style": "linear", "warmup_steps": 0, "decay_steps": 25}, "linear-nowarmup"),
    ({"decay_style": "constant"}, "constant"),
    ({"decay_style": "inverse_sqrt"}, "inverse_sqrt"),
    ({"decay_style": "inverse_sqrt", "warmup_steps": 0, "decay_steps": 40}, "inverse_sqrt-0"),
    *[({"decay_style": "wsd", "wsd_decay_style": style, "wsd_decay_steps": 20}, f"wsd-{style}")
      for style in ("linear", "cosine", "minus_sqrt", "exponential")],
    ({"decay_style": "wsd", "wsd_decay_steps": 12, "decay_steps": 30}, "wsd-short"),
]


def optimizer_cfg(**overrides) -> OptimizerConfig:
    """The schedule's keys as a recipe of STEPS steps would hold them."""
    styles = {"decay_style": DecayStyle, "wsd_decay_style": WSDDecayStyle}
    typed = {k: styles[k](v) if k in styles else v for k, v in overrides.items()}
    return OptimizerConfig(**{"lr": 3e-3, "min_lr": 2e-4, "warmup_steps": 7, **typed})


@pytest.fixture(scope="module")
def megatron_scheduler():
    """Megatron-Core's scheduler class, from its one file: importing
    megatron.core whole costs seconds, and the file needs only a logger."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "core" / "optimizer_param_scheduler.py"
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda *args, **kwargs: None
    with mock.patch.dict(sys.modules, {"megatron.core.utils": utils}):
        module_spec = importlib.util.spec_from_file_location("megatron_lr_scheduler", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    return module.OptimizerParamScheduler


def megatron_lrs(scheduler_class, cfg: OptimizerConfig, total_steps: int,
                 steps: int) -> list[float]:
    """Megatron's LR after 1..steps increments (`num_steps` = megaresil's
    step) for a run of `total_steps`."""
    style = {"inverse_sqrt": "inverse-square-root", "wsd": "WSD"}.get(cfg.decay_style.value,
                                                                      cfg.decay_style.value)
    optimizer = types.SimpleNamespace(param_groups=[{}])
    scheduler = scheduler_class(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=cfg.warmup_steps + cfg.decay_horizon(total_steps), lr_decay_style=style,
        start_wd=0.1, end_wd=0.1, wd_incr_steps=steps, wd_incr_style="constant",
        wsd_decay_steps=cfg.wsd_decay_steps,
        lr_wsd_decay_style=(cfg.wsd_decay_style.value if cfg.wsd_decay_style else "linear"))
    lrs = []
    for _ in range(steps):
        scheduler.step(1)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("overrides", [c for c, _ in CASES], ids=[name for _, name in CASES])
def test_every_step_trains_at_megatrons_lr(megatron_scheduler, overrides):
    cfg = optimizer_cfg(**overrides)
    steps = STEPS + 10  # past train.steps too: min_lr, or lr for constant
    ours = [lr_at(step, cfg, STEPS) for step in range(1, steps + 1)]
    theirs = megatron_lrs(megatron_scheduler, cfg, STEPS, steps)
    if cfg.decay_style.value == "cosine":  # its own older expression: equal to rounding
        assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)
    else:
        assert ours == theirs


def older_cosine(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """The schedule before there were decay styles, as it was written."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = cfg.decay_steps or max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("overrides", [{}, {"decay_steps": 30}, {"warmup_steps": 0},
                                       {"warmup_steps": 80}])
def test_the_default_cosine_is_the_older_schedule_bit_for_bit(overrides):
    cfg = optimizer_cfg(**overrides)
    assert cfg.decay_style.value == "cosine"
    for step in range(1, STEPS + 20):
        assert lr_at(step, cfg, STEPS) == older_cosine(step, cfg, STEPS)


def test_wsd_holds_the_peak_until_its_final_decay():
    cfg = optimizer_cfg(decay_style="wsd", wsd_decay_steps=20)
    lrs = {step: lr_at(step, cfg, STEPS) for step in range(1, STEPS + 1)}
    assert all(lrs[s] == cfg.lr for s in range(7, STEPS - 20 + 1))
    assert lrs[STEPS - 19] < cfg.lr and lrs[STEPS] == cfg.min_lr


def test_extending_a_wsd_run_in_its_stable_phase_keeps_every_trained_lr():
    """The resume rule: the LR is lr_at(step, the resumed recipe). A run of
    60 steps resumed at step 30 with train.steps=120 trained steps 1..30 at
    the LRs the 120-step run has for them, so it continues as that run."""
    cfg = optimizer_cfg(decay_style="wsd", wsd_decay_steps=20)
    assert [lr_at(s, cfg, STEPS) for s in range(1, 31)] == [lr_at(s, cfg, 120)
                                                           for s in range(1, 31)]
    cosine = optimizer_cfg()  # its horizon follows train.steps: the curve moves
    assert lr_at(31, cosine, STEPS) != lr_at(31, cosine, 120)


@pytest.mark.parametrize("overrides, key, words", [
    (["optimizer.decay_style=wsd"], "optimizer.wsd_decay_steps", "needs the length"),
    (["optimizer.decay_style=wsd", "optimizer.wsd_decay_steps=95"], "optimizer.wsd_decay_steps",
     "exceeds the 90 decay steps"),
    (["optimizer.decay_style=wsd", "optimizer.wsd_decay_steps=11", "optimizer.decay_steps=10"],
     "optimizer.wsd_decay_steps", "exceeds the 10 decay steps"),
    (["optimizer.wsd_decay_steps=10"], "optimizer.wsd_decay_steps", "decay_style=cosine"),
    (["optimizer.decay_style=linear", "optimizer.wsd_decay_style=cosine"],
     "optimizer.wsd_decay_style", "decay_style=linear"),
])
def test_wsd_knobs_out_of_place_are_refused_naming_the_fix(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, ["train.steps=100", "optimizer.warmup_steps=10", *overrides])
    assert err.value.key == key and words in str(err.value) and "Fix" in str(err.value)
