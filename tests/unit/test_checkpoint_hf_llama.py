"""Hugging Face in and out, the whole way: a tiny random Llama 3.2-style
model (RoPE scaling, tied embeddings, GQA) with its tokenizer, started from
with `megaresil train --from-hf` at pp=2, exported with --to-hf (sharded,
tokenizer files, readable permissions) and used by transformers; imports of
sharded and malformed directories; tokenizer exports of megaresil's own
tokenizers; hyper-parameters carried from config.json."""
from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.harness.cli import ROOT
from tests.harness.hf import llama32_style, megaresil_model
from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.hf import io as hf_io
from megaresil.checkpoint.hf.io import HFTensorSource, HFWeights, hf_model_keys
from megaresil.checkpoint.sharded import Rect
from megaresil.cli import main
from megaresil.config import ConfigError, from_dict, load_recipe, to_dict
from megaresil.data.tokenizer import ByteTokenizer, build_tokenizer
from megaresil.events import read_events, read_metrics
from megaresil.launch.from_hf import check_hf_init, resolve_from_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

QUIET = ["logging.progress=false", "logging.tensorboard=false"]
TEXT = "To be, or not to be, that is the question"


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def save_tokenizer(directory: Path) -> None:
    """A byte-level BPE with Llama 3's bos/eos tokens at the config's ids 1 and 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<pad>", "<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20, trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                         eos_token="<|end_of_text|>").save_pretrained(directory)


def committed(directory: Path, name: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if name in p.name)


@pytest.mark.slow
def test_from_hf_trains_at_pp2_exports_and_generates_with_transformers(cli, cli_main, tmp_path):
    hf_dir, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "export"
    llama32_style(attention_dropout=0.1).save_pretrained(hf_dir)
    save_tokenizer(hf_dir)
    result = cli("train", "recipes/llama-3.2-1b.yaml", "--from-hf", str(hf_dir), f"run.dir={run}",
                 "data.source=synthetic", "data.path=null", "data.seq_len=32", "parallel.tp=1",
                 "parallel.pp=2", "parallel.dp=1", "train.micro_batch_size=2", "train.global_batch_size=4",
                 "train.steps=3", "train.eval_batches=0", "optimizer.warmup_steps=1",
                 "checkpoint.interval=3", *QUIET)
    assert re.search(r"model.num_layers +16 -> 4", result.stderr)  # the recipe's 16 is replaced, and said
    (started,) = [e for e in read_events(run) if e["event"] == "initialized_from"]
    assert started["source"] == "hugging_face" and started["step"] == 0
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    checkpoint = run / "checkpoints" / fmt.step_dir_name(3)
    assert from_dict(json.loads((checkpoint / fmt.MANIFEST).read_text())["recipe"]) \
        .model.attention_dropout == 0.1  # carried over from config.json

    # In-process: the export starts no process of its own (a subprocess: ~7 s of imports).
    cli_main("convert", str(checkpoint), "--to-hf", str(out), "--max-shard-size", "100KB")
    shards = committed(out, "-of-")
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3" and config["tie_word_embeddings"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    original = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer(TEXT)["input_ids"] == original(TEXT)["input_ids"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.tensor([original(TEXT)["input_ids"]])
    with torch.no_grad():
        assert relative_error(model(tokens).logits,
                              megaresil_model(checkpoint).logits(tokens)) <= 1e-5
    generate = transformers.pipeline("text-generation", model=str(out))
    text = generate("To be", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("To be") and len(text) > len("To be")


def test_sharded_import_reads_a_tensor_when_needed_and_gives_the_same_logits(tmp_path,
                                                                             monkeypatch):
    hf = llama32_style()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert len(committed(tmp_path / "hf", "-of-")) > 1
    reads = []
    get = HFWeights.get
    monkeypatch.setattr(HFWeights, "get", lambda self, key: reads.append(key) or get(self, key))
    cfg = from_dict({"model": hf_model_keys(tmp_path / "hf")[0]}).model
    source = HFTensorSource(HFWeights(tmp_path / "hf"), cfg)
    assert reads == []  # the shards' headers only
    qkv = source.tensors["model/layers.1.attn.qkv.weight"]["global_shape"]
    source.read([Rect("model/layers.1.attn.qkv.weight", tuple(qkv), (0, 0), torch.empty(qkv))])
    assert reads == [f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv"]
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                 "--tp", "2", "--pp", "2"]) == 0
    tokens = torch.randint(0, 300, (1, 96))
    with torch.no_grad():
        assert relative_error(megaresil_model(tmp_path / "ckpt").logits(tokens),
                              hf(tokens).logits) <= 1e-5


def rewrite_weights(directory: Path, change) -> None:
    path = directory / "model.safetensors"
    weights = safetensors_torch.load_file(path)
    change(weights)
    safetensors_torch.save_file(weights, path, metadata={"format": "pt"})


@pytest.mark.parametrize("change,needle", [
    (lambda w: w.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
     "holds 1 tensor.s. .model.layers.0.self_attn.q_norm.weight"),
    (lambda w: w.pop("model.layers.3.mlp.up_proj.weight"), "lacks 1 tensor.s. .model.layers.3"),
    (lambda w: w.update({"lm_head.weight": torch.zeros(300, 64)}), "lm_head.weight differs"),
])
def test_weights_the_config_does_not_account_for_are_refused(tmp_path, change, needle):
    llama32_style().save_pretrained(tmp_path / "hf")
    rewrite_weights(tmp_path / "hf", change)
    cfg = from_dict({"model": hf_model_keys(tmp_path / "hf")[0]}).model
    with pytest.raises(fmt.CheckpointError, match=needle):
        HFTensorSource(HFWeights(tmp_path / "hf"), cfg)


def test_gpt2_dropout_carries_over_and_a_difference_is_said(tmp_path, capsys):
    config = transformers.GPT2Config(vocab_size=300, n_positions=128, n_embd=32, n_layer=1,
                                     n_head=2, resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.05)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert "embd_pdrop=0.2 and resid_pdrop=0.1" in capsys.readouterr().err
    model = json.loads((tmp_path / "ckpt" / fmt.MANIFEST).read_text())["recipe"]["model"]
    assert (model["dropout"], model["attention_dropout"]) == (0.1, 0.05)


@pytest.mark.parametrize("kind,vocab,text", [("byte", 300, "héllo wörld\n"),
                                             ("gpt2", 50257, "Hello world, héllo!")])
def test_megaresils_tokenizers_export_as_the_same_encoding(tmp_path, kind, vocab, text):
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=128, n_embd=8, n_layer=1,
                                     n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out"),
                 "--tokenizer", kind]) == 0
    ours = ByteTokenizer() if kind == "byte" else build_tokenizer("gpt2")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert exported(text)["input_ids"] == ours.encode(text)
    assert exported.decode(ours.encode(text)) == text
    assert exported.eos_token_id == ours.eod_id
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == ours.eod_id


MOE_RECIPE = ROOT / "recipes" / "moe-tiny.yaml"
MOE_REFUSED = "model.moe: .* of a mixture of experts is not supported yet"


def test_an_moe_recipe_is_refused_from_hugging_face_weights(tmp_path, capsys):
    llama32_style().save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match=MOE_REFUSED):
        resolve_from_hf(tmp_path / "hf", str(MOE_RECIPE), [])
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                 "--recipe", str(MOE_RECIPE)]) == 2
    assert len(re.findall(MOE_REFUSED, capsys.readouterr().err)) == 1
    assert not (tmp_path / "ckpt").exists()
    cfg = load_recipe(MOE_RECIPE, [f"checkpoint.init_from={tmp_path / 'hf'}",
                                   f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=MOE_REFUSED):
        check_hf_init(cfg, from_hf=False)


def test_an_moe_checkpoint_is_refused_by_hugging_face_export(tmp_path, monkeypatch):
    recipe = to_dict(load_recipe(MOE_RECIPE))
    source = SimpleNamespace(manifest={"recipe": recipe}, verify=lambda: None)
    monkeypatch.setattr(hf_io, "open_source", lambda src: source)
    with pytest.raises(fmt.CheckpointError, match="is a mixture of experts, which Hugging Face "
                                                  "export does not convert yet"):
        hf_io.export_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
