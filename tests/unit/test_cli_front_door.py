"""Issue 26's first-contact defects of the chaos, plan, ckpt, --from-hf,
straggler and Slurm paths: each test failed on the code before the fix."""
from __future__ import annotations

import pytest

from megaresil.cli import build_parser
from megaresil.cli.drills import CHAOS_SCENARIOS


def test_chaos_help_lists_every_scenario(monkeypatch):
    from megaresil.drills.scenarios import scenarios

    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping inside hyphenated names
    assert set(CHAOS_SCENARIOS) == set(scenarios(rank=1, step=3, save_step=2))
    chaos = build_parser()._subparsers._group_actions[0].choices["chaos"]
    help_text = chaos.format_help()
    for name in CHAOS_SCENARIOS:
        assert name in help_text


def test_chaos_takes_overrides_after_the_scenario(cli_main, monkeypatch):
    import megaresil.drills.chaos as chaos

    seen = {}

    def fake_run_scenario(recipe, overrides, name, **kwargs):
        seen.update(recipe=recipe, overrides=overrides, name=name)
        return {"recovered": True, "final_loss_equal": True}

    monkeypatch.setattr(chaos, "run_scenario", fake_run_scenario)
    monkeypatch.setattr(chaos, "format_result", lambda result: "ok")
    cli_main("chaos", "recipes/gpt-tiny.yaml", "train.steps=6", "--scenario", "kill-rank",
             "parallel.dp=2", "--timeout", "60", "data.seq_len=32")
    assert seen == {"recipe": "recipes/gpt-tiny.yaml", "name": "kill-rank",
                    "overrides": ["train.steps=6", "parallel.dp=2", "data.seq_len=32"]}


def test_chaos_refuses_an_unknown_scenario(cli_main):
    with pytest.raises(SystemExit) as exc:
        cli_main("chaos", "recipes/gpt-tiny.yaml", "--scenario", "no-such")
    assert exc.value.code == 2


def write_ordinary_run(run_dir, *, steps: int = 10, step_s: float = 0.5,
                       startup_s: float = 12.0, launched: float = 1000.0):
    """A run's metrics.jsonl and events.jsonl as training writes them: one
    launch, saves every 2 steps, no failure (so no measured relaunch)."""
    from tests.harness.run_records import write_run_records

    run_dir.mkdir(parents=True)
    tokens_per_step = 1024
    records = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 1.0,
                "tokens": s * tokens_per_step, "tokens_per_s": tokens_per_step / step_s,
                "elapsed_s": s * step_s, "time": launched + startup_s + s * step_s}
               for s in range(1, steps + 1)]
    events = [{"time": launched + 1.0, "event": "generation_started", "rank": 0,
               "generation": 0, "launched_at": launched}]
    write_run_records(run_dir, records, events)


def test_plan_on_an_ordinary_run_estimates_the_relaunch(cli_main, tmp_path):
    import json

    run = tmp_path / "run"
    write_ordinary_run(run, startup_s=12.0, step_s=0.5)
    result = cli_main("plan", str(run), "--gpus", "1024", "--mtbf-hours", "25000")
    lines = result.stdout.strip().splitlines()
    assert "estimate" in result.stdout
    assert "job MTBF 24.4 h" in lines[0]  # 25000 GPU-hours / 1024 GPUs
    assert "steps (" in result.stdout and "min)" in result.stdout
    report = json.loads(cli_main("plan", str(run), "--gpus", "1024", "--mtbf-hours", "25000",
                                 "--json").stdout)
    # launch -> start of the first step's compute: 12 s + 0.5 s - 0.5 s
    assert report["restart_s"]["relaunch"] == pytest.approx(12.0)
    assert report["relaunch_estimated"] is True
    best = max(report["policies"], key=lambda r: r["expected_goodput"])
    assert lines[-1] == f"checkpoint.interval={best['best_interval_steps']}"


