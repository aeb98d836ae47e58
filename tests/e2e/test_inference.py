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


def test_eval_on_a_split_equals_a_whole_trainers_eval(cli_main, run_dir, tmp_path):
    """`eval` reads a split's batches with the model alone; a Trainer built on
    the checkpoint (what eval built before) gives the same losses, bit for bit."""
    from megaresil.checkpoint.validation import read_manifest
    from megaresil.config import from_dict
    from megaresil.data.build import build_test_dataset
    from megaresil.inference import Use, inference_recipe
    from megaresil.parallel.layout import ParallelLayout
    from megaresil.train.loop import Trainer

    checkpoint = run_dir / "checkpoints/step_0000002"
    recipe = from_dict(read_manifest(checkpoint)["recipe"])
    cfg = inference_recipe(recipe, Use(), tmp_path, checkpoint, 1)
    trainer = Trainer(cfg, ParallelLayout.from_config(cfg.parallel, torch.device("cpu")))
    try:
        test = build_test_dataset(cfg.data, cfg.model.vocab_size, cfg.train.seed)
        expected = {"valid": trainer.evaluate(), "test": trainer.evaluate(test)}
    finally:
        trainer.close()
    for split, loss in expected.items():
        out = cli_main("eval", str(checkpoint), "--split", split, "--json").stdout
        assert json.loads(out.splitlines()[-1])["loss"] == loss, split


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


def test_prompts_run_as_one_batch_each_as_alone_and_the_context_bounds_them(cli_main, run_dir,
                                                                            tmp_path):
    """--prompt repeated and --prompts-file: one JSON line each, in order,
    equal to the prompt's own run; the context (gpt-tiny's 128 tokens) stops
    a long prompt's continuation with a line, and refuses a longer prompt."""
    def lines(*args: str):
        done = cli_main("generate", str(run_dir), "--max-new-tokens", "6", "--json", *args,
                        check=False)
        return done, [json.loads(line) for line in done.stdout.splitlines()]
    (tmp_path / "prompts.txt").write_text("JULIET:\n\nKING HENRY: Once more unto\n")
    _, batch = lines("--prompt", "ROMEO:", "--prompts-file", str(tmp_path / "prompts.txt"))
    assert [r["prompt"] for r in batch] == ["ROMEO:", "JULIET:", "KING HENRY: Once more unto"]
    assert lines("--prompt", "JULIET:")[1] == [batch[1]]
    near, long = prompt_of_tokens(run_dir, 125), prompt_of_tokens(run_dir, 129)
    stopped, [result] = lines("--prompt", near)
    assert len(result["token_ids"]) == 128 - 125 + 1 and result["stopped_at_context"]
    assert "prompt 1 reached the model's context" in stopped.stderr
    refused, _ = lines("--prompt", "JULIET:", "--prompt", long)
    assert refused.returncode == 2 and ("prompt 2 has 129 tokens, more than the model's "
                                        "context of 128") in refused.stderr


def prompt_of_tokens(run_dir, tokens: int) -> str:
    """A text the run's tokenizer reads as exactly `tokens` tokens."""
    from megaresil.checkpoint.validation import read_manifest
    from megaresil.config import from_dict
    from megaresil.data.build import recipe_tokenizer

    recipe = from_dict(read_manifest(run_dir / "checkpoints/step_0000004")["recipe"])
    tokenizer = recipe_tokenizer(recipe.data, recipe.model.vocab_size)
    text = tokenizer.decode(tokenizer.encode(" ".join(["ROMEO, JULIET"] * 200))[:tokens])
    assert len(tokenizer.encode(text)) == tokens
    return text


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


# Three documents for `eval --data`: one over two windows of data.seq_len
# (32), one of a few tokens, and an empty one (nothing to predict).
DOCUMENTS = ["ROMEO: But soft, what light through yonder window breaks? It is the east, and "
             "Juliet is the sun. Arise, fair sun, and kill the envious moon, who is already "
             "sick and pale with grief.", "KING HENRY: Once more unto the breach", ""]


def write_jsonl(path, texts) -> str:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


def eval_data(cli_main, run_dir, data: str, out) -> dict:
    cli_main("eval", str(run_dir), "--data", data, "--per-document", str(out))
    return json.loads(out.read_text())


