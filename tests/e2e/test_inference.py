"""`megaresil eval` and `megaresil generate` on a saved run, in one process.

The run is trained by the CLI in a subprocess, as users train; the commands
on it run by the CLI's main() in this process (the cli_main fixture): at one
rank they start no process of their own, and each subprocess would import
torch again (~10 s a command on 2 cores)."""
import json

import pytest
import torch

from tests.harness.cli import megaresil_cli

TINY = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "train.steps=4", "data.seq_len=32",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_batches=2",
        "train.eval_interval=2", "checkpoint.interval=2", "logging.tensorboard=false",
        "logging.progress=false"]


pytestmark = pytest.mark.slow  # a short training run, then the commands on it


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("inference") / "run"
    megaresil_cli("train", "gpt-tiny", *TINY, f"run.dir={run}")
    return run


def test_eval_equals_the_runs_own_eval_at_that_step(cli_main, run_dir):
    written = {r["step"]: r["eval_loss"] for r in map(json.loads,
               (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r}
    for target, step in ((run_dir / "checkpoints/step_0000002", 2), (run_dir, 4)):
        out = cli_main("eval", str(target), "--json").stdout
        result = json.loads(out.splitlines()[-1])
        assert result["step"] == step and result["loss"] == written[step]
        assert result["perplexity"] == pytest.approx(torch.tensor(written[step]).exp().item())
    line = cli_main("eval", str(run_dir), "--batches", "1").stdout.splitlines()[-1]
    assert line.startswith("step 4: valid loss ") and "perplexity" in line


def test_greedy_generation_equals_transformers_on_the_hf_export(cli_main, run_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    cli_main("convert", str(run_dir / "checkpoints/step_0000004"), "--to-hf",
             str(tmp_path / "hf"))
    out = cli_main("generate", str(run_dir), "--prompt", "ROMEO: What light",
                   "--max-new-tokens", "12", "--json").stdout
    ours = json.loads(out.splitlines()[-1])
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = tokenizer("ROMEO: What light", return_tensors="pt").input_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    theirs = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                            pad_token_id=0)
    assert ours["token_ids"] == theirs[0, prompt.shape[1]:].tolist()


def test_sampling_is_seeded(cli_main, run_dir):
    def sample(seed: str) -> list[int]:
        out = cli_main("generate", str(run_dir), "--prompt", "KING", "--temperature",
                       "1.0", "--top-k", "50", "--seed", seed, "--max-new-tokens", "8",
                       "--json").stdout
        return json.loads(out.splitlines()[-1])["token_ids"]
    assert sample("1") == sample("1") != sample("2")


def test_eval_and_generate_on_a_checkpoint_with_live_replacement_on(cli_main, run_dir, tmp_path):
    """Live replacement plans each generation's state over the job's process
    groups; one inference process has none, and must still read the model."""
    live = tmp_path / "live"
    cli_main("convert", str(run_dir), str(live), "--set", "resilience.replacement.enabled=true")

    def result(command: str, target, *args: str) -> dict:
        out = cli_main(command, str(target), *args, "--json").stdout
        return json.loads(out.splitlines()[-1])
    assert result("eval", live)["loss"] == result("eval", run_dir)["loss"]
    prompt = ("--prompt", "KING", "--max-new-tokens", "4")
    assert (result("generate", live, *prompt)["token_ids"]
            == result("generate", run_dir, *prompt)["token_ids"])
