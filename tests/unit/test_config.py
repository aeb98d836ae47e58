"""Recipe loading, composition, overrides and validation errors."""
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from megaresil.config import (
    ConfigError,
    Flavour,
    RecipeConfig,
    field_docs,
    load_recipe,
    loading,
    validate_world_size,
)
from megaresil.config.faults import parse_faults
from megaresil.config.loading import to_dict
from tests.harness.cli import ROOT

TINY = ROOT / "recipes" / "gpt-tiny.yaml"


def test_recipe_composes_pieces_and_overrides():
    cfg = load_recipe(TINY, ["train.steps=7", "model.flavour=llama", "parallel.dp=4",
                            "train.global_batch_size=32"])
    assert cfg.model.hidden_size == 192  # from configs/model/gpt-tiny.yaml
    assert cfg.data.source == "shakespeare"  # from configs/data/shakespeare.yaml
    assert cfg.parallel.tp == 2 and cfg.parallel.pp == 2  # from configs/parallel/3d-cpu.yaml
    assert cfg.train.steps == 7 and cfg.model.flavour == Flavour.llama and cfg.parallel.dp == 4


def test_override_values_are_yaml():
    cfg = load_recipe(TINY, ["model.num_kv_heads=null", "optimizer.lr=1e-2"])
    assert cfg.model.num_kv_heads is None and cfg.optimizer.lr == 0.01


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_loads(recipe):
    load_recipe(recipe)


