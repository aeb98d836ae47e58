"""User journeys of issue 26's front door: --from-hf a tiny Llama (with and
without RoPE scaling), train, export; chaos with overrides after the
scenario; plan, inspect, verify and convert by run directory. Through the
installed `megaresil`, from a fresh directory (pytest -m journey)."""
from __future__ import annotations

import json

import pytest

from tests.harness.cli import ROOT
from tests.harness.journey import home, megaresil  # noqa: F401  (home: a fixture)

pytestmark = pytest.mark.journey

RECIPES = ROOT / "recipes"
GPT_TINY = [str(RECIPES / "gpt-tiny.yaml"), "parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
            "data.source=synthetic", "data.seq_len=32", "model.num_layers=2",
            "model.hidden_size=64", "model.num_heads=4", "train.micro_batch_size=2",
            "train.global_batch_size=4", "train.eval_batches=0", "logging.progress=false",
            "logging.tensorboard=false"]


def save_llama(directory, scaled: bool) -> None:
    """A tiny random Llama: with Llama 3 RoPE scaling, or as the published
    files without it are ("rope_scaling": null)."""
    from tests.harness.hf import llama32_style

    if scaled:
        llama32_style(num_hidden_layers=2).save_pretrained(directory)
        return
    llama32_style(num_hidden_layers=2, rope_parameters=None,
                  rope_theta=500000.0).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_theta=500000.0, rope_scaling=None)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("scaled", [False, True], ids=["no-rope-scaling", "llama3-scaling"])
def test_from_hf_llama_trains_and_exports(home, scaled):
    import transformers

    save_llama(home / "tiny-llama", scaled)
    train = ["train", str(RECIPES / "llama-3.2-1b.yaml"), "--from-hf", "tiny-llama",
             "run.dir=runs/llama", "data.source=synthetic", "data.path=null", "data.seq_len=32",
             "parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "train.micro_batch_size=2",
             "train.global_batch_size=2", "train.steps=2", "train.eval_batches=0",
             "checkpoint.interval=2", "logging.progress=false", "logging.tensorboard=false"]
    first = megaresil(*train, cwd=home)
    assert first.stderr.count("--from-hf replaces the recipe's values") == 1
    megaresil("convert", "runs/llama", "--to-hf", "exported", cwd=home)
    config = json.loads((home / "exported" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == ("llama3" if scaled else "default")
    assert transformers.AutoModelForCausalLM.from_pretrained(home / "exported") is not None
    again = megaresil(*train, "train.steps=3", cwd=home)  # a resume: no block again
    assert "--from-hf replaces" not in again.stderr


def test_chaos_takes_overrides_after_the_scenario(home):
    result = megaresil("chaos", *GPT_TINY[:1], "--scenario", "kill-rank", *GPT_TINY[1:],
                       "train.steps=4", "run.dir=runs/chaos", "--timeout", "400", cwd=home)
    assert "recovered" in result.stdout.lower()
    assert (home / "runs" / "chaos").is_dir()


def test_plan_inspect_verify_and_convert_by_run_directory(home):
    megaresil("train", *GPT_TINY, "train.steps=4", "checkpoint.interval=2", "run.dir=runs/a",
              cwd=home)
    plan = megaresil("plan", "runs/a", "--gpus", "1024", cwd=home)
    assert "estimate" in plan.stdout and "min)" in plan.stdout
    # The control plane's figures come with the package (bench/ is not installed).
    assert "control plane at 16,384 GPUs (measured, simulated at 16,384 ranks; packaged " \
        "plan/profiles/control_plane.yaml, copied from " in plan.stdout
    assert plan.stdout.strip().splitlines()[-1].startswith("checkpoint.interval=")

    inspect = megaresil("ckpt", "inspect", "runs/a", cwd=home)
    assert "step_0000004" in inspect.stderr
    assert inspect.stdout.splitlines()[1].split()[:2] == ["step", "4"]
    assert "parameters" in inspect.stdout
    info = json.loads(megaresil("ckpt", "inspect", "runs/a/checkpoints", "--json", cwd=home).stdout)
    assert info["step"] == 4
    verify = megaresil("ckpt", "verify", "runs/a/checkpoints/latest", cwd=home)
    assert verify.stdout.startswith("OK ") and "step_0000004" in verify.stdout

    megaresil("convert", "runs/a", "converted", "--dp", "2", cwd=home)
    diff = megaresil("ckpt", "diff", "runs/a", "converted", cwd=home)
    assert diff.stdout.strip().splitlines()[-1].startswith(f"{len(info['tensors'])} common")