def test_plan_on_a_run_without_saves_says_what_to_do(cli_main, tmp_path):
    import json

    run = tmp_path / "run"
    write_ordinary_run(run)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events
                                              if e["event"] != "checkpoint_saved"))
    result = cli_main("plan", str(run), "--gpus", "8", check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("megaresil: error:") and "checkpoint.interval" in result.stderr


@pytest.fixture
def run_with_checkpoints(tmp_path):
    """A run directory as a user has it: checkpoints/step_0000003 (a tiny
    model imported from Hugging Face, no training), `latest` naming it."""
    import transformers

    from megaresil.checkpoint import format as fmt
    from megaresil.cli import main

    hf_dir, run = tmp_path / "hf", tmp_path / "run"
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300,
                                     n_positions=256, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(hf_dir)
    root = run / "checkpoints"
    assert main(["convert", "--from-hf", str(hf_dir), str(root / fmt.step_dir_name(3))]) == 0
    fmt.update_latest(root, fmt.step_dir_name(3))
    return run


@pytest.mark.parametrize("where", ["run", "run/checkpoints", "run/checkpoints/latest"])
def test_ckpt_commands_take_a_run_dir_a_root_or_latest(cli_main, run_with_checkpoints, where):
    import json

    path = str(run_with_checkpoints.parent / where)
    step_dir = run_with_checkpoints / "checkpoints" / "step_0000003"
    verified = cli_main("ckpt", "verify", path)
    assert verified.stdout.startswith(f"OK {step_dir}:")
    assert "step_0000003" in verified.stderr and len(verified.stderr.splitlines()) == 1
    info = json.loads(cli_main("ckpt", "inspect", path, "--json").stdout)
    assert info["step"] == 0 and info["path"] == str(step_dir)
    assert cli_main("ckpt", "diff", path, str(step_dir)).returncode == 0


def test_a_root_walks_back_past_an_unfinished_checkpoint(cli_main, run_with_checkpoints):
    (run_with_checkpoints / "checkpoints" / "step_0000009").mkdir()  # no marker: a torn save
    # Newest first, as a resume takes them, whatever `latest` says (a hint, not checksummed).
    for latest in ("step_0000003", "step_0000009", None):
        if latest is None:
            (run_with_checkpoints / "checkpoints" / "latest").unlink()
        else:
            (run_with_checkpoints / "checkpoints" / "latest").write_text(latest + "\n")
        result = cli_main("ckpt", "inspect", str(run_with_checkpoints))
        assert "using " in result.stderr and "step_0000003" in result.stderr
        assert "skipped step_0000009: " in result.stderr


def test_inspect_prints_a_summary_and_the_tensors_on_request(cli_main, run_with_checkpoints):
    summary = cli_main("ckpt", "inspect", str(run_with_checkpoints)).stdout
    fields = [line.split()[0] for line in summary.splitlines()]
    assert fields == ["checkpoint", "step", "backend", "layout", "parameters", "model",
                      "tensors", "bytes/rank"]
    assert "num_layers=2 hidden_size=32" in summary
    assert "model/layers.1.mlp.fc.weight" not in summary
    listing = cli_main("ckpt", "inspect", str(run_with_checkpoints), "--tensors").stdout
    assert "model/layers.1.mlp.fc.weight" in listing
    # parameters: GPT-2's embeddings, blocks and final norm (the head is tied)
    assert f"{sum(p.numel() for p in _gpt2_params(run_with_checkpoints)):,}" in summary


def _gpt2_params(run):
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(run.parent / "hf").parameters()


def test_diff_lists_only_the_differing_tensors(cli_main, run_with_checkpoints, tmp_path):
    from megaresil.checkpoint.offline.diff import DiffReport, KeyDiff, format_report

    report = DiffReport(keys=[KeyDiff("model/a", True, True, 0.0, 0.0),
                              KeyDiff("model/b", False, False, 1.0, 0.5)])
    lines = format_report(report).splitlines()
    assert lines[0].startswith("model/b ") and "DIFFERENT" in lines[0]
    assert lines[1] == "2 common tensors, 1 identical, 1 not identical, 0 only in A, 0 only in B"
    assert len(lines) == 2


def test_a_rank_alone_in_its_stage_is_not_judged():
    """tp1 x pp2 x dp1: the last stage's forward_backward is 1.8x the first's
    on a healthy run (defect 7's false straggler_detected rank 1)."""
    from megaresil.resilience.stragglers import judge

    table = [{"steps": 2, "first": 3, "mem_peak_mb": 100.0,
              "sections": {"forward_backward": {"cpu_s": cpu, "wall_s": cpu}}}
             for cpu in (0.10, 0.183)]
    found = judge(table, pp=2, threshold=1.5)
    assert found["slow"] == []
    assert found["ratios"] == {0: {"forward_backward": 1.0}, 1: {"forward_backward": 1.0}}
    assert found["scores"] == {0: 1.0, 1: 1.0}
    assert judge(table, pp=1, threshold=1.5)["slow"] != []  # one stage: compared


def test_a_slurm_mismatch_names_the_layout_that_fits():
    from megaresil.config import ConfigError
    from megaresil.slurm import SlurmStep

    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "16",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_STEP_NODELIST": "gpu1,gpu2"}
    with pytest.raises(ConfigError, match="--nodes=2 --ntasks-per-node=4") as err:
        SlurmStep.from_environ(env).worker_env(world=8)
    assert "16 tasks (2 node(s) x 8)" in str(err.value)
    with pytest.raises(ConfigError, match="--nodes=1 --ntasks-per-node=3"):
        SlurmStep.from_environ(env).worker_env(world=3)


def test_the_manuals_slurm_examples_fit_their_recipe():
    """Each `sbatch ... tools/slurm/train.sbatch RECIPE` command of the manual
    (README and docs/clusters.md, continuation lines joined): nodes x ranks
    per node (tasks per rank, else GPUs per node) = tp*pp*dp."""
    import re
    import shlex

    from megaresil.config import find_recipe, load_recipe
    from tests.harness.cli import ROOT

    text = "\n".join((ROOT / page).read_text() for page in ("README.md", "docs/clusters.md"))
    commands = text.replace("\\\n", " ").splitlines()
    examples = [shlex.split(line) for line in commands
                if line.startswith("sbatch ") and "tools/slurm/train.sbatch" in line]
    assert examples
    template = (ROOT / "tools/slurm/train.sbatch").read_text()
    assert re.search(r"^#+SBATCH --gpus-per-node=", template, re.M)
    assert re.search(r"^#SBATCH --time=", template, re.M) and "MEGARESIL_ACTIVATE" in template
    for argv in examples:
        flags = dict(a.removeprefix("--").split("=", 1) for a in argv if a.startswith("--"))
        recipe = argv[argv.index("tools/slurm/train.sbatch") + 1]
        p = load_recipe(find_recipe(recipe), []).parallel
        per_node = int(flags.get("ntasks-per-node", 1))
        ranks_per_node = per_node if per_node > 1 else int(flags["gpus-per-node"])
        assert int(flags["nodes"]) * ranks_per_node == p.tp * p.pp * p.dp, argv


def save_plain_llama(directory):
    """A tiny random Llama saved as the published Llama files without RoPE
    scaling are: "rope_scaling": null beside "rope_theta"."""
    import json

    from tests.harness.hf import llama32_style

    llama32_style(rope_parameters=None, rope_theta=500000.0).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_theta=500000.0, rope_scaling=None)
    (directory / "config.json").write_text(json.dumps(config))


