"""The launcher's pre-flight: a launch that passes knows its workers and its
paths; the first check that fails refuses it before anything is written."""
from __future__ import annotations

import pytest

from megaresil.checkpoint.paths import RunPaths
from megaresil.config import ConfigError, load_recipe
from megaresil.launch.membership import Membership
from megaresil.launch.preflight import preflight
from tests.harness.cli import ROOT

TINY = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=2", "train.steps=2",
        "logging.progress=false", "logging.tensorboard=false"]


def recipe(tmp_path, *overrides: str, cache=None):
    return load_recipe(ROOT / "recipes/gpt-tiny.yaml",
                       [*TINY, f"run.dir={tmp_path / 'run'}",
                        f"data.cache_dir={cache or tmp_path / 'cache'}", *overrides])


def test_a_launch_that_passes_knows_its_workers_and_paths(tmp_path, demo_corpus):
    cfg = recipe(tmp_path, "checkpoint.local.enabled=true",
                 f"checkpoint.local.dir={tmp_path / 'local'}", cache=demo_corpus)
    flight = preflight(cfg, Membership())
    assert (flight.nproc, flight.gpus, flight.gpus_needed, flight.refusal) == (2, 0, 0, None)
    assert flight.run_dir.is_dir() and flight.run_dir == tmp_path / "run"
    assert flight.paths == RunPaths.of(cfg)
    assert flight.local_root == tmp_path / "local"
    assert preflight(recipe(tmp_path, cache=demo_corpus),
                     Membership(nproc_per_node=1)).local_root is None


def test_the_tier_rule_refuses_before_the_faults_and_data_and_writes_nothing(tmp_path):
    cfg = recipe(tmp_path, "checkpoint.local.enabled=true",
                 f"checkpoint.local.dir={tmp_path / 'run' / 'checkpoints' / 'local'}",
                 "faults=[{kind: kill, rank: 5, step: 1}]", "data.source=/nonexistent")
    with pytest.raises(ConfigError, match="inside the global checkpoint root"):
        preflight(cfg, Membership())
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
