"""Journey of issue 47: a user's own corpus, tokenizer and Llama recipe, start
to finish. A JSON Lines corpus, a byte-level BPE trained with `tokenizers`,
`data prepare` with it; an own Llama recipe trained at tp2 pp2 with live
replacement on, Ctrl-C, resumed at another layout to the end (equal to a
run at that layout from the start); then the finished run rerun, `eval`,
`generate` and `convert --to-hf`. On the way: the banner's threads, the
start-time line of live replacement at dp=1, the ranks' process names, the
checkpoints the default keeps, and goodput that books the Ctrl-C as no
failure."""
import json
import re
import time
from pathlib import Path

import psutil
import pytest

from tests.harness.journey import home, interrupt, megaresil, start, user_env  # noqa: F401
from tests.harness.run_records import assert_goodput_adds_up

pytestmark = [pytest.mark.journey, pytest.mark.slow]

VOCAB = 384
RECIPE = f"""\
# My own Llama: 2 layers, GQA 4/2, on my corpus and tokenizer.
model:
  flavour: llama
  num_layers: 2
  hidden_size: 64
  num_heads: 4
  num_kv_heads: 2
  ffn_hidden_size: 128
  vocab_size: {VOCAB}
  max_seq_len: 32
data:
  source: indexed
  path: data/corpus
  tokenizer: tok/tokenizer.json
  split: "90,5,5"
  seq_len: 32
parallel: {{tp: 2, pp: 2, dp: 1}}
train:
  steps: 12
  micro_batch_size: 2
  global_batch_size: 4
  eval_batches: 1
optimizer: {{lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 2}}
resilience:
  replacement: {{enabled: true}}
logging: {{tensorboard: false, progress: false}}
run: {{dir: runs/mine}}
"""
# Step 3 sleeps 5 s on rank 0: the Ctrl-C lands in it, so the job saves step 3.
SLOW_STEP_3 = "faults=[{kind: slow, rank: 0, step: 3, seconds: 5}]"
RESUMED = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=2"]


def corpus() -> list[str]:
    """Licence texts and Python sources, as the issue's corpus had."""
    licence = ("Permission is hereby granted, free of charge, to any person obtaining a copy "
               "of this software {i}, to deal in the Software without restriction. THE "
               "SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND {i}.")
    source = ("def step_{i}(state, batch):\n    loss = model(batch) * {i}\n    "
              "loss.backward()\n    return state.update(loss)\n")
    return [(licence if i % 2 else source).format(i=i) * 3 for i in range(160)]