LLAMA_SMALL = ["data.seq_len=32", "data.source=synthetic", "data.path=null"]


def test_a_llama_without_rope_scaling_fits_a_recipe_that_declares_it(cli_main, tmp_path):
    """recipes/llama-3.2-1b.yaml has llama3 scaling (factor 32); the import
    replaces model.* with DIR's, so no scaling: the factor it does not use is
    not compared, and config show --from-hf prints the resolved recipe."""
    import yaml

    save_plain_llama(tmp_path / "hf")
    result = cli_main("config", "show", "recipes/llama-3.2-1b.yaml", "--from-hf",
                      str(tmp_path / "hf"), *LLAMA_SMALL, f"run.dir={tmp_path / 'run'}")
    resolved = yaml.safe_load(result.stdout)
    assert resolved["model"]["rope_scaling"]["type"] == "none"
    assert resolved["model"]["num_layers"] == 4
    assert resolved["checkpoint"]["init_from"] == str((tmp_path / "hf").resolve())
    block = result.stderr.splitlines()
    assert block.count("megaresil: --from-hf replaces the recipe's values (recipe -> "
                       "config.json):") == 1
    assert any(line.split() == ["model.rope_scaling.type", "'llama3'", "->", "'none'"]
               for line in block)


def test_a_different_model_is_refused_before_any_worker_starts(cli_main, tmp_path):
    save_plain_llama(tmp_path / "hf")
    run = tmp_path / "run"
    result = cli_main("train", "recipes/llama-3.2-1b.yaml", "--from-hf", str(tmp_path / "hf"),
                      *LLAMA_SMALL, "model.rope_theta=10000", f"run.dir={run}", check=False)
    assert result.returncode == 2, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert "rope_theta=500000.0 (this recipe: 10000.0)" in error
    assert "--from-hf" in error and "use --from-hf" not in error  # not the command just run
    assert not (run / "events.jsonl").exists()  # no worker started


def test_output_piped_into_head_ends_without_a_traceback():
    """`megaresil config docs | head`: the reader closing the pipe is not a
    crash; the command exits as SIGPIPE would (141), silently. The reader
    here is gone before the first write (the whole text would fit in a pipe
    buffer, so a reader that leaves later may find it all written)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    megaresil = Path(sys.executable).parent / "megaresil"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([str(megaresil), "config", "docs"], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and result.stderr == ""
    assert result.returncode == 141
