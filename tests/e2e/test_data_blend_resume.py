"""Through the CLI: prepare two JSON Lines corpora with a Hugging Face
tokenizer, train on their blend at dp=2, stop, resume at dp=1, and match the
uninterrupted dp=1 run bit for bit."""
import json

import pytest

from megaresil.events import read_metrics
from tests.unit.test_data_blend import TEXTS, llama_style_tokenizer

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "data.seq_len=16",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=4",
        "train.eval_batches=1", "train.eval_interval=2", "optimizer.warmup_steps=1",
        "parallel.tp=1", "parallel.pp=1", "logging.progress=false", "logging.tensorboard=false"]


def losses(run_dir) -> list[tuple[int, str, float]]:
    return [(r["step"], "eval" if "eval_loss" in r else "train", r.get("eval_loss", r.get("loss")))
            for r in read_metrics(run_dir)]


@pytest.mark.slow
def test_blend_of_prepared_corpora_resumes_at_another_dp_bit_for_bit(cli, cli_main, tmp_path,
                                                                     monkeypatch):
    # One intra-op thread in every run: the launcher gives a lone worker all
    # the cores and dp=2's workers one each, and torch's CPU kernels may round
    # differently with another thread count (seen here: the eval loss in its
    # last bit). Bit-equality across dp is about the layout, not the threads.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tokenizer = llama_style_tokenizer(tmp_path / "tokenizer", vocab_size=300)
    prefixes = []
    for name, texts in (("a", TEXTS), ("b", [t.upper() for t in TEXTS])):
        corpus = tmp_path / f"{name}.jsonl"
        corpus.write_text("".join(json.dumps({"content": t}) + "\n" for t in texts))
        result = cli_main("data", "prepare", "--input", str(corpus), "--json-key", "content",
                          "--tokenizer", str(tokenizer), "--workers", "2",
                          "--output", str(tmp_path / name))
        assert "prepared 40 documents" in result.stdout and "tokens/s" in result.stdout
        prefixes.append(str(tmp_path / name))

    data = ["data.source=indexed", f"data.paths=[0.7, {prefixes[0]}, 0.3, {prefixes[1]}]",
            "data.split='90,10,0'", f"data.tokenizer={tokenizer}", "model.vocab_size=300", *TINY]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    cli("train", "recipes/gpt-tiny.yaml", f"run.dir={whole}", "parallel.dp=1", *data)
    cli("train", "recipes/gpt-tiny.yaml", f"run.dir={resumed}", "parallel.dp=2",
        "train.exit_at_step=2", *data)
    cli("train", "recipes/gpt-tiny.yaml", f"run.dir={resumed}", "parallel.dp=1", *data)
    assert len(losses(whole)) == 6  # 4 steps, 2 evals
    assert losses(resumed) == losses(whole)