def train_tokenizer(texts: list[str], path: Path) -> None:
    """The user's own 384-token byte-level BPE, trained with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.parent.mkdir()
    tokenizer.save(str(path))


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def wait_for_step(run_dir: Path, step: int, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and step in losses(run_dir):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} never came: {proc.communicate()[0][-3000:]}")


def worker_names(proc) -> set[str]:
    return {p.name() for p in psutil.Process(proc.pid).children(recursive=True)}


def test_own_corpus_tokenizer_and_llama_from_prepare_to_export(home):
    texts = corpus()
    (home / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_tokenizer(texts, home / "tok/tokenizer.json")
    megaresil("data", "prepare", "--input", "corpus.jsonl", "--tokenizer", "tok/tokenizer.json",
              "--output", "data/corpus", "--workers", "1", cwd=home)
    (home / "my-llama.yaml").write_text(RECIPE)

    # tp2 pp2 with live replacement: 4 processes, named by rank; Ctrl-C in step 3.
    proc = start("train", "my-llama.yaml", SLOW_STEP_3, cwd=home)
    wait_for_step(home / "runs/mine", 2, proc)
    names = worker_names(proc)
    interrupt(proc)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, output[-3000:]
    assert {f"megaresil-r{rank}" for rank in range(4)} <= names, names
    said = [line for line in output.splitlines() if "resilience.replacement.enabled" in line]
    assert len(said) == 1 and "at dp=1 no data-parallel peer" in said[0], output[-3000:]
    banner = next(line for line in output.splitlines() if "training tp=2 pp=2 dp=1" in line)
    assert re.search(r"; \d+ threads? per rank \(\d+ cores? over 4 ranks on this node; "
                     r"OMP_NUM_THREADS chooses\); starts at step 0$", banner), banner
    assert "interrupted: saved step 3" in output, output[-3000:]

    # The same recipe at tp1 pp1 dp2, one thread a rank, on to step 12; and a
    # run at that layout from the start, which it must equal.
    env = user_env(OMP_NUM_THREADS="1")
    resumed = megaresil("train", "my-llama.yaml", *RESUMED, cwd=home, env=env).stderr
    assert "1 thread per rank (OMP_NUM_THREADS=1); resumes from step 3" in resumed, resumed
    assert "resilience.replacement.enabled" not in resumed  # dp=2: state from a peer's memory
    loaded = [e for e in events(home / "runs/mine") if e["event"] == "checkpoint_loaded"]
    assert loaded[-1]["step"] == 3 and loaded[-1]["saved_layout"]["tp"] == 2
    megaresil("train", "my-llama.yaml", *RESUMED, "run.dir=runs/reference", cwd=home, env=env)
    mine, reference = losses(home / "runs/mine"), losses(home / "runs/reference")
    assert sorted(mine) == list(range(1, 13))
    assert mine == pytest.approx(reference, rel=1e-5)

    # Saved at 3 (Ctrl-C), then at most 3 steps apart (a quarter of 12), the
    # newest 3 kept; no failure in the goodput.
    root = home / "runs/mine/checkpoints"
    saved = [e["step"] for e in events(home / "runs/mine") if e["event"] == "checkpoint_saved"]
    assert len(saved) >= 4 and all(b - a <= 3 for a, b in zip(saved[1:], saved[2:])), saved
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{s:07d}" for s in saved[-3:]]
    goodput = json.loads((home / "runs/mine/goodput.json").read_text())
    assert_goodput_adds_up(goodput)
    assert goodput["interruptions"] == 0 and goodput["failed_s"] == 0.0
    assert goodput["restarts_s"] == 0.0 and goodput["idle_s"] > 0

    # The finished run, rerun: nothing starts, nothing is written.
    before = {name: (home / "runs/mine" / name).read_text()
              for name in ("events.jsonl", "metrics.jsonl", "goodput.json")}
    again = megaresil("train", "my-llama.yaml", *RESUMED, cwd=home, env=env).stderr
    assert again.splitlines() == [
        "megaresil: runs/mine is finished: the checkpoint a resume would load, "
        "runs/mine/checkpoints/step_0000012, is at step 12 (train.steps=12); nothing to train. "
        "Raise train.steps to train on, or give a new run.dir for a new run."], again
    assert {name: (home / "runs/mine" / name).read_text() for name in before} == before

    # Use it: eval equals the run's own last eval; generate; export for transformers.
    rows = [json.loads(line) for line in (home / "runs/mine/metrics.jsonl").read_text().splitlines()]
    valid = json.loads(megaresil("eval", "runs/mine", "--json", cwd=home).stdout.splitlines()[-1])
    assert valid["step"] == 12
    assert valid["loss"] == pytest.approx([r["eval_loss"] for r in rows if "eval_loss" in r][-1],
                                          rel=1e-5)
    test = json.loads(megaresil("eval", "runs/mine", "--split", "test", "--json",
                                cwd=home).stdout.splitlines()[-1])
    assert test["split"] == "test" and test["loss"] != valid["loss"]
    text = json.loads(megaresil("generate", "runs/mine", "--prompt", "def step_", "--json",
                                "--max-new-tokens", "4", cwd=home).stdout.splitlines()[-1])
    assert len(text["token_ids"]) == 4 and max(text["token_ids"]) < VOCAB
    megaresil("convert", "runs/mine", "--to-hf", "hf", cwd=home)
    assert_loads_in_transformers(home / "hf", home / "tok/tokenizer.json")


def assert_loads_in_transformers(hf: Path, own_tokenizer: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.model_type == "llama" and model.config.num_key_value_heads == 2
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == VOCAB
    sample = "def step_7(state, batch):\n    return state"
    exported = Tokenizer.from_file(str(hf / "tokenizer.json")).encode(sample).ids
    assert exported == Tokenizer.from_file(str(own_tokenizer)).encode(sample).ids
