"""A run's paths from its recipe (RunPaths): where the checkpoints and the
local tier's shards go, and the rule that keeps the local tier out of the
global checkpoint root."""
from __future__ import annotations

from pathlib import Path

import pytest

from megaresil.checkpoint.paths import RunPaths, default_local_root
from megaresil.config import ConfigError, load_recipe
from tests.harness.dist import RECIPE, TINY


def paths_of(tmp_path: Path, *overrides: str) -> RunPaths:
    return RunPaths.of(load_recipe(RECIPE, TINY + [f"run.dir={tmp_path / 'run'}", *overrides]))


def test_the_defaults_are_the_run_directorys_checkpoints_and_a_node_local_root(tmp_path):
    paths = paths_of(tmp_path)
    assert paths.run_dir == tmp_path / "run"
    assert paths.checkpoint_root == tmp_path / "run" / "checkpoints"
    assert paths.local_default and paths.local_root == default_local_root(tmp_path / "run")
    assert paths.local_tier_root() is None  # the tier is off
    assert paths.local_run_dir("ab12") == paths.local_root / "run-ab12"


def test_the_recipe_chooses_both_roots(tmp_path):
    paths = paths_of(tmp_path, f"checkpoint.dir={tmp_path / 'shared'}",
                     f"checkpoint.local.dir={tmp_path / 'shm'}", "checkpoint.local.enabled=true")
    assert paths.checkpoint_root == tmp_path / "shared"
    assert not paths.local_default and paths.local_tier_root() == tmp_path / "shm"


def test_the_default_local_root_is_one_per_run_directory(tmp_path):
    assert default_local_root(tmp_path / "a") == default_local_root(tmp_path / "a")
    assert default_local_root(tmp_path / "a") != default_local_root(tmp_path / "b" / "a")
    assert default_local_root(tmp_path / "a").name.startswith("a-")


@pytest.mark.parametrize("local", ["run/checkpoints", "run/checkpoints/local"])
def test_a_local_root_in_the_checkpoint_root_is_refused_naming_the_key(tmp_path, local):
    paths = paths_of(tmp_path, f"checkpoint.local.dir={tmp_path / local}",
                     "checkpoint.local.enabled=true")
    with pytest.raises(ConfigError, match="checkpoint.local.dir: .* lies inside the global "
                                          "checkpoint root"):
        paths.local_tier_root()
    paths_of(tmp_path, f"checkpoint.local.dir={tmp_path / 'run' / 'local'}").check()  # beside it
