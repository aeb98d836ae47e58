"""Journeys: a recipe by name from a fresh directory, then report, generate and eval\non the run; prepare JSON Lines and train a blend."""
import json

import pytest

from tests.harness.journey import home, megaresil  # noqa: F401  (home is a fixture)

pytestmark = pytest.mark.journey

TINY = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "train.steps=3",
        "data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2",
        "train.eval_batches=0", "logging.tensorboard=false"]


def test_recipes_lists_the_packaged_recipes(home):
    out = megaresil("recipes", cwd=home).stdout
    names = [line.split()[0] for line in out.splitlines()]
    assert {"gpt-tiny", "gpt2-124m", "llama-1b", "llama-3.2-1b"} <= set(names)


def test_train_a_recipe_by_name_from_a_fresh_directory(home):
    said = megaresil("train", "gpt-tiny", *TINY, "run.dir=runs/a", "checkpoint.interval=3",
                     cwd=home).stderr.splitlines()
    # The story ends with the summary, after the last checkpoint's line.
    assert "checkpoint saved: step 3" in said[-2] and said[-1].startswith("megaresil: done: 3 steps")
    assert said[-1].endswith("last checkpoint runs/a/checkpoints/step_0000003")
    rows = [json.loads(line) for line in (home / "runs/a/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert (home / "runs/a/checkpoints/step_0000003").is_dir()
    wrong = megaresil("train", "gpt-tny", cwd=home, check=False)
    assert wrong.returncode == 2 and "gpt-tiny" in wrong.stderr
    # Then what a user does with a finished run: look at it, use it.
    assert "wrote runs/a/report/index.html" in megaresil("report", "runs/a", cwd=home).stdout
    assert (home / "runs/a/report/goodput.png").is_file()
    text = megaresil("generate", "runs/a", "--prompt", "ROMEO:", "--max-new-tokens", "5",
                     cwd=home).stdout
    assert text.startswith("ROMEO:")
    line = megaresil("eval", "runs/a", "--batches", "1", cwd=home).stdout.splitlines()[-1]
    assert line.startswith("step 3: valid loss")


def test_prepare_jsonl_without_a_tokenizer_then_train_a_blend(home):
    texts = [f"Document {i}: to be or not to be, that is question {i}." * 3 for i in range(30)]
    for name, docs in (("a", texts), ("b", [t.upper() for t in texts])):
        (home / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    first = megaresil("data", "prepare", "--input", "a.jsonl", "--output", "data/a",
                      "--vocab-size", "300", "--workers", "1", cwd=home).stdout
    said = [line for line in first.splitlines() if line.startswith("tokenizer:")]
    assert len(said) == 1 and "BPE" in said[0] and "data/a_tokenizer.json" in said[0]
    assert (home / "data/a_tokenizer.json").is_file()
    second = megaresil("data", "prepare", "--input", "b.jsonl", "--output", "data/b",
                       "--tokenizer", "data/a_tokenizer.json", "--workers", "1", cwd=home).stdout
    assert "tokenizer:" not in second  # a tokenizer the user named needs no word
    megaresil("train", "gpt-tiny", *TINY, "run.dir=runs/blend", "data.source=indexed",
              "data.paths=[0.5, data/a, 0.5, data/b]", "data.split='90,10,0'",
              "data.tokenizer=data/a_tokenizer.json", "model.vocab_size=300", cwd=home)
    rows = (home / "runs/blend/metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]


def test_typos_on_the_command_line_get_a_suggestion_and_flavor_is_flavour(home):
    """Issue 47 item 8: as a typo in a recipe file gets "Did you mean", so does
    one on the command line; the recipe's optional overrides are not said to
    be required."""
    typo = megaresil("train", "gpt-tiny", "train.stpes=3", cwd=home, check=False)
    assert typo.returncode == 2
    assert ("megaresil: error: train.stpes: is not a recipe key. Did you mean train.steps? "
            "Fix: ") in typo.stderr
    shown = megaresil("config", "show", "gpt-tiny", "model.flavor=llama", cwd=home).stdout
    assert "flavour: llama" in shown and "flavor:" not in shown
    (home / "own.yaml").write_text("defaults: [model/gpt-tiny, data/shakespeare]\n"
                                   "model: {flavor: llama}\n")
    assert "flavour: llama" in megaresil("config", "show", "own.yaml", cwd=home).stdout
    bare = megaresil("train", cwd=home, check=False)
    assert bare.returncode == 2
    assert "the following arguments are required: recipe" in bare.stderr
    assert "KEY=VALUE" not in bare.stderr.splitlines()[-1]