def model_losses(run_dir, documents: list[list[int]]) -> list[float]:
    """Each document's mean loss by the model's own training loss, window by
    window as docs/inference.md says `eval --data` scores."""
    from megaresil.inference import Use, run_on_model

    def job(loaded, checkpoint, step):
        L, losses = loaded.cfg.data.seq_len, []
        with torch.no_grad():
            for ids in documents:
                pieces = [torch.tensor([ids[s:s + L + 1]]) for s in range(0, len(ids) - 1, L)]
                total = sum(float(loaded.model(p[:, :-1], p[:, 1:])) * (p.shape[1] - 1)
                            for p in pieces)
                losses.append(total / (len(ids) - 1))
        return {"losses": losses}
    return run_on_model(run_dir / "checkpoints/step_0000004", 1, Use(eval_batches=0), job)["losses"]


def test_eval_data_scores_each_document_as_the_model_does(cli_main, run_dir, tmp_path):
    from megaresil.checkpoint.validation import read_manifest
    from megaresil.config import from_dict
    from megaresil.data.build import recipe_tokenizer
    from megaresil.data.documents import run_tokenizer

    result = eval_data(cli_main, run_dir, write_jsonl(tmp_path / "d.jsonl", DOCUMENTS),
                       tmp_path / "per.json")
    per = result["per_document"]
    assert [d["index"] for d in per] == [0, 1, 2] and per[2]["tokens"] == 0
    assert per[2]["loss"] is None and per[0]["tokens"] > 32  # scored over two windows
    assert result["tokens"] == per[0]["tokens"] + per[1]["tokens"]
    weighted = sum(d["loss"] * d["tokens"] for d in per[:2]) / result["tokens"]
    assert result["loss"] == pytest.approx(weighted, rel=1e-6)
    recipe = from_dict(read_manifest(run_dir / "checkpoints/step_0000004")["recipe"])
    tokenizer = recipe_tokenizer(recipe.data, recipe.model.vocab_size)
    ids = [tokenizer.encode(text) + [tokenizer.eod_id] for text in DOCUMENTS[:2]]
    assert [d["tokens"] for d in per[:2]] == [len(i) - 1 for i in ids]
    assert [d["loss"] for d in per[:2]] == pytest.approx(model_losses(run_dir, ids), rel=1e-5)
    alone = eval_data(cli_main, run_dir, write_jsonl(tmp_path / "one.jsonl", DOCUMENTS[1:2]),
                      tmp_path / "one.json")
    assert alone["per_document"][0] == {**per[1], "index": 0}
    # The same texts prepared with the run's tokenizer (data prepare skips the
    # empty one): the same figures.
    cli_main("data", "prepare", "--input", str(tmp_path / "d.jsonl"), "--output",
             str(tmp_path / "same"), "--tokenizer",
             run_tokenizer(recipe.data, recipe.model.vocab_size)[1])
    indexed = eval_data(cli_main, run_dir, str(tmp_path / "same"), tmp_path / "idx.json")
    assert indexed["loss"] == result["loss"] and indexed["documents"] == 2
    assert [d["loss"] for d in indexed["per_document"]] == [d["loss"] for d in per[:2]]


def test_eval_data_refusals_name_the_fix_and_write_nothing(cli_main, run_dir, tmp_path):
    (tmp_path / "half.bin").write_bytes(b"")
    cli_main("data", "prepare", "--input", write_jsonl(tmp_path / "d.jsonl", DOCUMENTS[:2]),
             "--output", str(tmp_path / "bytes"), "--tokenizer", "byte")
    (tmp_path / "bad.jsonl").write_text('{"body": "KING"}\n')
    out = tmp_path / "per.json"
    for data, problem in ((tmp_path / "missing.jsonl", "no such file"),
                          (tmp_path / "half", "half.idx: no such file"),
                          (tmp_path / "bad.jsonl", 'line 1 has no "text"'),
                          (tmp_path / "bytes", "was prepared with byte")):
        done = cli_main("eval", str(run_dir), "--data", str(data), "--per-document", str(out),
                        check=False)
        error = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and problem in error and "Fix:" in error, done.stderr
        assert not out.exists()
    done = cli_main("eval", str(run_dir), "--per-document", str(out), check=False)
    assert done.returncode == 2 and "needs --data" in done.stderr and not out.exists()