def omegaconf_dict(cfg: RecipeConfig) -> dict:
    """to_dict as OmegaConf converts a recipe (config/loading.py's fallback)."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    data["faults"] = [fault.to_dict() for fault in parse_faults(cfg.faults)]
    return loading._rename_aliased(data, to_fields=False)


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_a_recipe_as_a_dict_is_omegaconfs_to_the_key_order(recipe):
    cfg = load_recipe(recipe, ["faults=[{kind: kill, rank: 0, step: 3}]", "profile.ranks=[0, 1]"])
    cfg.train.rampup_batch_size, cfg.data.paths = [8, 8, 100], [0.5, "a", 0.5, "b"]
    loading._plain(cfg, RecipeConfig)  # the fast conversion, not its fallback
    assert yaml.safe_dump(to_dict(cfg), sort_keys=False) == yaml.safe_dump(omegaconf_dict(cfg),
                                                                           sort_keys=False)


def test_a_value_of_another_type_than_its_field_converts_as_omegaconf_does():
    cfg = load_recipe(TINY)
    cfg.optimizer.lr = 3  # an int in a float field
    with pytest.raises(loading._NotPlain):
        loading._plain(cfg, RecipeConfig)
    assert to_dict(cfg) == omegaconf_dict(cfg) and to_dict(cfg)["optimizer"]["lr"] == 3.0


BAD = [
    (["parallel.vpp=3"], "model.num_layers"),  # 4 layers over pp*vpp = 6 chunks
    (["parallel.vpp=2", "train.micro_batch_size=8"], "train.global_batch_size"),  # 1 micro-batch
    (["parallel.vpp=2", "parallel.schedule=1f1b"], "parallel.schedule"),
    (["parallel.pp=1", "parallel.vpp=2"], "parallel.vpp"),
    (["model.flavour=llama", "model.num_kv_heads=4"], "model.num_kv_heads"),
    (["model.flavour=llama", "model.num_kv_heads=1"], "parallel.tp"),  # tp=2 > kv heads
    (["model.hiden_size=3"], "model.hiden_size"),
    (["train.steps=many"], "train.steps"),
    (["model.num_heads=5"], "model.num_heads"),
    (["model.flavour=llama", "model.head_dim=15"], "model.head_dim"),  # RoPE rotates halves
    (["parallel.tp=4"], "parallel.tp"),  # 6 heads
    (["parallel.pp=3"], "model.num_layers"),
    (["train.global_batch_size=20"], "train.global_batch_size"),
    (["model.flavour=bert"], "model.flavour"),
    (["train.steps=0"], "train.steps"),
    (["data.seq_len=4096"], "data.seq_len"),
    (["nonsense"], "nonsense"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[b[1] for b in BAD])
def test_bad_recipe_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, overrides)
    assert str(err.value).startswith(key)
    assert "Fix:" in str(err.value)


def test_a_head_dim_frees_the_heads_from_dividing_the_width():
    with pytest.raises(ConfigError, match="10 heads do not divide hidden_size"):
        load_recipe(TINY, ["model.num_heads=10"])
    assert load_recipe(TINY, ["model.num_heads=10", "model.head_dim=16"]).model.head_dim == 16


def test_world_size_mismatch_names_the_fix():
    cfg = load_recipe(TINY, [])
    with pytest.raises(ConfigError, match="world size is 3"):
        validate_world_size(cfg, 3)
    # tp*pp=4 fits no dp in 3 ranks: the fix may not propose one
    with pytest.raises(ConfigError, match=r"choose parallel.tp\*pp \(now 4\) dividing 3"):
        validate_world_size(cfg, 3)
    with pytest.raises(ConfigError, match="change parallel.dp to 3"):
        validate_world_size(cfg, 12)


def test_every_field_is_documented():
    undocumented = [key for key, _, _, text in field_docs() if not text]
    assert not undocumented


def test_cli_rejects_bad_recipe_with_one_line_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: [model/gpt-tiny]\nmodel: {num_heads: 5}\n")
    result = subprocess.run([sys.executable, "-m", "megaresil", "train", str(bad)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.num_heads" in lines[0], result.stderr


def test_list_defaults_are_not_shared_between_instances():
    first, second = RecipeConfig(), RecipeConfig()
    first.faults.append({"kind": "kill", "rank": 0, "step": 1})
    assert second.faults == [] and RecipeConfig().faults == []


def test_defaults_cannot_leave_configs(tmp_path):
    """`defaults: [../x]` and absolute paths are refused, not loaded."""
    secret = tmp_path / "outside" / "secret.yaml"
    secret.parent.mkdir()
    secret.write_text("train: {steps: 3}\n")
    recipes = tmp_path / "a" / "b" / "recipes"
    recipes.mkdir(parents=True)
    for name in ("../../../outside/secret", str(secret)):
        recipe = recipes / "r.yaml"
        recipe.write_text(f"defaults: [{name}]\n")
        with pytest.raises(ConfigError, match="leaves configs"):
            load_recipe(recipe)


def test_recipe_aliases_are_refused_through_the_cli(tmp_path):
    """A billion-laughs recipe is refused at once, naming the alias."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    recipe = tmp_path / "laughs.yaml"
    recipe.write_text("\n".join(lines) + "\n")
    result = subprocess.run([sys.executable, "-m", "megaresil", "config", "show", str(recipe)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "alias" in result.stderr and "laughs.yaml" in result.stderr


def test_a_recipes_pieces_are_found_however_its_path_is_written(tmp_path, monkeypatch):
    """configs/ beside recipes/ is found from `recipes/wide.yaml` and from
    `wide.yaml` inside recipes/ alike (the bare name had no parent to climb)."""
    (tmp_path / "configs" / "model").mkdir(parents=True)
    (tmp_path / "configs" / "model" / "wide.yaml").write_text("model: {hidden_size: 96}\n")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "wide.yaml").write_text("defaults: [model/wide]\n")
    monkeypatch.chdir(tmp_path)
    assert load_recipe("recipes/wide.yaml", []).model.hidden_size == 96
    monkeypatch.chdir(tmp_path / "recipes")
    assert load_recipe("wide.yaml", []).model.hidden_size == 96


def test_a_value_of_the_wrong_type_is_one_sentence_then_the_fix():
    with pytest.raises(ConfigError, match=r"Integer\. Fix: give a value"):
        load_recipe(TINY, ["train.steps=ten"])
